"""Hybrid meshes and per-axis costs: which link each axis uses, and the acceptance test that a
GPT step planned on 2 "nodes" x 4 "gpus" under h100-2node-ib keeps tensor-parallel traffic on
the inner (NVLink) axis while the outer (InfiniBand) axis carries only gradient sync."""

import pytest

import jaxpar
from jaxpar.analysis import collective_axes, collective_ops
from jaxpar.cost.comm import of_splat, reshard
from jaxpar.cost.hardware import Link, load_profile, profile_from_dict
from jaxpar.ir.graph import build_graph
from jaxpar.ir.trace import trace
from jaxpar.mesh import make_hybrid_mesh, make_mesh
from jaxpar.models import gpt
from jaxpar.spec import MeshInfo

IB, NVLINK = "infiniband-ndr", "nvlink4"


def names(links: dict[str, Link]) -> dict[str, str]:
    return {axis: link.name for axis, link in links.items()}


def test_two_node_profile_gives_the_outer_axis_infiniband():
    for mesh in (make_hybrid_mesh((1, 4), (2, 1), ("node", "gpu")),
                 make_mesh((2, 4), ("node", "gpu"))):
        links = load_profile("h100-2node-ib").axis_links(MeshInfo.of(mesh))
        assert names(links) == {"node": IB, "gpu": NVLINK}


@pytest.mark.parametrize("profile,sizes,expected", [
    # nodes: 2 -- the mesh splits in two halves, whatever its size.
    ("h100-2node-ib", (2, 2, 2), (IB, NVLINK, NVLINK)),
    ("h100-2node-ib", (4, 2), (IB, NVLINK)),        # axis 0 = 2 nodes x 2 devices: crosses
    ("h100-2node-ib", (2, 1, 4), (IB, NVLINK, NVLINK)),
    # devices_per_node: 8 -- a node is 8 consecutive devices, any number of nodes.
    ("h100-ib", (2, 8), (IB, NVLINK)),
    ("h100-ib", (4, 4), (IB, NVLINK)),              # stride 4, 4 long: spans two nodes
    ("h100-ib", (2, 4), (NVLINK, NVLINK)),          # 8 devices: one node
    ("h100-ib", (2, 4, 4), (IB, IB, NVLINK)),       # axis 1: stride 4, 4 long, leaves too
    ("h100-nvlink", (2, 4), (NVLINK, NVLINK)),
])
def test_axes_crossing_a_node_boundary_get_the_inter_link(profile, sizes, expected):
    mesh = MeshInfo(tuple(f"a{i}" for i in range(len(sizes))), sizes)
    assert tuple(names(load_profile(profile).axis_links(mesh)).values()) == expected


def test_node_boundary_inside_an_axis():
    # 6 devices per node on a 12-device axis of stride 1: groups {0..11} span both nodes;
    # a (2, 6) mesh keeps each row inside one node.
    p = profile_from_dict({**_base(), "devices_per_node": 6})
    assert p.crossing_axes(MeshInfo(("x",), (12,))) == ("x",)
    assert p.crossing_axes(MeshInfo(("x", "y"), (2, 6))) == ("x",)
    assert p.crossing_axes(MeshInfo(("x", "y"), (3, 4))) == ("x", "y")  # rows 4..7 straddle


def test_measured_axis_links_win_by_name():
    slow = {"name": "measured-slow", "bandwidth": 1.0e9, "latency": 1.0e-4}
    p = profile_from_dict({**_base(), "axes": {"gpu": slow}})
    links = p.axis_links(MeshInfo(("node", "gpu"), (2, 4)))
    assert names(links) == {"node": "fast", "gpu": "measured-slow"}


def _base() -> dict:
    return {"name": "t", "peak_flops": 1e12, "memory_bytes": 1e9, "memory_bandwidth": 1e11,
            "intra": {"name": "fast", "bandwidth": 1e11, "latency": 1e-6},
            "inter": {"name": "slow", "bandwidth": 1e10, "latency": 1e-5}}


# ---- acceptance: tensor parallelism on the inner axis -------------------------------------
# d_model 512 and 16 x 64 tokens: activations weigh about as much as the weights, the regime
# where Megatron-style tensor parallelism pays inside a node and data parallelism across nodes.
CFG = gpt.GPTConfig(layers=1, d_model=512, heads=4, vocab=1024, seq=64)
BATCH = 16
_PASS = frozenset({"convert_element_type", "transpose", "reshape", "broadcast_in_dim", "copy"})


@pytest.fixture(scope="module")
def step():
    mesh = make_hybrid_mesh((1, 4), (2, 1), ("node", "gpu"))
    fn, args = gpt.abstract_train_step(CFG, BATCH)
    traced = trace(fn, args)
    graph = build_graph(traced.closed_jaxpr, traced.in_paths)
    n_params = len(traced.in_paths) - sum(p.startswith(("opt_state", "tokens", "targets"))
                                          for p in traced.in_paths)
    return mesh, fn, args, graph, set(graph.inputs[:n_params])


