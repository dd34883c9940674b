"""Manual optimization (``automatic_optimization = False``) under data parallelism, as Lightning's own
``DDPStrategy`` trains it on the same number of processes.

``manual_backward`` runs inside ``training_step``, which is the data-parallel root's forward
(``lightning_mgpu/parallel/data/manual.py``). Modules as Lightning publishes them:

- the GAN of Lightning's ``examples/pytorch/domain_templates/generative_adversarial_net.py``, written out here as it
  trains (its Generator and Discriminator MLPs with BatchNorm, two Adam optimizers, ``toggle_optimizer`` /
  ``manual_backward`` / ``optimizer.step()`` / ``untoggle_optimizer`` per network; the sampled images its
  ``on_train_epoch_end`` logs through torchvision are left out), on synthetic MNIST-shaped images, against
  ``DDPStrategy`` with ``find_unused_parameters=True`` (the discriminator is frozen in the generator's backward, the
  generator detached in the discriminator's): under dp 2 at ZeRO 0-3 (and cpu_offload), also clipping each network's
  gradients, and under tp 2 and dp 2 x tp 2 with an explicit plan for its Linear layers, where every parameter tensor
  parallelism leaves replicated must be bit-identical across the tp ranks;
- ``ManualOptimBoringModel`` from ``lightning.pytorch.demos`` at ZeRO 0-3 and HSDP (4 ranks, shard groups of 2),
  also with ``self.clip_gradients`` and its LR scheduler stepped by hand; a head tied to its embedding at ZeRO-3;
- ``trainer.validate`` before ``trainer.fit`` under ZeRO-3 (the FSDP root kept its gathered parameters from
  validation, and the fit's optimizer stepped them instead of the sharded ones).

Each check compares real numbers (losses 1e-5 relative, weights and buffers 1e-4) with its reference. The runs of one
world size and tier train in one job (``fit_each``); the slow tier repeats the GAN at the other ZeRO stages (dp 2:
ZeRO 1/2 and cpu_offload; dp 2 x tp 2: ZeRO 1/2), clipping at ZeRO-3 and HSDP at ZeRO-2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.demos.boring_classes import BoringDataModule, ManualOptimBoringModel
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_mgpu.layout import TP_AXIS
from tests.helpers.batched import Run, fit_each, result
from tests.helpers.equivalence import LightningDDP, RunResult, assert_same_training
from tests.helpers.modules import LlamaModule, RandomTokenDataModule
from tests.helpers.tiers import case

TROUBLESHOOTING = Path(__file__).resolve().parents[1] / "docs" / "troubleshooting.md"
WEIGHT_ATOL = 1e-4  # Adam turns reduction-order noise on a bias that BatchNorm follows (gradient ~0) into ~5e-6
BATCH = 8  # per data-parallel rank
GAN_STEPS = 12  # optimizer steps: two per batch (generator, discriminator)
BORING_STEPS = 6


# ---------------------------------------------------------------------------------------- Lightning's GAN example
class Generator(nn.Module):
    def __init__(self, latent_dim: int = 100, img_shape: tuple = (1, 28, 28)):
        super().__init__()
        self.img_shape = img_shape

        def block(in_feat: int, out_feat: int, normalize: bool = True) -> list[nn.Module]:
            layers: list[nn.Module] = [nn.Linear(in_feat, out_feat)]
            if normalize:
                layers.append(nn.BatchNorm1d(out_feat, 0.8))
            layers.append(nn.LeakyReLU(0.2, inplace=True))
            return layers

        self.model = nn.Sequential(
            *block(latent_dim, 128, normalize=False),
            *block(128, 256),
            *block(256, 512),
            *block(512, 1024),
            nn.Linear(1024, int(np.prod(img_shape))),
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        img = self.model(z)
        return img.view(img.size(0), *self.img_shape)


class Discriminator(nn.Module):
    def __init__(self, img_shape: tuple):
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(int(np.prod(img_shape)), 512),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(512, 256),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Linear(256, 1),
        )

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        img_flat = img.view(img.size(0), -1)
        return self.model(img_flat)


class GAN(L.LightningModule):
    def __init__(
        self,
        img_shape: tuple = (1, 28, 28),
        lr: float = 0.0002,
        b1: float = 0.5,
        b2: float = 0.999,
        latent_dim: int = 100,
    ):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator(latent_dim=self.hparams.latent_dim, img_shape=img_shape)
        self.discriminator = Discriminator(img_shape=img_shape)
        self.validation_z = torch.randn(8, self.hparams.latent_dim)
        self.example_input_array = torch.zeros(2, self.hparams.latent_dim)

    @override
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.generator(z)

    @staticmethod
    def adversarial_loss(y_hat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(y_hat, y)

    @override
    def training_step(self, batch: Any) -> None:
        imgs, _ = batch
        opt_g, opt_d = self.optimizers()
        # sample noise
        z = torch.randn(imgs.shape[0], self.hparams.latent_dim)
        z = z.type_as(imgs)

        # Train generator: ground truth result (ie: all fake)
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)
        self.toggle_optimizer(opt_g)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

        # Train discriminator: how well can it label real and generated samples?
        valid = torch.ones(imgs.size(0), 1)
        valid = valid.type_as(imgs)
        self.toggle_optimizer(opt_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1)
        fake = fake.type_as(imgs)
        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    @override
    def configure_optimizers(self) -> Any:
        lr = self.hparams.lr
        b1 = self.hparams.b1
        b2 = self.hparams.b2
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=lr, betas=(b1, b2))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=lr, betas=(b1, b2))
        return opt_g, opt_d


class _ClippedGAN(GAN):
    """The GAN with each network's gradients clipped after its backward (``self.clip_gradients``, by global norm)."""

    @override
    def toggle_optimizer(self, optimizer: Any) -> None:
        super().toggle_optimizer(optimizer)
        self._stepping = optimizer

    @override
    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        super().manual_backward(loss, *args, **kwargs)
        self.clip_gradients(self._stepping, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


class _Images(L.LightningDataModule):
    """MNIST's shapes: ``1 x 28 x 28`` images in [-1, 1] (the generator's Tanh range) with labels."""

    def __init__(self, batch_size: int = BATCH) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        images = torch.randn(96, 1, 28, 28, generator=g).tanh()
        self.data = TensorDataset(images, torch.randint(0, 10, (96,), generator=g))
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)


