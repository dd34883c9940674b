"""The strategy's checkpoint hooks: save (sharded or full, synchronous or in the background), load, remove."""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar, cast

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.trainer.states import RunningStage, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.optim import Optimizer

from lightning_mgpu._compat.dcp import flatten_state_dict, load_without_process_group
from lightning_mgpu._compat.lightning import attached_trainer
from lightning_mgpu.checkpoint import format as fmt
from lightning_mgpu.checkpoint import resume, states
from lightning_mgpu.checkpoint.flat_fragments import FragmentSavePlanner
from lightning_mgpu.checkpoint.format import INFO_KEY, LAYOUT_KEY, MODEL_KEY, OPTIMIZER_KEY, CheckpointError
from lightning_mgpu.checkpoint.lightning_dirs import LightningShardedReader

_T = TypeVar("_T")


class _RankRecord(TypedDict):
    """What each rank adds to a save's metadata: its RNG states and the FQNs of its optimizers' param groups."""

    rng: dict[str, object]
    groups: list[list[list[str]]]


if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future as TorchFuture

    from lightning_mgpu.checkpoint.states import StateAccess
    from lightning_mgpu.layout import ParallelLayout


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _all_gather_object(obj: _T) -> list[_T]:
    if not _distributed():
        return [obj]
    gathered: list[_T | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return cast("list[_T]", gathered)  # every rank's `obj`


def _gather_object(obj: _T, group: ProcessGroup | None = None) -> list[_T]:
    """Every rank's ``obj`` on global rank 0 (``[]`` elsewhere)."""
    if not _distributed():
        return [obj]
    gathered: list[_T | None] | None = [None] * dist.get_world_size() if _rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0, group=group)
    return cast("list[_T]", gathered or [])  # every rank's `obj`


def _broadcast_object(obj: _T) -> _T:
    if not _distributed():
        return obj
    container = [obj]
    dist.broadcast_object_list(container, src=0)
    return container[0]


def _broadcast_path(path: str | os.PathLike) -> Path:
    return Path(_broadcast_object(str(path)))


def layout_record(layout: ParallelLayout) -> dict[str, int]:
    record = dataclasses.asdict(layout)
    record["world_size"] = layout.world_size
    return record


def hf_models(module: nn.Module) -> dict[str, dict[str, str]]:
    """Children of the LightningModule that are Hugging Face ``PreTrainedModel``s: their prefix and config."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return {}
    found = {}
    for name, child in module.named_children():
        if isinstance(child, transformers.PreTrainedModel):
            found[name] = {"class": type(child).__name__, "config": child.config.to_json_string()}
    return found


class _RecordingWriter(FileSystemWriter):
    """DCP's file writer, remembering the files this rank wrote, to checksum them."""

    written: Sequence[str] = ()

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        future = super().write_data(plan, planner)
        self.written = sorted({result.storage_data.relative_path for result in future.wait()})
        return future


def _checksum_written(staging: Path, writer: _RecordingWriter) -> dict[str, dict[str, int | str]] | str:
    """This rank's part of the manifest: the records of the shards it wrote (from the page cache), or why not."""
    try:
        return {name: fmt.checksum(staging / name) for name in writer.written}
    except Exception as error:  # reported through the gather that every rank joins
        return f"{type(error).__name__}: {error}"


def _manifest(parts: list[dict[str, dict[str, int | str]] | str], staging: Path) -> None:
    """On global rank 0, once every rank's part is in: add the files rank 0 wrote last and write the manifest."""
    failed = [(rank, part) for rank, part in enumerate(parts) if isinstance(part, str)]
    if failed:
        raise CheckpointError(f"checksumming the shards of rank {failed[0][0]} failed: {failed[0][1]}")
    checksums = cast("list[dict[str, dict[str, int | str]]]", parts)  # none failed
    records = {name: record for part in checksums for name, record in part.items()}
    for name in (fmt.DCP_INDEX, fmt.METADATA_FILE):
        records[name] = fmt.checksum(staging / name)
    fmt.write_manifest(staging, records)


