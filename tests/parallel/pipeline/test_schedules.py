"""Pipeline parallelism behind unmodified LightningModules: every schedule, 3D layouts, what users see."""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch

from lightning_mgpu.demo import GPTLightningModule, TextDataModule
from lightning_mgpu.parallel.pipeline.microbatches import split_microbatches
from lightning_mgpu.parallel.pipeline.plan import balance, stage_indices, stages_per_rank
from tests.helpers.equivalence import assert_same_training, fit
from tests.helpers.modules import GPT2Module, LlamaModule, RandomTokenDataModule
from tests.helpers.probes import MemoryProbe, MetricRecorder

GLOBAL_BATCH = 8
STEPS = 10
WEIGHT_ATOL = 1e-4  # as for tensor parallel: AdamW turns reduction-order noise into ~1e-5 steps


def _nanogpt(n_layer: int = 4):
    return GPTLightningModule(block_size=32, n_layer=n_layer, n_head=4, n_embd=32, lr=1e-3)


def _text(batch: int):
    return TextDataModule(batch_size=batch, block_size=32, val_fraction=0.1)


class _LlamaWithHuggingFaceLoss(LlamaModule):
    """The loss from inside the model (`labels=`, whose output then starts with a scalar) in a dict."""

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.log("train_loss", loss, sync_dist=True)
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(input_ids=batch[0], labels=batch[0]).loss, sync_dist=True)


MODELS = {
    "nanogpt": (_nanogpt, _text),
    "llama": (partial(LlamaModule), lambda batch: RandomTokenDataModule(batch_size=batch, with_val=True)),
    "gpt2": (GPT2Module, lambda batch: RandomTokenDataModule(batch_size=batch, with_val=True)),
    "llama-hf-loss": (_LlamaWithHuggingFaceLoss, lambda batch: RandomTokenDataModule(batch_size=batch, with_val=True)),
}
TRAINER = {"limit_val_batches": 2, "val_check_interval": 5, "num_sanity_val_steps": 1}

_references: dict = {}


def _reference(model: str, trainer_kwargs: dict):
    key = (model, tuple(sorted(trainer_kwargs.items())))
    if key not in _references:
        module, data = MODELS[model]
        _references[key] = fit(
            module,
            lambda: data(GLOBAL_BATCH),
            None,
            1,
            STEPS,
            trainer_kwargs=trainer_kwargs,
            callbacks_factory=lambda: [MetricRecorder()],
        )
    return _references[key]


def _check(model: str, strategy: dict, devices: int, dp: int = 1, trainer_kwargs: dict = TRAINER) -> None:
    module, data = MODELS[model]
    reference, reference_extras = _reference(model, trainer_kwargs)
    result, extras = fit(
        module,
        lambda: data(GLOBAL_BATCH // dp),
        strategy,
        devices,
        STEPS,
        trainer_kwargs=trainer_kwargs,
        callbacks_factory=lambda: [MetricRecorder()],
    )
    assert_same_training(reference, result, weight_atol=WEIGHT_ATOL)
    # Validation (sanity check included) reaches global rank 0, which holds the first stage, as in one process.
    expected, got = reference_extras[0]["val_losses"], extras[0]["val_losses"]
    assert len(got) == len(expected) > 1
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)


SCHEDULES = [
    ("GPipe", 2),
    ("GPipe", 4),
    ("1F1B", 2),
    ("1F1B", 4),
    ("Interleaved1F1B", 4),
    ("LoopedBFS", 4),
    ("InterleavedZeroBubble", 4),
    ("ZBVZeroBubble", 4),
    ("DualPipeV", 4),
]


@pytest.mark.parametrize(("schedule", "microbatches"), SCHEDULES, ids=[f"{s}-m{m}" for s, m in SCHEDULES])
def test_every_schedule_trains_like_one_process(schedule, microbatches):
    _check("nanogpt", {"pipeline_parallel_size": 2, "pipeline_schedule": schedule, "num_microbatches": microbatches}, 2)