# The generator's and discriminator's first two Linear layers split (column- then row-wise), the generator's last
# column-wise with its output gathered; the rest replicated. No BatchNorm reads a column-wise output: its running
# statistics are then not updated under tensor parallelism (a defect of global-shape regions outside this module).
GAN_PLAN = {
    "generator.model.0": "colwise",
    "generator.model.2": "rowwise",
    "generator.model.11": "colwise_gather_output",
    "discriminator.model.0": "colwise",
    "discriminator.model.2": "rowwise",
}


# ------------------------------------------------------------------------------------- ManualOptimBoringModel
class _ClippedScheduled(ManualOptimBoringModel):
    """``ManualOptimBoringModel`` that also clips its gradients and steps its StepLR by hand."""

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        opt, scheduler = self.optimizers(), self.lr_schedulers()
        loss = self.step(batch)
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.1, gradient_clip_algorithm="norm")
        opt.step()
        scheduler.step()
        return loss


class _TiedManual(L.LightningModule):
    """A small language model whose head is tied to its embedding, trained by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.embedding = nn.Embedding(128, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 128, bias=False)
        self.head.weight = self.embedding.weight

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        optimizer = self.optimizers()
        loss = F.cross_entropy(self.head(torch.tanh(self.mix(self.embedding(x)))).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.log("loss", loss)

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class _ManualLlama(LlamaModule):
    """A Llama trained by hand: pipeline parallelism refuses it before the first step."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