class _PendingSave:
    """An asynchronous save: DCP writes in a thread, every rank checksums its shards, then global rank 0 writes
    the manifest and publishes the directory."""

    def __init__(
        self, future: Any, staging: Path, path: Path, writer: _RecordingWriter, group: ProcessGroup | None
    ) -> None:
        self.path = path
        self._staging = staging
        self._writer = writer
        self._group = group
        self._error: BaseException | None = None
        self._done = threading.Event()
        future.add_done_callback(self._finish)

    def _finish(self, future: Future[None]) -> None:
        try:
            failure = None
            try:
                future.result()
            except BaseException as error:
                failure = error
            # Every rank gathers exactly once, failed or not, so that none waits for another.
            part = f"{type(failure).__name__}: {failure}" if failure else _checksum_written(self._staging, self._writer)
            parts = _gather_object(part, self._group)
            if failure is not None:
                raise failure
            if _rank() == 0:
                _manifest(parts, self._staging)
                fmt.publish(self._staging, self.path)
                _say_how_to_load_once(self.path)
        except BaseException as error:  # surfaced by `wait`
            self._error = error
        finally:
            self._done.set()

    def wait(self, agree: bool) -> None:
        """Block until done; raise its error. With ``agree`` (a collective), every rank raises if any rank's
        part failed, so that no rank goes on into collectives the others have left."""
        self._done.wait()
        error = self._error
        failures: list[tuple[int, BaseException | str]] = [(_rank(), error)] if error is not None else []
        if agree and _distributed():
            reports = _all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
            failures = [(rank, report) for rank, report in enumerate(reports) if report is not None]
        if failures:
            rank, report = failures[0]
            if isinstance(report, BaseException):
                report = f"{type(report).__name__}: {report}"
            raise CheckpointError(f"The asynchronous save of {self.path} failed (rank {rank}): {report}") from error


