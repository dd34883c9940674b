import pytest

from lightning_mgpu.layout import MESH_AXES, ParallelLayout
from tests.helpers.distributed import run_distributed


@pytest.mark.parametrize(
    ("world", "sizes", "expected"),
    [
        (8, dict(), (8, 1, 1)),
        (8, dict(tensor_parallel_size=2), (4, 2, 1)),
        (8, dict(tensor_parallel_size=2, pipeline_parallel_size=2), (2, 2, 2)),
        (8, dict(data_parallel_size=2, tensor_parallel_size="auto"), (2, 4, 1)),
        (8, dict(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size="auto"), (2, 2, 2)),
        (1, dict(), (1, 1, 1)),
    ],
)
def test_resolve_auto_sizes(world, sizes, expected):
    layout = ParallelLayout.resolve(world, **sizes)
    assert (layout.data_parallel_size, layout.tensor_parallel_size, layout.pipeline_parallel_size) == expected
    assert layout.world_size == world
    assert layout.mesh_shape == (expected[2], expected[0], expected[1])  # (pp, dp, tp): tp innermost


@pytest.mark.parametrize(
    ("world", "sizes", "match"),
    [
        (4, dict(tensor_parallel_size=0), "tensor_parallel_size.*positive integer.*got 0"),
        (4, dict(pipeline_parallel_size=-2), "pipeline_parallel_size.*got -2"),
        (4, dict(data_parallel_size=1.5), "data_parallel_size.*got 1.5"),
        (4, dict(tensor_parallel_size="max"), "tensor_parallel_size.*'auto'.*got 'max'"),
        (4, dict(zero_stage=5), r"zero_stage.*\(0, 1, 2, 3\).*got 5"),
        (4, dict(zero_stage=True), "zero_stage.*got True"),
        (6, dict(tensor_parallel_size=4), "multiply to 4.*does not divide the world size 6"),
        (4, dict(data_parallel_size=2, tensor_parallel_size=1, pipeline_parallel_size=1), "= 2 processes.*has 4"),
        (
            4,
            dict(data_parallel_size=4, tensor_parallel_size=2),
            "= 8 processes, but the Trainer has 4.*data_parallel_size='auto'",
        ),
        (4, dict(expert_parallel_size=0), r"`expert_parallel_size` must be a positive integer, got 0\."),
        (4, dict(expert_parallel_size=True), "`expert_parallel_size` must be a positive integer, got True"),
        (4, dict(data_parallel_shard_size=0), r"`data_parallel_shard_size` must be a positive integer.*or None.*got 0"),
        (4, dict(data_parallel_shard_size="2"), "`data_parallel_shard_size` must be a positive integer.*got '2'"),
    ],
)
def test_invalid_layouts_name_argument_value_and_fix(world, sizes, match):
    with pytest.raises(ValueError, match=match):
        ParallelLayout.resolve(world, **sizes)


def test_every_degree_is_the_layouts_own():
    """Expert parallelism and HSDP's shard groups are kept as given (they cut dp, they add no ranks), said beside the
    ZeRO stage only when set, and the mesh reads the shard size from the layout."""
    plain = ParallelLayout.resolve(8, tensor_parallel_size=2, zero_stage=1)
    assert (plain.ep, plain.dp_shard) == (1, None)
    assert plain.describe() == "dp=4 x tp=2 x pp=1 (zero_stage=1)"
    experts = ParallelLayout.resolve(8, zero_stage=1, expert_parallel_size=2)
    assert (experts.data_parallel_size, experts.world_size, experts.ep, experts.dp_shard) == (8, 8, 2, None)
    assert experts.describe() == "dp=8 x tp=1 x pp=1 (zero_stage=1, ep=2)"
    hsdp = ParallelLayout.resolve(8, zero_stage=3, data_parallel_shard_size=4)
    assert (hsdp.data_parallel_size, hsdp.world_size, hsdp.ep, hsdp.dp_shard) == (8, 8, 1, 4)
    assert hsdp.describe() == "dp=8 x tp=1 x pp=1 (zero_stage=3, dp_shard=4)"
    assert hsdp == ParallelLayout(8, 1, 1, 3, data_parallel_shard_size=4) != ParallelLayout(8, 1, 1, 3)


def test_layout_is_frozen():
    layout = ParallelLayout()
    with pytest.raises(AttributeError):
        layout.zero_stage = 3  # type: ignore[misc]


def _mesh_groups():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    mesh = ParallelLayout.resolve(8, tensor_parallel_size=2, pipeline_parallel_size=2).build_mesh("cpu")
    return {axis: dist.get_process_group_ranks(mesh[axis].get_group()) for axis in MESH_AXES}


def test_mesh_axes_put_tensor_parallel_innermost():
    groups = run_distributed(_mesh_groups, 8)
    # rank 5 = (pp 1, dp 0, tp 1) in a (pp=2, dp=2, tp=2) mesh
    assert groups[5] == {"pp": [1, 5], "dp": [5, 7], "tp": [4, 5]}
    assert groups[0]["tp"] == [0, 1]  # consecutive ranks (one node's GPUs) share a tensor-parallel group


def test_mesh_axes_are_named_once_in_layout_py():
    """Outside ``layout.py`` no mesh is indexed or built with a literal axis name (``mesh["dp"]``,
    ``mesh_dim_names=("dp", "tp")``): every axis, the expert ones included, is a constant of ``layout.py``."""
    import ast
    from pathlib import Path

    import lightning_mgpu
    from lightning_mgpu import layout

    axes = {
        layout.PP_AXIS,
        layout.DP_AXIS,
        layout.TP_AXIS,
        layout.EP_AXIS,
        layout.EXPERT_REPLICA_AXIS,
        layout.DP_REPLICATE_AXIS,
        layout.DP_SHARD_AXIS,
    }
    package = Path(lightning_mgpu.__file__).parent
    literal = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "layout.py" and path.parent == package:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[ast.AST] = []
            if isinstance(node, ast.Subscript) and "mesh" in ast.unparse(node.value).lower():
                names = [node.slice]
            elif isinstance(node, ast.keyword) and node.arg == "mesh_dim_names":
                names = list(node.value.elts) if isinstance(node.value, (ast.Tuple, ast.List)) else [node.value]
            for name in names:
                if isinstance(name, ast.Constant) and name.value in axes:
                    literal.append(f"{path.relative_to(package.parent)}:{node.lineno}: {name.value!r}")
    assert not literal, "Mesh axes named by a literal instead of layout.py's constant:\n" + "\n".join(literal)