# --------------------------------------------------------------------------------------------------- probes
class _Record(L.Callback):
    """Per step on this rank: the logged ``keys`` (or the loss ``training_step`` returned, for ``"loss"``); at the
    end, this rank's copy of every parameter tensor parallelism left unsplit, and the ranks of its tp group."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys
        self.results: dict[str, Any] = {key: [] for key in keys}

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        for key in self.keys:
            value = trainer.callback_metrics.get(key)
            if value is None and key == "loss":
                value = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.results[key].append(float(value))

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.results["replicated"] = {
            name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in module.named_parameters()
            if not _split_over_tp(p)  # over data parallelism it may be sharded: the same shard on every tp rank
        }
        mesh = getattr(trainer.strategy, "device_mesh", None)
        group = mesh[TP_AXIS].get_group() if mesh is not None and TP_AXIS in (mesh.mesh_dim_names or ()) else None
        self.results["tp_group"] = dist.get_process_group_ranks(group) if group is not None else [trainer.global_rank]


def _split_over_tp(param: torch.Tensor) -> bool:
    if not isinstance(param, DTensor) or TP_AXIS not in (param.device_mesh.mesh_dim_names or ()):
        return False
    return isinstance(param.placements[param.device_mesh.mesh_dim_names.index(TP_AXIS)], Shard)


_GAN_KEYS = ("g_loss", "d_loss")


def _gan(strategy: Any, module: Any = GAN) -> Run:
    return Run(module, _Images, strategy, GAN_STEPS, callbacks_factory=lambda: [_Record(_GAN_KEYS)])


def _boring(strategy: Any, module: Any = ManualOptimBoringModel) -> Run:
    return Run(module, BoringDataModule, strategy, BORING_STEPS, callbacks_factory=lambda: [_Record(("loss",))])


def _validate(trainer: L.Trainer, module: L.LightningModule, datamodule: L.LightningDataModule) -> None:
    trainer.validate(module, datamodule, verbose=False)


def _tokens() -> RandomTokenDataModule:
    return RandomTokenDataModule(batch_size=4, with_val=True)


_DDP = LightningDDP(find_unused_parameters=True)
_ZERO3 = {"zero_stage": 3}
_TP2 = {"tensor_parallel_size": 2, "tp_plan": GAN_PLAN}
# Runs by job: (world size, tier) -> {name: run}. The references train in the job that reads them.
# Runs by job: (world size, tier) -> {name: run}. A slow job holds its own references too, so the slow tier alone
# trains no quick job.
JOBS: dict[tuple[int, str], dict[str, Run]] = {
    (1, "quick"): {"GAN one process": _gan(_DDP), "clipped GAN one process": _gan(_DDP, _ClippedGAN)},
    (2, "quick"): {
        "GAN tp 2": _gan(_TP2),
        "clipped GAN tp 2": _gan(_TP2, _ClippedGAN),
        "GAN DDP": _gan(_DDP),
        **{f"GAN ZeRO-{z}": _gan({"zero_stage": z}) for z in (0, 3)},
        "clipped GAN DDP": _gan(_DDP, _ClippedGAN),
        "clipped GAN ZeRO-1": _gan({"zero_stage": 1}, _ClippedGAN),  # norms of gradients reduced to their owners
        "boring DDP": _boring(LightningDDP()),
        **{f"boring ZeRO-{z}": _boring({"zero_stage": z}) for z in range(4)},
        "clipped, scheduled boring DDP": _boring(LightningDDP(), _ClippedScheduled),
        "clipped, scheduled boring ZeRO-1": _boring({"zero_stage": 1}, _ClippedScheduled),
        "tied DDP": Run(_TiedManual, _tokens, LightningDDP(), 4, callbacks_factory=lambda: [_Record(("loss",))]),
        "tied ZeRO-3": Run(_TiedManual, _tokens, _ZERO3, 4, callbacks_factory=lambda: [_Record(("loss",))]),
        "Llama ZeRO-3 fit": Run(LlamaModule, _tokens, _ZERO3, 4),
        "Llama ZeRO-3 validate, fit": Run(LlamaModule, _tokens, _ZERO3, 4, before_fit=_validate),
        "Llama ZeRO-3 validate, fit (kept parallel)": Run(
            LlamaModule, _tokens, {**_ZERO3, "restore_module_on_teardown": False}, 4, before_fit=_validate
        ),
        # Last: a run that fails in setup leaves nothing behind for the runs after it, but none need to follow.
        "Llama pp 2": Run(_ManualLlama, _tokens, {"pipeline_parallel_size": 2}, 4),
    },
    (2, "slow"): {
        "GAN DDP": _gan(_DDP),
        **{f"GAN ZeRO-{z}": _gan({"zero_stage": z}) for z in (1, 2)},
        "GAN ZeRO-3 cpu_offload": _gan({"zero_stage": 3, "cpu_offload": True}),
        "clipped GAN DDP": _gan(_DDP, _ClippedGAN),
        "clipped GAN ZeRO-3": _gan(_ZERO3, _ClippedGAN),
        "clipped, scheduled boring DDP": _boring(LightningDDP(), _ClippedScheduled),
        "clipped, scheduled boring ZeRO-3": _boring(_ZERO3, _ClippedScheduled),
    },
    (4, "quick"): {
        **{f"GAN dp 2 x tp 2 ZeRO-{z}": _gan({**_TP2, "zero_stage": z}) for z in (0, 3)},
        "clipped GAN dp 2 x tp 2 ZeRO-3": _gan({**_TP2, "zero_stage": 3}, _ClippedGAN),
        "boring DDP": _boring(LightningDDP()),
        **{f"boring HSDP(2) ZeRO-{z}": _boring({"zero_stage": z, "data_parallel_shard_size": 2}) for z in (1, 3)},
    },
    (4, "slow"): {
        **{f"GAN dp 2 x tp 2 ZeRO-{z}": _gan({**_TP2, "zero_stage": z}) for z in (1, 2)},
        "boring DDP": _boring(LightningDDP()),
        "boring HSDP(2) ZeRO-2": _boring({"zero_stage": 2, "data_parallel_shard_size": 2}),
    },
}
SLOW = {name for (_, tier), runs in JOBS.items() if tier == "slow" for name in runs} - {
    name for (_, tier), runs in JOBS.items() if tier == "quick" for name in runs
}
_outcomes: dict[tuple[int, str], dict[str, Any]] = {}


def _outcome(devices: int, name: str) -> Any:
    """The named run's outcome (``fit_each``), its whole job trained on first use (a reference from a job already
    trained)."""
    jobs = [key for key, runs in JOBS.items() if key[0] == devices and name in runs]
    job = next((key for key in jobs if key in _outcomes), jobs[0])
    if job not in _outcomes:
        _outcomes[job] = fit_each(JOBS[job], devices, timeout=900)
    return _outcomes[job][name]


def _runs(*names: str) -> list[Any]:
    """``case``s of these run names, each in the tier of its job."""
    return [case(name, slow=name in SLOW) for name in names]


def _as_run(outcome: Any, keys: tuple[str, ...]) -> tuple[RunResult, list[dict[str, Any]]]:
    """Rank 0's recorded ``keys``, one after the other, as the losses ``assert_same_training`` compares."""
    trained, extras = result(outcome)
    losses = [value for key in keys for value in extras[0][key]]
    return RunResult(losses, trained.state_dict), extras