LAYOUTS = [  # (model, strategy, devices, dp)
    ("nanogpt", {"pipeline_parallel_size": 4}, 4, 1),
    ("llama", {"pipeline_parallel_size": 2}, 2, 1),
    ("llama-hf-loss", {"pipeline_parallel_size": 2, "pipeline_schedule": "GPipe"}, 2, 1),
    ("gpt2", {"pipeline_parallel_size": 2}, 2, 1),
    ("llama", {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}, 4, 1),
    ("gpt2", {"pipeline_parallel_size": 2, "zero_stage": 1}, 4, 2),
    ("nanogpt", {"pipeline_parallel_size": 2, "zero_stage": 3}, 4, 2),
    ("nanogpt", {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 1}, 8, 2),
    # Two stages per rank with data parallelism: each stage is its own data-parallel root.
    (
        "nanogpt",
        {"pipeline_parallel_size": 2, "pipeline_schedule": "Interleaved1F1B", "num_microbatches": 2, "zero_stage": 1},
        4,
        2,
    ),
    (
        "nanogpt",
        {"pipeline_parallel_size": 2, "pipeline_schedule": "DualPipeV", "num_microbatches": 4, "zero_stage": 2},
        4,
        2,
    ),
]


@pytest.mark.parametrize(
    ("model", "strategy", "devices", "dp"),
    LAYOUTS,
    ids=["-".join(f"{k[0]}{v}" for k, v in s.items()) + f"-{m}" for m, s, _, _ in LAYOUTS],
)
def test_layouts_train_like_one_process(model, strategy, devices, dp):
    _check(model, strategy, devices, dp)


class _ShardedBetweenSteps(L.Callback):
    """Records, after each optimizer step, whether every parameter is back in its data-parallel sharded form."""

    def __init__(self) -> None:
        self.results: dict = {"sharded": []}

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        from torch.distributed.tensor import DTensor

        params = list(pl_module.parameters())
        self.results["sharded"].append(
            all(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in params if p.numel() > 1)
        )


