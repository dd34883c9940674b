"""Rendezvous ports: one free now, outside the range the kernel hands out to every other socket."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A TCP port nothing listens on now, for a job's rendezvous (``MASTER_PORT``), picked outside the kernel's
    ephemeral range.

    The usual pick (bind port 0, read it, close) is free only until the socket closes, and that range is exactly
    where every gloo process group's listeners and every outgoing connection get their ports: a job running beside
    this one could take it before rank 0's store binds it (EADDRINUSE). The kernel never hands out a port below
    that range on its own.
    """
    low, high = _ephemeral_ports()
    choices = [port for port in range(10_000, 65_536) if not low <= port <= high]
    pick = random.SystemRandom()  # not the `random` module's state: seeded alike in processes forked from one parent
    for _ in range(100):
        with socket.socket() as sock:
            try:
                sock.bind(("", pick.choice(choices) if choices else 0))  # every address, as the store listens
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError(f"No free TCP port outside the ephemeral range {low}-{high} after 100 tries.")


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):  # not Linux: the IANA dynamic range, which macOS hands out
        low, high = 49152, 65535
    return low, high