class Checkpointer:
    """Save and load a LightningModule and its optimizers whatever the layout; owned by ``HybridStrategy``."""

    def __init__(
        self, checkpoint_format: str = "full", async_save: bool = False, state_access: StateAccess | None = None
    ) -> None:
        if async_save and checkpoint_format != "sharded":
            raise ValueError("`async_checkpoint=True` needs `checkpoint_format='sharded'`.")
        # How the live states are read and written: the `states` module, or an object with the same functions
        # for an engine that keeps its own partitions (`backends.deepspeed.DeepSpeedStates`).
        self.states: StateAccess = state_access if state_access is not None else states
        self.checkpoint_format = checkpoint_format
        self.async_save = async_save
        self._pending: _PendingSave | None = None
        self._async_group: ProcessGroup | None = None
        self._resuming = False
        self._saved_data: dict[str, int] | None = None  # the resumed checkpoint's `resume.data_record`

    # ------------------------------------------------------------------------------------------------------ save
    def save(
        self,
        checkpoint: Mapping[str, object],
        filepath: str | os.PathLike,
        model: nn.Module,
        optimizers: list[Optimizer],
        layout: ParallelLayout,
    ) -> None:
        """Write ``checkpoint`` (Lightning's dict) with the model's and optimizers' states. Collective."""
        path = _broadcast_path(filepath)
        self.wait(agree=True)
        with_optimizers = OPTIMIZER_KEY in checkpoint  # Lightning leaves it out for `save_weights_only`
        live_key, state = _model_entries(checkpoint, self.states.model_state(model))
        groups: list[list[list[str]]] = []
        if with_optimizers:
            optimizer_states = [self.states.optimizer_state(model, optimizer) for optimizer in optimizers]
            state[OPTIMIZER_KEY] = optimizer_states
            groups = [self.states.group_fqns(model, o, s) for o, s in zip(optimizers, optimizer_states)]
        gathered = _gather_object(_RankRecord(rng=states.collect_rng_states(), groups=groups))
        # Lightning's entries, read back by name (`meta[INFO_KEY]["format"]`): values of any type.
        meta: dict[str, Any] = {k: v for k, v in checkpoint.items() if k not in (*state, OPTIMIZER_KEY, "loops")}
        meta[resume.DATA_KEY] = resume.data_record(attached_trainer(model), layout.data_parallel_size)
        if "loops" in checkpoint:
            meta["loops"] = copy.deepcopy(checkpoint["loops"])
            resume.align_loops_with_data(meta)  # e.g. saved after `fit` stopped mid-epoch: where the data stopped
        meta[LAYOUT_KEY] = layout_record(layout)
        meta[INFO_KEY] = {
            "format_version": fmt.FORMAT_VERSION,
            "format": self.checkpoint_format,
            "rng_states": [g["rng"] for g in gathered],
            "optimizer_param_groups": states.merge_group_fqns([g["groups"] for g in gathered]),
            "hf_models": hf_models(model),
            "live_model_key": live_key,
        }
        staging = fmt.partial_path(path)
        if _rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            fmt.remove(staging)  # what an earlier interrupted save left
            staging.mkdir()
        _barrier()
        writer = _RecordingWriter(staging)
        if self.async_save and _fit_goes_on(model):
            if _rank() == 0:
                fmt.write_file(meta, staging / fmt.METADATA_FILE)
            group = self._checkpoint_group()
            future = dcp.async_save(
                state, storage_writer=writer, checkpoint_id=staging, process_group=group, planner=FragmentSavePlanner()
            )
            self._pending = _PendingSave(future, staging, path, writer, group)
            return
        dcp.save(state, storage_writer=writer, checkpoint_id=staging, planner=FragmentSavePlanner())
        # Checksummed for a directory, also under "full": rank 0 may have to publish the shards as they are.
        parts = _gather_object(_checksum_written(staging, writer))
        error = None
        if _rank() == 0:
            try:
                self._finish_on_rank_zero(staging, path, meta, parts)
            except Exception as caught:
                error = caught
        # Nobody goes on (to load, delete, or exit) before the checkpoint is in place, and all fail together.
        failure = _broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
        if failure is not None:
            raise CheckpointError(f"Saving {path} failed on global rank 0: {failure}") from error

    def _finish_on_rank_zero(
        self, staging: Path, path: Path, meta: dict[str, Any], parts: list[dict[str, dict[str, int | str]] | str]
    ) -> None:
        if self.checkpoint_format == "full" and _fits_in_memory(staging, path):
            from lightning_mgpu.checkpoint.convert import write_full_file

            finished = staging / "full.ckpt"
            write_full_file(staging, meta, finished)  # tensor by tensor: rank 0 holds the largest, not the model
            fmt.publish(finished, path)
            fmt.remove(staging)
            return
        meta[INFO_KEY]["format"] = "sharded"
        fmt.write_file(meta, staging / fmt.METADATA_FILE)
        _manifest(parts, staging)
        fmt.publish(staging, path)
        _say_how_to_load_once(path)

    def _checkpoint_group(self) -> ProcessGroup | None:
        # The background thread's collectives must not interleave with training's on the default group.
        if _distributed() and self._async_group is None:
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def wait(self, agree: bool = False) -> None:
        """Block until a background save is on disk; raise its error, if any (on every rank with ``agree``,
        which is then a collective: it is used where every rank is saving, loading or removing together)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait(agree)

    def remove(self, filepath: str | os.PathLike) -> None:
        path = Path(filepath)
        if self._pending is not None and self._pending.path == path:
            self.wait(agree=True)
        if _rank() == 0:
            fmt.remove(path)

    # ------------------------------------------------------------------------------------------------------ load
    def load(
        self,
        filepath: str | os.PathLike,
        model: nn.Module,
        optimizers: list[Optimizer],
        strict: bool = True,
        weights_only: bool | None = None,
        fitting: bool = True,
    ) -> dict[str, Any]:  # Lightning's checkpoint dict, whose entries its hooks read by name
        """Load a sharded directory or a full file (ours or any single-device Lightning checkpoint) into
        ``model`` and, when ``fitting``, ``optimizers`` and the RNGs; return Lightning's part. Collective."""
        self.wait(agree=True)
        path = _broadcast_path(filepath)
        fmt.check_exists(path)
        _check_intact(path)
        optimizers = optimizers if fitting else []
        if path.is_dir():
            index = fmt.check_sharded(path).state_dict_metadata
            meta = fmt.load_file(path / fmt.METADATA_FILE, weights_only)
            # Lightning's ModelParallelStrategy/FSDPStrategy name the entries their way: read under ours.
            by_lightning = fmt.written_by_lightning(index)
            reader: FileSystemReader = LightningShardedReader(path) if by_lightning else FileSystemReader(path)
            self.states.load_states(reader, model, optimizers, strict, str(path), checkpoint_id=path)
            moved = _moved_model_keys(meta)
            if moved:  # whole, for the hook that moved them (every rank holds such copies whole, as under DDP)
                meta.update(states.laid_out_as_live(load_without_process_group(path, moved), model))
        else:
            meta = fmt.load_file(path, weights_only)
            if MODEL_KEY not in meta:
                raise CheckpointError(f"{path} has no `{MODEL_KEY}`: it is not a Lightning checkpoint.")
            flat = _flatten_full(meta, model, optimizers, path)
            self.states.load_states(fmt.FlatReader(flat), model, optimizers, strict, str(path))
            kept = _moved_model_keys(meta)
            meta = {k: v for k, v in meta.items() if k not in (MODEL_KEY, OPTIMIZER_KEY) or k in kept}
            meta.update(states.laid_out_as_live({k: meta[k] for k in kept if k in meta}, model))
        resume.align_loops_with_data(meta)  # for checkpoints saved by an earlier version
        data_record = meta.pop(resume.DATA_KEY, None)
        if fitting:
            self._saved_data = data_record
            rng_states = meta.get(INFO_KEY, {}).get("rng_states")
            if rng_states:
                states.set_rng_states(rng_states[_rank() % len(rng_states)])
            self._resuming = True
        return meta

    def process_dataloader(self, dataloader: object, trainer: pl.Trainer, data_parallel_size: int) -> object:
        """After a mid-epoch resume, the training loader continues where the checkpoint's epoch stopped, in samples
        (the data-parallel size or the per-rank batch may have changed since)."""
        if not self._resuming or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        self._resuming = False
        saved, self._saved_data = self._saved_data, None
        skip, epoch = resume.batches_to_skip(trainer, saved["accumulate_grad_batches"] if saved else None)
        batch = resume.loader_batch_size(dataloader)
        if saved is not None and batch is not None:
            skip = resume.continue_in_samples(trainer, skip, saved, batch * data_parallel_size)
        if not skip:
            return dataloader
        # Lightning warns that a plain loader cannot resume mid-epoch; this one does.
        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
        return resume.FastForward(dataloader, skip, epoch)