def test_zero3_with_two_stages_per_rank_trains_and_frees_gathered_stages():
    """ZBV (V placement, zero bubble) at ZeRO-3: the schedule gathers each stage for its work and frees it after."""
    strategy = {
        "pipeline_parallel_size": 2,
        "pipeline_schedule": "ZBVZeroBubble",
        "num_microbatches": 4,
        "zero_stage": 3,
    }
    reference, _ = _reference("nanogpt", TRAINER)
    result, extras = fit(
        _nanogpt,
        lambda: _text(GLOBAL_BATCH // 2),
        strategy,
        4,
        STEPS,
        trainer_kwargs=TRAINER,
        callbacks_factory=lambda: [_ShardedBetweenSteps()],
    )
    assert_same_training(reference, result, weight_atol=WEIGHT_ATOL)
    for rank_extras in extras:
        assert rank_extras["sharded"] == [True] * STEPS


def test_clipping_and_accumulation_across_stages():
    trainer_kwargs = {**TRAINER, "gradient_clip_val": 0.05, "accumulate_grad_batches": 2}
    _check("nanogpt", {"pipeline_parallel_size": 2}, 2, trainer_kwargs=trainer_kwargs)


def test_each_rank_keeps_only_its_stages_parameters(pp2_run):
    extras = pp2_run["pipeline"]  # MemoryProbe at step 1
    module = _nanogpt()
    blocks = sum(p.numel() for p in module.model.transformer.h.parameters())
    embeddings = sum(p.numel() for n in ("wte", "wpe") for p in getattr(module.model.transformer, n).parameters())
    head = sum(p.numel() for p in [*module.model.transformer.ln_f.parameters(), *module.model.lm_head.parameters()])
    assert extras[0]["numel"] == blocks // 2 + embeddings
    assert extras[1]["numel"] == blocks // 2 + head


class _TwoCalls(GPTLightningModule):
    def training_step(self, batch, batch_idx):
        x, _ = batch
        return self(x).mean() + self(x).mean()


def test_a_second_network_call_is_refused_with_the_fix():
    with pytest.raises(RuntimeError, match="may call the network once"):
        fit(
            lambda: _TwoCalls(block_size=32, n_layer=2, n_head=4, n_embd=32),
            lambda: _text(8),
            {"pipeline_parallel_size": 2},
            2,
            1,
        )


def test_a_model_whose_blocks_take_the_embeddings_is_refused_not_trained_wrong():
    """modded-nanogpt as published mixes the normed embeddings (``x0``) and value embeddings into every block: stage
    1 would compute them from stand-ins. Its first forward refuses the model, naming why and what to use."""
    from tests.helpers.modded_nanogpt import ModdedGPTModule

    with pytest.raises(RuntimeError, match="an `x0` skip connection"):
        fit(lambda: ModdedGPTModule(num_layers=4, model_dim=32), lambda: _text(8), {"pipeline_parallel_size": 2}, 2, 1)


def test_balance_and_placement():
    assert balance([10] * 8, 4) == [0, 2, 4, 6]
    assert balance([10] * 8, 2, first_extra=40) == [0, 2]  # embeddings (40) weigh on stage 0: it gets 2 blocks, 60 = 60
    assert stage_indices("1F1B", 1, 4, 1) == [1]
    assert stage_indices("Interleaved1F1B", 1, 4, 2) == [1, 5]
    assert stage_indices("ZBVZeroBubble", 1, 4, 2) == [1, 6]  # V: rank 1 holds stages 1 and 6 of 8
    assert stages_per_rank("DualPipeV", None) == 2
    with pytest.raises(ValueError, match="one stage per rank"):
        stages_per_rank("1F1B", 2)


def test_microbatch_errors_say_which_counts_work():
    batch = (torch.zeros(6, 4), torch.zeros(6, 4))
    assert [mb[0].shape[0] for mb in split_microbatches(batch, 3)] == [2, 2, 2]
    with pytest.raises(ValueError, match=r"batch of 6 samples does not split into num_microbatches=4.*\[1, 2, 3, 6\]"):
        split_microbatches(batch, 4)


class _CheckpointScore(L.Callback):
    """Reports what ModelCheckpoint/EarlyStopping on global rank 0 decided."""

    def __init__(self) -> None:
        self.results: dict = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        callback = trainer.checkpoint_callback
        self.results = {
            "best": float(callback.best_model_score),
            "stopped": trainer.early_stopping_callback.wait_count,
            "scores": {k: float(v) for k, v in callback.best_k_models.items()},
            "step": trainer.global_step,
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        }


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory):
    """One process's and one pp 2 fit of the nanoGPT (default schedule) as a user runs it: validation,
    ModelCheckpoint and EarlyStopping on val_loss, and the probes the tests below read (each only observes)."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    def callbacks(directory, probes):
        return lambda: [
            ModelCheckpoint(dirpath=directory, monitor="val_loss", save_top_k=1),
            EarlyStopping(monitor="val_loss", patience=5),
            _CheckpointScore(),
            *([MemoryProbe(step=1), _AfterBackward(), _ObjectBroadcasts()] if probes else []),
        ]

    kwargs = {**TRAINER, "enable_checkpointing": True}
    root = tmp_path_factory.mktemp("pp2-run")
    runs = {"dirpath": root / "pipeline"}
    for name, strategy, devices in (("reference", None, 1), ("pipeline", {"pipeline_parallel_size": 2}, 2)):
        runs[name] = fit(
            _nanogpt,
            lambda: _text(GLOBAL_BATCH),
            strategy,
            devices,
            STEPS,
            trainer_kwargs=kwargs,
            callbacks_factory=callbacks(root / name, strategy is not None),
        )[1]
    return runs


def test_model_checkpoint_and_early_stopping_monitor_validation_loss(pp2_run):
    """Rank 0 holds the first stage, yet ModelCheckpoint(monitor="val_loss") and EarlyStopping see the loss."""
    reference, result = pp2_run["reference"], pp2_run["pipeline"]
    assert result[0]["best"] == pytest.approx(reference[0]["best"], rel=1e-5), (result[0], reference[0])
    assert result[0]["stopped"] == reference[0]["stopped"]
    assert [path.name for path in pp2_run["dirpath"].iterdir()] == ["epoch=0-step=10.ckpt"]


class _AfterBackward(L.Callback):
    def __init__(self) -> None:
        self.results = {"after_backward_with_grads": 0}

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if any(p.grad is not None for p in pl_module.parameters()):
            self.results["after_backward_with_grads"] += 1


def test_on_after_backward_fires_once_per_step_with_gradients(pp2_run):
    assert [e["after_backward_with_grads"] for e in pp2_run["pipeline"]] == [STEPS, STEPS]


class _WithMetrics(GPTLightningModule):
    """Logs torchmetrics objects the usual ways: on_step (a macro F1, which is not a mean over microbatches),
    on_epoch after `update`, list states (Spearman), a MetricCollection, and `compute()` in an epoch-end hook."""

    def __init__(self) -> None:
        from torchmetrics import MetricCollection
        from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score
        from torchmetrics.regression import SpearmanCorrCoef

        super().__init__(block_size=32, n_layer=4, n_head=4, n_embd=32, lr=1e-3)
        self.train_f1 = MulticlassF1Score(num_classes=256, average="macro")
        self.train_acc = MulticlassAccuracy(num_classes=256, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=256, average="micro")
        self.val_rank = SpearmanCorrCoef()
        self.val_collection = MetricCollection({"top5": MulticlassAccuracy(num_classes=256, top_k=5)}, prefix="val_")

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        preds = logits.argmax(-1).reshape(-1)
        self.train_f1(preds, y.reshape(-1))
        self.log("train_f1", self.train_f1)
        self.train_acc.update(preds, y.reshape(-1))
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.val_acc(logits.argmax(-1).reshape(-1), y.reshape(-1))
        self.val_rank.update(logits.amax(-1).reshape(-1), y.reshape(-1).float())
        self.val_collection.update(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_acc", self.val_acc)
        self.log("val_rank", self.val_rank)
        self.log_dict(self.val_collection)

    def on_validation_epoch_end(self):
        self.log("val_acc_by_hand", self.val_acc.compute())


class _MetricSnapshots(L.Callback):
    """What rank 0's loggers get: train_f1 after every step, the epoch-level metrics after every validation."""

    KEYS = ("val_acc", "val_rank", "val_top5", "val_acc_by_hand", "val_loss")

    def __init__(self) -> None:
        self.results: dict = {"train_f1": [], "validation": []}

    def on_train_batch_end(self, trainer, *args) -> None:
        self.results["train_f1"].append(float(trainer.callback_metrics["train_f1"]))

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.results["validation"].append([float(trainer.callback_metrics[k]) for k in self.KEYS])

    def on_train_end(self, trainer, pl_module) -> None:
        self.results["train_acc"] = float(trainer.callback_metrics["train_acc"])


