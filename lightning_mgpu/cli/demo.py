"""``lightning-mgpu demo``: the README's first command, a small GPT on the bundled sonnets over several processes."""

from __future__ import annotations

import argparse
import warnings


def add_demo_parser(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="train a small GPT on bundled Shakespeare sonnets with several CPU processes",
        description="Train the demo GPT (nanoGPT-style, plain torch) on the bundled sonnets with HybridStrategy."
        " The default layout uses every kind of parallelism: 8 processes = pipeline 2 x data 2 x tensor 2, ZeRO-1.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument("--devices", type=int, default=8, help="processes (CPU) or GPUs per node")
    demo.add_argument("--accelerator", default="cpu")
    demo.add_argument("--data-parallel-size", default="auto", help="int or 'auto'")
    demo.add_argument("--tensor-parallel-size", type=int, default=2)
    demo.add_argument("--pipeline-parallel-size", type=int, default=2)
    demo.add_argument("--pipeline-schedule", default="1F1B")
    demo.add_argument("--num-microbatches", type=int, default=None)
    demo.add_argument("--sequence-parallel", action="store_true")
    demo.add_argument("--zero-stage", type=int, default=1)
    demo.add_argument("--precision", default="32-true")
    demo.add_argument("--max-steps", type=int, default=80)
    demo.add_argument("--batch-size", type=int, default=16, help="global batch size")
    demo.add_argument("--block-size", type=int, default=64)
    demo.add_argument("--n-layer", type=int, default=4)
    demo.add_argument("--n-embd", type=int, default=64)
    demo.add_argument("--n-head", type=int, default=4)
    demo.add_argument("--lr", type=float, default=2e-3)
    demo.add_argument("--seed", type=int, default=1234)
    demo.add_argument("--sample-tokens", type=int, default=160, help="characters to generate after training")
    demo.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    import lightning as L
    import torch

    from lightning_mgpu import HybridStrategy
    from lightning_mgpu.demo import GPTLightningModule, TextDataModule

    dp: object = args.data_parallel_size if args.data_parallel_size == "auto" else int(args.data_parallel_size)
    strategy = HybridStrategy(
        data_parallel_size=dp,  # type: ignore[arg-type]
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
        raise SystemExit(
            f"--batch-size {args.batch_size} must be divisible by the data-parallel size {layout.data_parallel_size}."
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
