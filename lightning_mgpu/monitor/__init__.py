"""Scaling report: where each step's time goes (compute, communication per axis, bubble, data wait), MFU, memory.

``timing``: timers and the reversible patches around collectives and the data fetch; ``measures``: FLOPs, peaks
and memory; ``report``: the JSON/table/plot; ``diagnose``: plain-word advice; ``callback``: ``ScalingMonitor``.
"""

from lightning_mgpu.monitor.callback import ScalingMonitor
from lightning_mgpu.monitor.report import FIELDS

__all__ = ["FIELDS", "ScalingMonitor"]