def _fits_in_memory(staging: Path, path: Path) -> bool:
    """Whether the whole state (what a full file holds) fits in half of this host's free memory, which joining the
    shards into one file needs; if not, the directory is published instead, with a warning saying so."""
    needed = fmt.state_bytes(staging)
    free = fmt.free_memory_bytes()
    if free is None or needed <= free // 2:
        return True
    warnings.warn(
        f"Saved {path} as a sharded checkpoint (a directory), not as one file: its states ({needed / 2**30:.1f} GiB)"
        f" would not fit in half of global rank 0's free memory ({free / 2**30:.1f} GiB), which joining them into"
        " one file needs. It resumes like a file in any layout; `lightning-mgpu consolidate` writes the file that"
        " `MyModule.load_from_checkpoint` reads, on a machine with the memory. Pass checkpoint_format='sharded' to"
        " choose directories from the start.",
        stacklevel=2,
    )
    return False


_TOLD_HOW_TO_LOAD: set[str] = set()


def _say_how_to_load_once(path: Path) -> None:
    """A sharded checkpoint is a directory, which ``LightningModule.load_from_checkpoint`` opens only where this
    package is imported (elsewhere Lightning fails with ``IsADirectoryError`` and no hint): said once per directory
    of checkpoints, where the save happens."""
    if str(path.parent) in _TOLD_HOW_TO_LOAD:
        return
    _TOLD_HOW_TO_LOAD.add(str(path.parent))
    rank_zero_info(
        f"{path} is a sharded checkpoint (a directory): `trainer.fit/validate/test(ckpt_path=...)` and"
        " `HybridStrategy(pretrained=...)` read it in any layout, and `MyModule.load_from_checkpoint` where"
        " lightning_mgpu is imported; elsewhere Lightning reads one file, which"
        f" `lightning-mgpu consolidate {path} model.ckpt` writes (or save with checkpoint_format='full')."
    )