def weight_axes(graph, gp, params: set[int]) -> list[set[str]]:
    """Mesh axes cutting the weight operand of every matmul that reads a parameter."""
    producer = graph.producers()

    def root(v):
        while isinstance(v, int) and v in producer and producer[v].name in _PASS:
            v = producer[v].inputs[0]
        return v if v in params else None
    out = []
    for op in graph.ops:
        if op.name == "dot_general":
            for k, v in enumerate(op.inputs[:2]):
                if root(v) is not None:
                    out.append(set(gp.choices[op.index].strategy.ins[k].axes()))
    return out


def predicted_traffic(graph, gp, mesh: MeshInfo) -> dict[tuple[str, tuple[str, ...]], float]:
    """Predicted collective bytes by (where, axes): "tail" for the gradient reductions and
    optimizer after the last matmul, "activations" for everything before. A splat (zeros)
    moves what comm.of_splat says."""
    tail, out, splats = graph.tail_values(), {}, graph.splats(mesh.size)

    def add(where, c):
        out[(where, c.axes)] = out.get((where, c.axes), 0.0) + c.bytes
    for op in graph.ops:
        choice = gp.choices[op.index]
        where = "tail" if all(v in tail for v in op.outputs) else "activations"
        for c in choice.cost.collectives:
            add(where, c)
        for v, need in zip(op.inputs, choice.strategy.ins, strict=True):
            if isinstance(v, int):
                moves = reshard(gp.specs[v], need, graph.values[v].nbytes, mesh)
                for c in of_splat(moves) if v in splats else moves:
                    add("tail" if v in tail else "activations", c)
    return out


def compiled_traffic(compiled, mesh: MeshInfo) -> dict[tuple[str, str], float]:
    """Measured collective bytes by (kind, axis) from the compiled HLO's device groups."""
    out = {}
    for op in collective_ops(compiled):
        for axis in collective_axes(op, mesh):
            out[(op.kind, axis)] = out.get((op.kind, axis), 0.0) + op.bytes * op.count
    return out


def test_dynamic_programming_keeps_tensor_parallelism_inside_the_node(step):
    mesh, fn, args, graph, params = step
    f = jaxpar.shard(fn, mesh=mesh, search_mode="dynamic_programming",
                     hardware="h100-2node-ib")
    plan = f.plan(*args)
    cuts = weight_axes(graph, plan.graph_plan, params)
    assert all(axes <= {"gpu"} for axes in cuts), cuts        # weights: gpu or nothing
    assert any(axes == {"gpu"} for axes in cuts)              # and tensor parallel is used
    traffic = predicted_traffic(graph, plan.graph_plan, plan.mesh)
    node = {k: b for k, b in traffic.items() if "node" in k[1]}
    assert node and all(where == "tail" for where, _ in node), traffic
    assert sum(b for (where, _), b in traffic.items() if where == "activations") > 0
    assert plan.layout == "dp2 x tp4", plan.layout

    measured = compiled_traffic(f.lower(*args).compile(), plan.mesh)
    on_node = {k: b for k, b in measured.items() if k[1] == "node"}
    assert {kind for kind, _ in on_node} <= {"all-reduce", "reduce-scatter", "all-gather"}
    assert sum(on_node.values()) < sum(b for (_, a), b in measured.items() if a == "gpu")


def test_a_uniform_network_gives_another_plan(step):
    # The same step on one NVLink domain (same chips, every axis fast) gets another plan, and
    # a cheaper one: the link costs, not the shapes, put tensor parallelism on "gpu".
    mesh, fn, args, _, _ = step
    plans = [jaxpar.shard(fn, mesh=mesh, search_mode="dynamic_programming", hardware=hw)
             .plan(*args) for hw in ("h100-nvlink", "h100-2node-ib")]
    assert plans[0].layout != plans[1].layout == "dp2 x tp4"
    assert plans[0].cost.total_s < plans[1].cost.total_s


def test_recursive_programming_keeps_tensor_parallelism_inside_the_node(step):
    mesh, fn, args, graph, params = step
    plan = jaxpar.shard(fn, mesh=mesh, search_mode="recursive_programming",
                        hardware="h100-2node-ib").plan(*args)
    cuts = weight_axes(graph, plan.graph_plan, params)
    assert all(axes <= {"gpu"} for axes in cuts), cuts
    traffic = predicted_traffic(graph, plan.graph_plan, plan.mesh)
    assert all(where == "tail" for where, axes in traffic if "node" in axes), traffic
