"""The examples run as a user would run them: the notebook in a Jupyter kernel, the CLI scripts as subprocesses.

These are end-to-end runs with two CPU processes each (about 10-20 s apiece on two cores), except the 3D config's
eight (forked, about 10 s). Only the ZeRO-2 config's run starts fresh interpreters (Lightning's script launcher);
the others fork their workers. The multi-node scripts are run by tests/test_multinode.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.notebooks import python_kernel_name
from tests.helpers.processes import clean_env, run

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
NOTEBOOK = EXAMPLES / "notebook_hybrid_strategy.ipynb"
CLI_SCRIPT = Path("examples") / "cli" / "train.py"
CLI_CONFIG = Path("examples") / "cli" / "hybrid_zero2.yaml"
TIMEOUT = 300


# ------------------------------------------------------------------------------------------------------ notebook
def test_notebook_is_saved_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code_cells
    assert all(not cell.outputs and cell.execution_count is None for cell in code_cells)


@pytest.mark.slow  # the slow tier: end to end: the user's command as fresh processes
def test_notebook_runs():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    kernel_name = python_kernel_name()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=TIMEOUT,
        kernel_name=kernel_name,
        allow_errors=False,
        resources={"metadata": {"path": str(EXAMPLES)}},
    )
    # Raises CellExecutionError (with the cell's source and traceback) on the first failing cell, which covers
    # the notebook's own assertions: finite losses below the untrained loss.
    client.execute(env=clean_env())
    outputs = "".join(
        output.get("text", "") for cell in nb.cells if cell.cell_type == "code" for output in cell.outputs
    )
    assert "HybridMultiProcessingLauncher" in outputs  # the workers were forked from the kernel
    assert "`max_steps=20` reached" in outputs


# ----------------------------------------------------------------------------------------------------------- CLI
def _run_cli(
    *extra_args: str, root_dir: Path, script: Path = CLI_SCRIPT, config: Path = CLI_CONFIG
) -> subprocess.CompletedProcess:
    # `default_root_dir` keeps the config.yaml that LightningCLI saves out of the repository.
    cmd = [sys.executable, str(script), "fit", "--config", str(config), f"--trainer.default_root_dir={root_dir}"]
    cmd += extra_args
    try:  # the launcher's workers are killed with the script on a timeout (a session of their own)
        return run(cmd, timeout=TIMEOUT)
    except TimeoutError as error:
        pytest.fail(str(error))


def _assert_trained(result: subprocess.CompletedProcess, processes: int = 2, max_steps: int = 5) -> None:
    tail = result.stdout[-5000:]
    assert result.returncode == 0, f"exit code {result.returncode}. Output:\n{tail}"
    assert f"Starting with {processes} processes" in result.stdout, tail
    assert f"`max_steps={max_steps}` reached" in result.stdout, tail


def test_cli_config_resolves_the_strategy_class_path_and_registered_names():
    """Parsing only (no processes): the class path and the string form both become a HybridStrategy, and the
    config LightningCLI saves (its parser's dump) names the strategy as given. One training run (the YAML's, below)
    shows that the parsed strategy trains: a second run with the registered name would train the same class."""
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

    from lightning_mgpu import HybridStrategy
    from lightning_mgpu.demo import GPTLightningModule, TextDataModule

    base = ["--config", str(REPO / CLI_CONFIG), "--seed_everything=false"]
    for extra, stage in (([], 2), (["--trainer.strategy=hybrid_zero1"], 1), (["--trainer.strategy=hybrid"], 0)):
        cli = LightningCLI(GPTLightningModule, TextDataModule, run=False, args=base + extra)
        strategy = cli.trainer.strategy
        assert isinstance(strategy, HybridStrategy), (extra, type(strategy))
        assert strategy.layout.zero_stage == stage
        assert strategy.layout.data_parallel_size == 2
        # Default start method from a script: Lightning's subprocess launcher, as for DDP.
        assert isinstance(strategy.launcher, _SubprocessScriptLauncher)
        assert cli.model.hparams.n_layer == 2 and cli.datamodule.batch_size == 8
        saved = cli.parser.dump(cli.config, skip_none=False)  # what SaveConfigCallback writes to config.yaml
        expected = f"strategy: {extra[0].split('=')[1]}" if extra else "class_path: lightning_mgpu.HybridStrategy"
        assert expected in saved, saved


@pytest.mark.slow  # the slow tier: end to end: the user's command as fresh processes
def test_cli_trains_with_the_yaml_config(tmp_path):
    result = _run_cli(root_dir=tmp_path)
    _assert_trained(result)
    saved = (tmp_path / "config.yaml").read_text()
    assert "class_path: lightning_mgpu.HybridStrategy" in saved and "zero_stage: 2" in saved


# ------------------------------------------------------------------------------- more CLI configs: 3D, Hugging Face
CLI_3D_CONFIG = Path("examples") / "cli" / "hybrid_3d.yaml"
LLAMA_SCRIPT = Path("examples") / "cli" / "train_llama.py"
LLAMA_CONFIG = Path("examples") / "cli" / "llama_tp.yaml"


def _llama_module_class():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_llama", REPO / LLAMA_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LlamaLightningModule


def test_cli_3d_and_llama_configs_resolve_their_layouts():
    """Parsing only (no processes): the sizes and options of each YAML reach the strategy."""
    from lightning.pytorch.cli import LightningCLI

    from lightning_mgpu import HybridStrategy
    from lightning_mgpu.demo import GPTLightningModule, TextDataModule

    cli = LightningCLI(
        GPTLightningModule,
        TextDataModule,
        run=False,
        args=["--config", str(REPO / CLI_3D_CONFIG), "--seed_everything=false"],
    )
    layout = cli.trainer.strategy.layout
    assert isinstance(cli.trainer.strategy, HybridStrategy)
    assert (layout.pipeline_parallel_size, layout.data_parallel_size, layout.tensor_parallel_size) == (2, 2, 2)
    assert layout.zero_stage == 1 and cli.model.hparams.n_layer == 4

    cli = LightningCLI(
        _llama_module_class(),
        TextDataModule,
        run=False,
        args=["--config", str(REPO / LLAMA_CONFIG), "--seed_everything=false"],
    )
    layout = cli.trainer.strategy.layout
    assert (layout.pipeline_parallel_size, layout.data_parallel_size, layout.tensor_parallel_size) == (1, 1, 2)
    assert type(cli.model.model).__name__ == "LlamaForCausalLM"
    assert cli.model.model.config.num_attention_heads == 4


@pytest.mark.slow  # the slow tier: end to end: the user's command as fresh processes
def test_cli_trains_3d_pipeline_data_tensor_parallel(tmp_path):
    # Eight processes: forked from the parent that has already imported torch (as in a notebook) instead of eight
    # fresh interpreters (~50 s on 2 cores); the script launcher is what the ZeRO-2 config above runs.
    result = _run_cli(
        "--trainer.max_steps=2",
        "--trainer.strategy.init_args.start_method=fork",
        root_dir=tmp_path,
        config=CLI_3D_CONFIG,
    )
    _assert_trained(result, processes=8, max_steps=2)


@pytest.mark.slow  # the slow tier: end to end: the user's command as fresh processes
def test_cli_trains_a_hugging_face_llama_with_its_own_tp_plan(tmp_path):
    # Forked workers, as for the 3D config: the script launcher is run by the ZeRO-2 config's test, and a second
    # interpreter importing torch and transformers would only add start-up time.
    result = _run_cli(
        "--trainer.max_steps=3",
        "--trainer.strategy.init_args.start_method=fork",
        root_dir=tmp_path,
        script=LLAMA_SCRIPT,
        config=LLAMA_CONFIG,
    )
    _assert_trained(result, processes=2, max_steps=3)