def _model_entries(
    checkpoint: Mapping[str, object], live: Mapping[str, object]
) -> tuple[str | None, dict[str, object]]:
    """The model states to write, by top-level key, and the key holding the live module's.

    Lightning's ``state_dict`` entry is a ``LiveModelState`` (``lightning_module_state_dict``) until a checkpoint
    hook moves it: ``EMAWeightAveraging`` puts it under ``current_model_state`` and its averaged weights under
    ``state_dict``, which is then written as the hook left it, as under DDP. ``None``: no key holds it any more.
    """
    live_key = next((key for key, value in checkpoint.items() if isinstance(value, fmt.LiveModelState)), None)
    entries: dict[str, object] = {} if live_key is None else {live_key: live}
    if live_key != MODEL_KEY:
        moved = checkpoint.get(MODEL_KEY) or {}
        entries[MODEL_KEY] = states.describable(moved) if isinstance(moved, Mapping) else moved
    return live_key, entries


def _moved_model_keys(meta: dict[str, Any]) -> set[str]:
    """The model-state entries a checkpoint hook moved at save (``_model_entries``): returned whole to Lightning,
    whose hooks read them back (``EMAWeightAveraging.on_load_checkpoint``); empty for every other checkpoint, whose
    model states only the live module receives."""
    live_key = meta.get(INFO_KEY, {}).get("live_model_key", MODEL_KEY)
    return set() if live_key == MODEL_KEY else {MODEL_KEY} | ({live_key} if live_key else set())


def _fit_goes_on(model: nn.Module) -> bool:
    """Whether training continues after this save: a background save after `fit` returned would never finish."""
    trainer = attached_trainer(model)
    return trainer is not None and trainer.state.status == TrainerStatus.RUNNING


def _plain_optimizer_mismatch(path: Path, error: CheckpointError) -> str:
    """A plain Lightning checkpoint lists optimizer states by position among the whole model's parameters; a
    pipeline stage's optimizer holds only its own, so the positions cannot be matched: say how to convert it."""
    return (
        f"{path} is a plain Lightning checkpoint (DDPStrategy, or FSDPStrategy/ModelParallelStrategy's full file),"
        f" whose optimizer states are listed by position among all of the model's parameters, and this rank's"
        f" optimizer differs ({error}): a pipeline stage holds part of them. Convert it once: fit with"
        " pipeline_parallel_size=1 (any data or tensor parallelism, ZeRO stage), ckpt_path set to it and max_steps"
        " at its global step (nothing trains), then trainer.save_checkpoint(...): that checkpoint names each state by"
        " its parameter and resumes under any layout."
    )


def _check_intact(path: Path) -> None:
    """Every rank verifies its share of the checkpoint's files; all raise if any file is damaged. Collective."""
    world_size = dist.get_world_size() if _distributed() else 1
    try:
        problems = fmt.verify(path, _rank(), world_size)
    except Exception as error:  # an unreadable file: reported through the gather that every rank joins
        problems = [f"checkpoint {path} could not be verified on rank {_rank()}: {type(error).__name__}: {error}"]
    reports = _all_gather_object(problems)
    problems = list(dict.fromkeys(problem for report in reports for problem in report))
    if problems:
        raise CheckpointError(fmt.damage_report(problems))


def _flatten_full(
    checkpoint: dict[str, Any], model: nn.Module, optimizers: list[Optimizer], path: Path
) -> dict[str, Any]:
    """A full file's model and optimizer states as DCP-flattened entries, to be served by ``FlatReader``."""
    nested: dict[str, Any] = {MODEL_KEY: checkpoint[MODEL_KEY]}
    saved = checkpoint.get(OPTIMIZER_KEY)
    if optimizers and saved:
        named_groups = checkpoint.get(INFO_KEY, {}).get("optimizer_param_groups")
        flats = []
        for i, native in enumerate(saved[: len(optimizers)]):
            if named_groups is not None and i < len(named_groups):
                flats.append(states.native_to_flat(native, named_groups[i]))
                continue
            # A plain Lightning checkpoint: parameters in the order of the current optimizer, as torch does.
            template = states.optimizer_state(model, optimizers[i])
            try:
                flats.append(states.native_to_flat(native, states.group_fqns(model, optimizers[i], template)))
            except CheckpointError as error:
                raise CheckpointError(_plain_optimizer_mismatch(path, error)) from error
        nested[OPTIMIZER_KEY] = flats
    flat, _ = flatten_state_dict(nested)
    return flat
