"""Expert parallelism: step time and all-to-all bytes per step at ep 1, 2 and 4, beside the analytic token traffic.

==========  =====================================================================================================
``ep1``     ``HybridStrategy(data_parallel_size=4)``: every rank holds every expert (the peer)
``ep2``     ``HybridStrategy(data_parallel_size=4, expert_parallel_size=2)``: half of the experts per rank, tokens
            routed by all-to-all inside pairs of ranks, experts sharded over their 2 replicas (FSDP2)
``ep4``     ``expert_parallel_size=4``: a quarter of the experts per rank, no replicas
==========  =====================================================================================================

A Hugging Face Mixtral built from a small config (random weights) fits random tokens with the same per-rank batch
in 4 forked gloo processes; steps are timed by the shared step probe (interleaved repeats). The all-to-all bytes are
counted in one extra, untimed step: every ``all_to_all_single`` the rank issues (forward and backward), the bytes it
sends to *other* ranks (its own slice stays in place), split into token traffic (hidden states) and the routing
counts. The analytic token traffic assumes uniform routing: each rank sends
``tokens x top_k x hidden x 4 bytes x (ep-1)/ep`` per MoE layer and direction, twice forward (dispatch, combine) and
twice backward.

    python -m benchmarks.bench_experts [--repeats 2] [--steps 6]
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks import demo_gpt
from benchmarks.probes import make_step_probe
from benchmarks.report import MB, ratio_table, table
from benchmarks.run import SEED, fit, load_average, quiet_fds, run_interleaved, start_rank
from benchmarks.stats import summarize
from tests.helpers.probes import local_bytes

DEVICES = 4
CONFIGS = {"ep1": 1, "ep2": 2, "ep4": 4}
MODEL: dict[str, Any] = dict(  # MixtralConfig's keyword arguments
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)


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
    """Around one step: the bytes this rank's ``all_to_all_single`` calls send to other ranks (hidden states and
    routing counts apart), and the expert parameters the rank holds."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.result = {"tokens": 0, "counts": 0, "calls": 0}

    def __enter__(self) -> AllToAllBytes:
        import torch.distributed as dist

        from lightning_mgpu.parallel.experts import expert_parameters, find_experts

        split = expert_parameters(self.module) or {
            p for m in find_experts(self.module).values() for p in m.parameters()
        }
        self.result["expert_params"] = sum(local_bytes(p) // p.element_size() for p in split)
        self._original = original = dist.all_to_all_single

        def counted(
            output: Any,
            input: Any,
            output_split_sizes: Any = None,
            input_split_sizes: Any = None,
            group: Any = None,
            async_op: bool = False,
        ) -> Any:
            rows = input.shape[0]
            splits = input_split_sizes or [rows // dist.get_world_size(group)] * dist.get_world_size(group)
            sent = (rows - splits[dist.get_rank(group)]) * (input.numel() // max(rows, 1)) * input.element_size()
            self.result["tokens" if input.dim() > 1 else "counts"] += sent
            self.result["calls"] += 1
            return original(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

        dist.all_to_all_single = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        import torch.distributed as dist

        dist.all_to_all_single = self._original


def job(name: str, args: dict[str, Any]) -> dict[str, Any]:
    from lightning_mgpu import HybridStrategy

    start_rank(args["verbose"])
    counter = {args["steps"]: lambda trainer: AllToAllBytes(trainer.lightning_module)}  # the last step, untimed
    probe = make_step_probe(probes=counter, verbose=args["verbose"])
    strategy = HybridStrategy(data_parallel_size=DEVICES, expert_parallel_size=CONFIGS[name])
    result = fit(probe, _module(), _data(args), devices=DEVICES, strategy=strategy, max_steps=args["steps"] + 1)
    return {**result, "a2a": result["probes"][args["steps"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--verbose", action="store_true")
    args = demo_gpt.parse_run_args(parser, None)
    print(
        f"Mixtral {MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}, {MODEL['num_local_experts']}"
        f" experts top-{MODEL['num_experts_per_tok']}; {DEVICES} ranks x {args['batch_size']} x {args['seq_len']}"
        f" tokens; load {load_average()}"
    )
    with quiet_fds(not args["verbose"]):  # torchao (pulled in by transformers) prints load failures
        demo_gpt.preload("transformers.models.mixtral.modeling_mixtral")
    jobs = {name: (job, DEVICES, (name, args)) for name in CONFIGS}
    runs = run_interleaved(jobs, args["repeats"], report=lambda n, o: f"{o[0]['a2a']}")
    results = {name: summarize(done, args["warmup"]) for name, done in runs.items()}
    ratio_table(
        results,
        [(name, "ep1", None) for name in CONFIGS if name != "ep1"],
        title="step time against ep1 (same world, batch and model)",
    )
    busiest = {name: max((o["a2a"] for o in runs[name][0]), key=lambda b: b["tokens"]) for name in runs}
    analytic = {name: analytic_token_bytes(CONFIGS[name], args) for name in runs}
    columns = {
        "expert params/rank": lambda n, r: f"{r['rank0']['a2a']['expert_params']:,}",
        "a2a tokens MB": lambda n, r: f"{busiest[n]['tokens'] / MB:.2f}",
        "analytic MB": lambda n, r: f"{analytic[n] / MB:.2f}",
        "measured/analytic": lambda n, r: f"{busiest[n]['tokens'] / analytic[n]:.2f}" if analytic[n] else "-",
        "a2a counts B": lambda n, r: f"{busiest[n]['counts']}",
        "a2a calls": lambda n, r: f"{busiest[n]['calls']}",
    }
    table(results, columns, title="\nall-to-all of one untimed step, the busiest rank")


if __name__ == "__main__":
    main()
