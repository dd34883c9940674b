"""``lightning-mgpu demo``: the README's first command, a small GPT on the bundled sonnets over several processes."""

from __future__ import annotations

import argparse
import warnings

from lightning_mgpu.cli.errors import UsageError, non_negative_int, positive_float, positive_int, size_or_auto


def add_demo_arguments(demo: argparse.ArgumentParser) -> None:
    demo.description = (
        "Train the demo GPT (nanoGPT-style, plain torch) on the bundled sonnets with HybridStrategy. The default"
        " layout uses every kind of parallelism: 8 processes = pipeline 2 x data 2 x tensor 2, ZeRO-1."
    )
    demo.add_argument("--devices", type=positive_int, default=8, help="processes (CPU) or GPUs per node")
    demo.add_argument("--accelerator", default="cpu", help="Lightning's accelerator: cpu, gpu, ...")
    layout = demo.add_argument_group("layout (HybridStrategy's arguments)")
    layout.add_argument(
        "--data-parallel-size",
        type=size_or_auto,
        default="auto",
        help="an integer, or 'auto': what tensor and pipeline parallelism leave of --devices",
    )
    layout.add_argument("--tensor-parallel-size", type=positive_int, default=2, help="ranks each layer splits over")
    layout.add_argument("--pipeline-parallel-size", type=positive_int, default=2, help="pipeline stages")
    layout.add_argument("--pipeline-schedule", default="1F1B", help="one of torch's seven schedules")
    layout.add_argument(
        "--num-microbatches", type=positive_int, default=None, help="microbatches per step (unset: one per stage)"
    )
    layout.add_argument("--sequence-parallel", action="store_true", help="shard the norms' activations over tp")
    layout.add_argument(
        "--zero-stage", type=int, default=1, help="0 replicated, 1 sharded optimizer states, 2 + gradients, 3 + weights"
    )
    training = demo.add_argument_group("training")
    training.add_argument("--precision", default="32-true", help="Lightning's precision: 32-true, bf16-mixed, ...")
    training.add_argument("--max-steps", type=positive_int, default=80, help="optimizer steps")
    training.add_argument("--batch-size", type=positive_int, default=16, help="global batch size")
    training.add_argument("--block-size", type=positive_int, default=64, help="characters per sequence")
    training.add_argument("--n-layer", type=positive_int, default=4, help="transformer blocks")
    training.add_argument("--n-embd", type=positive_int, default=64, help="hidden size (a multiple of --n-head)")
    training.add_argument("--n-head", type=positive_int, default=4, help="attention heads")
    training.add_argument("--lr", type=positive_float, default=2e-3, help="AdamW's learning rate")
    training.add_argument("--seed", type=int, default=1234, help="random seed of weights and data order")
    training.add_argument(
        "--sample-tokens", type=non_negative_int, default=160, help="characters to generate after training (0: none)"
    )
    demo.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    import lightning as L
    import torch

    from lightning_mgpu import HybridStrategy
    from lightning_mgpu.demo import GPTLightningModule, TextDataModule

    if args.n_embd % args.n_head:
        raise UsageError(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head} (the heads split it).")
    strategy = HybridStrategy(
        data_parallel_size=args.data_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        pipeline_schedule=args.pipeline_schedule,
        num_microbatches=args.num_microbatches,
        sequence_parallel=args.sequence_parallel,
        zero_stage=args.zero_stage,
        start_method="fork",  # one import of torch, shared by every worker: the demo starts in about a second
    )
    L.seed_everything(args.seed, verbose=False)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
        max_steps=args.max_steps,
        val_check_interval=max(1, args.max_steps // 3),
        limit_val_batches=4,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    layout = trainer.strategy.layout  # type: ignore[attr-defined]
    if args.batch_size % layout.data_parallel_size:
        raise UsageError(
            f"--batch-size {args.batch_size} must be divisible by the data-parallel size {layout.data_parallel_size}:"
            f" give a multiple of {layout.data_parallel_size}."
        )
    datamodule = TextDataModule(batch_size=args.batch_size // layout.data_parallel_size, block_size=args.block_size)
    datamodule.setup("fit")
    # With max_steps alone Lightning sets max_epochs=-1, which its progress bar prints as "Epoch 1/-2".
    trainer.fit_loop.max_epochs = epochs_for(args.max_steps, len(datamodule.train_dataset or ()), args.batch_size)
    model = GPTLightningModule(
        vocab_size=datamodule.vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        lr=args.lr,
        weight_decay=0.0,
    )
    print(f"lightning-mgpu demo: {layout.describe()} on {args.devices} {args.accelerator} processes")
    with warnings.catch_warnings():
        # Lightning 2.6's batch flattening builds torch 2.13's deprecated LeafSpec: one line per process and step
        # that says nothing about the user's code (forked workers inherit this filter).
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        trainer.fit(model, datamodule)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    print(" ".join(f"final {name}: {value:.4f}" for name, value in sorted(metrics.items())))
    if args.sample_tokens > 0:
        prompt = datamodule.tokenizer.encode("Shall I compare thee").unsqueeze(0)
        model.eval()
        with torch.no_grad():
            sample = model.model.generate(prompt, args.sample_tokens, temperature=0.8)
        print("sample:", datamodule.tokenizer.decode(sample[0]))
    return 0


def epochs_for(max_steps: int, samples: int, global_batch_size: int) -> int:
    """Epochs that ``max_steps`` optimizer steps start (a ragged last batch counts as a step)."""
    steps_per_epoch = max(1, -(-samples // global_batch_size))
    return max(1, -(-max_steps // steps_per_epoch))