@pytest.mark.parametrize(
    ("strategy", "devices", "dp"),
    [
        ({"pipeline_parallel_size": 2, "num_microbatches": 4}, 2, 1),
        ({"pipeline_parallel_size": 2, "zero_stage": 1}, 4, 2),
    ],
    ids=["pp2-m4", "pp2-dp2"],
)
def test_torchmetrics_objects_reach_rank0_with_single_process_values(strategy, devices, dp):
    trainer_kwargs = {**TRAINER, "max_epochs": 1, "limit_train_batches": STEPS}
    if "metrics" not in _references:  # one process's run, the same for both layouts
        _references["metrics"] = fit(
            _WithMetrics,
            lambda: _text(GLOBAL_BATCH),
            None,
            1,
            STEPS,
            trainer_kwargs=trainer_kwargs,
            callbacks_factory=lambda: [_MetricSnapshots()],
        )
    _, expected = _references["metrics"]
    _, got = fit(
        _WithMetrics,
        lambda: _text(GLOBAL_BATCH // dp),
        strategy,
        devices,
        STEPS,
        trainer_kwargs=trainer_kwargs,
        callbacks_factory=lambda: [_MetricSnapshots()],
    )
    expected, got = expected[0], got[0]
    assert len(got["validation"]) == len(expected["validation"]) == 2
    got_validation, expected_validation = torch.tensor(got["validation"]), torch.tensor(expected["validation"])
    others = [i for i, key in enumerate(_MetricSnapshots.KEYS) if key != "val_rank"]
    torch.testing.assert_close(got_validation[:, others], expected_validation[:, others], rtol=1e-5, atol=1e-6)
    # a rank correlation reorders near-equal maxima on 1e-6 noise, so it gets an absolute tolerance.
    rank = _MetricSnapshots.KEYS.index("val_rank")
    torch.testing.assert_close(got_validation[:, rank], expected_validation[:, rank], rtol=0, atol=1e-4)
    torch.testing.assert_close(got["train_acc"], expected["train_acc"], rtol=1e-5, atol=1e-6)
    if dp == 1:  # on_step values are per rank (each data-parallel rank's half batch), as with Lightning's DDP
        torch.testing.assert_close(
            torch.tensor(got["train_f1"]), torch.tensor(expected["train_f1"]), rtol=1e-5, atol=1e-6
        )


class _ObjectBroadcasts(L.Callback):
    """Counts pickled broadcasts (`broadcast_object_list`) during each training batch."""

    def __init__(self) -> None:
        self.results: dict = {"object_broadcasts": []}
        self._count = 0

    def setup(self, trainer, pl_module, stage) -> None:
        import torch.distributed as dist

        original = dist.broadcast_object_list

        def counted(*args, **kwargs):
            self._count += 1
            return original(*args, **kwargs)

        dist.broadcast_object_list = counted

    def on_train_batch_start(self, *args) -> None:
        self._count = 0

    def on_train_batch_end(self, *args) -> None:
        self.results["object_broadcasts"].append(self._count)


def test_steady_state_steps_send_numbers_not_pickled_objects(pp2_run):
    # The first step sends the logged names and options once; later steps only a small tensor of numbers.
    for rank_extras in pp2_run["pipeline"]:
        assert rank_extras["object_broadcasts"] == [1] + [0] * (STEPS - 1)


class _SequentialNet(L.LightningModule):
    """A plain network in one Sequential of different layers: no repeated block class, no embeddings."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        hidden = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU()) for _ in range(4)]
        self.layers = torch.nn.Sequential(torch.nn.Linear(16, 32), *hidden, torch.nn.Linear(32, 4))

    def forward(self, x):
        return self.layers(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Features(L.LightningDataModule):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        generator = torch.Generator().manual_seed(0)
        x, y = torch.randn(256, 16, generator=generator), torch.randint(0, 4, (256,), generator=generator)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=self.batch_size)


def test_a_sequential_network_is_split_over_its_children():
    from lightning_mgpu.parallel.pipeline.plan import plan_split

    split = plan_split(_SequentialNet(), 2, "auto")
    assert (split.container_fqn, split.starts) == ("layers", [0, 3])
    assert plan_split(_SequentialNet(), 2, ["layers.2"]).starts == [0, 2]
    reference, _ = fit(_SequentialNet, lambda: _Features(GLOBAL_BATCH), None, 1, STEPS)
    strategy = {"pipeline_parallel_size": 2, "pipeline_schedule": "Interleaved1F1B", "zero_stage": 2}
    result, _ = fit(_SequentialNet, lambda: _Features(GLOBAL_BATCH // 2), strategy, 4, STEPS)
    assert_same_training(reference, result, weight_atol=WEIGHT_ATOL)