def _assert_like(reference: tuple[int, str], run: tuple[int, str], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """``run`` (ranks, name) trained as ``reference``; the run's job first, which may hold the reference too."""
    got, extras = _as_run(_outcome(*run), keys)
    expected, _ = _as_run(_outcome(*reference), keys)
    assert_same_training(expected, got, weight_atol=WEIGHT_ATOL)
    return extras


@pytest.mark.parametrize("run", _runs(*(f"GAN ZeRO-{z}" for z in range(4)), "GAN ZeRO-3 cpu_offload"))
def test_gan_trains_under_data_parallelism_as_lightning_ddp(run):
    """Both losses of every step and every weight and BatchNorm statistic as Lightning's DDP (find_unused_parameters
    =True): each backward's gradients reduced, the frozen network's left alone, found without a flag."""
    _assert_like((2, "GAN DDP"), (2, run), _GAN_KEYS)


@pytest.mark.parametrize("run", _runs("clipped GAN ZeRO-1", "clipped GAN ZeRO-3"))
def test_gan_clipping_each_network_by_its_global_norm_as_lightning_ddp(run):
    """``self.clip_gradients`` per optimizer: at ZeRO-1 each gradient is reduced to its owner only, so the norm
    adds up the owners' parts of *this* optimizer's gradients (two optimizers: the second must not replace the
    first's owners); at ZeRO-3 the sharded gradients' norm."""
    _assert_like((2, "clipped GAN DDP"), (2, run), _GAN_KEYS)


TENSOR_PARALLEL = {  # run: (ranks, the reference run's (ranks, name), its tp groups)
    "GAN tp 2": (2, (1, "GAN one process"), {(0, 1)}),
    **{f"GAN dp 2 x tp 2 ZeRO-{z}": (4, (2, "GAN DDP"), {(0, 1), (2, 3)}) for z in range(4)},
    "clipped GAN tp 2": (2, (1, "clipped GAN one process"), {(0, 1)}),
    "clipped GAN dp 2 x tp 2 ZeRO-3": (4, (2, "clipped GAN DDP"), {(0, 1), (2, 3)}),
}


@pytest.mark.parametrize("run", _runs(*TENSOR_PARALLEL))
def test_gan_under_tensor_parallelism_keeps_replicated_weights_identical(run):
    """An explicit plan for the Linear layers, against DDP on the data-parallel ranks (one process under tp 2 alone):
    losses and weights as DDP's, and every parameter the plan leaves replicated (the other Linear layers, the biases
    of the row-wise ones, BatchNorm) bit-identical on the ranks of each tp group, also when each network's gradients
    are clipped by their global norm (sharded and replicated ones together)."""
    devices, reference, tp_groups = TENSOR_PARALLEL[run]
    extras = _assert_like(reference, (devices, run), _GAN_KEYS)
    by_rank = dict(enumerate(extras))
    groups = {tuple(rank["tp_group"]) for rank in extras}
    assert groups == tp_groups, groups
    for group in groups:
        first, *others = (by_rank[rank]["replicated"] for rank in group)
        assert len(first) == 14  # G's 3 BatchNorms and 2 Linear layers, the row-wise biases, D's last Linear
        for other in others:
            unequal = [n for n, value in first.items() if not torch.equal(value, other[n])]
            assert not unequal, f"tp ranks {group} hold different values of {unequal}"


@pytest.mark.parametrize("run", _runs(*(f"boring ZeRO-{z}" for z in range(4))))
def test_manual_optim_boring_model_trains_as_lightning_ddp(run):
    _assert_like((2, "boring DDP"), (2, run), ("loss",))


@pytest.mark.parametrize("run", _runs("clipped, scheduled boring ZeRO-1", "clipped, scheduled boring ZeRO-3"))
def test_clip_gradients_and_a_scheduler_stepped_by_hand_as_lightning_ddp(run):
    _assert_like((2, "clipped, scheduled boring DDP"), (2, run), ("loss",))


@pytest.mark.parametrize("run", _runs(*(f"boring HSDP(2) ZeRO-{z}" for z in (1, 2, 3))))
def test_manual_optim_boring_model_under_hybrid_sharding_as_lightning_ddp(run):
    """4 ranks, ZeRO over pairs and replicated across them, against DDP on 4 processes."""
    _assert_like((4, "boring DDP"), (4, run), ("loss",))


def test_a_head_tied_to_the_embedding_trains_as_lightning_ddp_under_zero3():
    """The two submodules that share the weight gather it as one group."""
    _assert_like((2, "tied DDP"), (2, "tied ZeRO-3"), ("loss",))


@pytest.mark.parametrize("kept", [False, True])
def test_validate_then_fit_under_zero3_trains_as_fit_alone(kept):
    """``trainer.validate`` first, the module given back plain after it (the default) or kept parallelized
    (``restore_module_on_teardown=False``): FSDP's root kept the embeddings, final norm and head gathered after
    validation's forward, and the fit's optimizer had stepped those copies, never the sharded parameters."""
    name = "Llama ZeRO-3 validate, fit" + (" (kept parallel)" if kept else "")
    fit_alone, _ = result(_outcome(2, "Llama ZeRO-3 fit"))
    validated, _ = result(_outcome(2, name))
    assert_same_training(fit_alone, validated, weight_atol=WEIGHT_ATOL)


def test_pipeline_parallelism_refuses_manual_optimization_naming_the_reason_and_the_fix():
    failure = _outcome(2, "Llama pp 2")
    assert isinstance(failure, str), "pipeline_parallel_size=2 trained a module with automatic_optimization = False"
    assert "pipeline_parallel_size=2 runs forward and backward inside the pipeline schedule" in failure, failure
    assert "needs automatic optimization" in failure and "data parallelism (ZeRO 0-3, HSDP)" in failure, failure
    quoted = next(line for line in failure.splitlines() if line.startswith("ValueError: pipeline_parallel_size"))
    assert quoted in TROUBLESHOOTING.read_text(), f"docs/troubleshooting.md does not quote the message:\n{quoted}"
