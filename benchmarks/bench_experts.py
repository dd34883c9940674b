"""Expert parallelism: step time and all-to-all bytes per step at ep 1, 2 and 4, beside the analytic token traffic.

==========  =====================================================================================================
``ep1``     ``HybridStrategy(data_parallel_size=4)``: every rank holds every expert (the peer)
``ep2``     ``HybridStrategy(data_parallel_size=4, expert_parallel_size=2)``: half of the experts per rank, tokens
            routed by all-to-all inside pairs of ranks, experts sharded over their 2 replicas (FSDP2)
``ep4``     ``expert_parallel_size=4``: a quarter of the experts per rank, no replicas
==========  =====================================================================================================

A Hugging Face Mixtral built from a small config (random weights) fits random tokens with the same per-rank batch
in 4 forked gloo processes; steps are timed by the harness's probe (interleaved repeats). The all-to-all bytes are
counted in one extra, untimed step: every ``all_to_all_single`` the rank issues (forward and backward), the bytes it
sends to *other* ranks (its own slice stays in place), split into token traffic (hidden states) and the routing
counts. The analytic token traffic assumes uniform routing: each rank sends
``tokens x top_k x hidden x 4 bytes x (ep-1)/ep`` per MoE layer and direction, twice forward (dispatch, combine) and
twice backward.

    python benchmarks/bench_experts.py [--repeats 2] [--steps 6]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402
from benchmarks.harness import QUIET_TRAINER, SEED  # noqa: E402

DEVICES = 4
CONFIGS = {"ep1": 1, "ep2": 2, "ep4": 4}
MODEL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256)


def analytic_token_bytes(ep: int, args: dict[str, Any]) -> float:
    """Bytes of hidden states one rank sends to other ranks per step under uniform routing (fp32)."""
    tokens = args["batch_size"] * args["seq_len"]
    per_direction = tokens * MODEL["num_experts_per_tok"] * MODEL["hidden_size"] * 4 * (ep - 1) / ep
    return per_direction * 2 * 2 * MODEL["num_hidden_layers"]  # dispatch + combine, forward + backward


# ------------------------------------------------------------------------------------------------ in the ranks
def _module() -> Any:
    import lightning as L
    import torch
    import transformers

    class Mixtral(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MODEL))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = self.model(input_ids=batch[0], labels=batch[0]).loss
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Mixtral()


def _data(args: dict[str, Any]) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(SEED)
    shape = (args["batch_size"] * DEVICES * (args["steps"] + 2), args["seq_len"])
    tokens = torch.randint(0, MODEL["vocab_size"], shape, generator=g)
    return DataLoader(TensorDataset(tokens), batch_size=args["batch_size"])


class AllToAllBytes:
    """Counts, while active, the bytes this rank's ``all_to_all_single`` calls send to other ranks."""

    def __init__(self) -> None:
        self.tokens = self.counts = 0
        self.calls = 0
        self._original: Any = None

    def __enter__(self) -> "AllToAllBytes":
        import torch.distributed as dist

        self._original = dist.all_to_all_single

        def counted(output: Any, input: Any, output_split_sizes: Any = None, input_split_sizes: Any = None,
                    group: Any = None, async_op: bool = False) -> Any:
            size = dist.get_world_size(group)
            rows = input.shape[0]
            splits = input_split_sizes or [rows // size] * size
            own = splits[dist.get_rank(group)]
            sent = (rows - own) * (input.numel() // max(rows, 1)) * input.element_size()
            if input.dim() > 1:
                self.tokens += sent
            else:
                self.counts += sent
            self.calls += 1
            return self._original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        dist.all_to_all_single = self._original


def job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    harness.quiet_worker(args["verbose"])
    import lightning as L

    from lightning_mgpu import HybridStrategy
    from lightning_mgpu.parallel.experts import expert_parameters

    class Counter(L.Callback):
        """The all-to-all bytes of the last (untimed) step, and the expert parameters this rank holds."""

        def __init__(self) -> None:
            self.bytes: Any = None
            self.expert_params = 0
            self._count: Any = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == args["steps"]:
                self._count = AllToAllBytes().__enter__()

        def on_train_batch_end(self, trainer: Any, *rest: Any) -> None:
            if self._count is not None:
                self._count.__exit__()
                self.bytes = {"tokens": self._count.tokens, "counts": self._count.counts, "calls": self._count.calls}
                self._count = None

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            from lightning_mgpu.parallel.experts import find_experts

            split = expert_parameters(pl_module) or {p for m in find_experts(pl_module).values()
                                                     for p in m.parameters()}
            self.expert_params = sum(harness.local_bytes(p) // p.element_size() for p in split)

    L.seed_everything(SEED, verbose=False)
    probe = harness.make_step_probe(profile_step=None, verbose=args["verbose"])
    counter = Counter()
    strategy = HybridStrategy(data_parallel_size=DEVICES, expert_parallel_size=CONFIGS[name])
    trainer = L.Trainer(accelerator="cpu", devices=DEVICES, strategy=strategy, max_steps=args["steps"] + 1,
                        callbacks=[probe, counter], **QUIET_TRAINER)
    trainer.fit(_module(), _data(args))
    result = probe.result()
    # The last step counted bytes: leave it out of the timings like the harness's profiled step.
    result["times"], result["cpu_times"] = result["times"][:-1], result["cpu_times"][:-1]
    return {**result, "a2a": counter.bytes, "expert_params": counter.expert_params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--verbose", action="store_true")
    ns = parser.parse_args()
    args = {"steps": ns.steps, "batch_size": ns.batch_size, "seq_len": ns.seq_len, "verbose": ns.verbose,
            "mem_step": 1}
    print(f"Mixtral {MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}, {MODEL['num_local_experts']}"
          f" experts top-{MODEL['num_experts_per_tok']}; {DEVICES} ranks x {ns.batch_size} x {ns.seq_len} tokens;"
          f" load {harness.load_average()}")
    jobs = {name: (job, DEVICES, (name, args)) for name in CONFIGS}
    runs = harness.run_interleaved(jobs, ns.repeats, report=lambda n, o: f"{o[0]['a2a']}")
    results = {name: harness.summarize(done, ns.warmup) for name, done in runs.items()}
    harness.ratio_table(results, [(name, "ep1", None) for name in CONFIGS if name != "ep1"],
                        title="step time against ep1 (same world, batch and model)")
    head = (f"{'config':<7}{'step ms':>9}{'expert params/rank':>20}{'a2a tokens MB':>15}{'analytic MB':>13}"
            f"{'measured/analytic':>19}{'a2a counts B':>14}{'a2a calls':>11}")
    print(head)
    print("-" * len(head))
    for name, ep in CONFIGS.items():
        if name not in runs:
            continue
        first = runs[name][0]
        a2a = max((o["a2a"] for o in first), key=lambda b: b["tokens"])  # the busiest rank
        analytic = analytic_token_bytes(ep, args)
        share = f"{a2a['tokens'] / analytic:.2f}" if analytic else "-"
        print(f"{name:<7}{results[name]['median'] * 1e3:>9.1f}{first[0]['expert_params']:>20,}"
              f"{a2a['tokens'] / 2**20:>15.2f}{analytic / 2**20:>13.2f}{share:>19}{a2a['counts']:>14}"
              f"{a2a['calls']:>11}")


if __name__ == "__main__":
    main()
