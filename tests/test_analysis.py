"""analysis: collectives, memory and flops of compiled programs, on real programs and HLO text.

Real programs run on the 8 CPU devices of conftest; their collectives are known in advance, so
counts and bytes are asserted exactly. The text tests pin the HLO forms CPU never prints (async
pairs, iota replica groups, sub-axes) with snippets in the syntax of XLA's own tests.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar._hlo import parse_module, replica_groups, shape_bytes, source_target_pairs
from jaxpar.analysis import (
    KINDS,
    collective_ops,
    collective_stats,
    compiled_bytes,
    estimate_time,
    flops,
    library_gemm_flops,
    memory_stats,
)
from jaxpar.cost.hardware import HardwareProfile, Link
from jaxpar.spec import MeshInfo


def mesh(shape=(8,), names=("d",)):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def compiled(fn, in_specs, out_spec, *shapes, m=None, dtype=jnp.float32):
    m = m or mesh()
    in_specs = (in_specs,) if isinstance(in_specs, P) else in_specs
    ins = tuple(NamedSharding(m, s) for s in in_specs)
    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    return jax.jit(fn, in_shardings=ins, out_shardings=NamedSharding(m, out_spec)).lower(
        *args).compile()


def stat(count, nbytes):
    return {"count": count, "bytes": nbytes}


F32 = 4


# ---- real programs ---------------------------------------------------------------------------

def test_all_reduce_from_contracting_matmul():
    c = compiled(lambda x, w: x @ w, (P(None, "d"), P("d", None)), P(), (16, 32), (32, 64))
    assert collective_stats(c) == {"all-reduce": stat(1, 16 * 64 * F32)}


def test_all_gather_counts_the_gathered_result():
    c = compiled(lambda x: x * 2, P("d"), P(), (16, 32))
    assert collective_stats(c) == {"all-gather": stat(1, 16 * 32 * F32)}


def test_cpu_reduce_scatter_is_all_reduce_then_dynamic_slice():
    c = compiled(lambda x, w: x @ w, (P(None, "d"), P("d", None)), P("d", None),
                 (16, 32), (32, 64))
    text = c.as_text()
    assert " all-reduce(" in text and " reduce-scatter(" not in text, "CPU pattern changed"
    assert collective_stats(c) == {"reduce-scatter": stat(1, 16 * 64 * F32)}


def test_native_reduce_scatter_counts_the_full_input():
    fn = jax.shard_map(lambda x: lax.psum_scatter(x, "d", tiled=True), mesh=mesh(),
                       in_specs=P(), out_specs=P("d"))
    c = jax.jit(fn).lower(jnp.ones((64, 4))).compile()
    assert " reduce-scatter(" in c.as_text()
    assert collective_stats(c) == {"reduce-scatter": stat(1, 64 * 4 * F32)}


def test_cpu_widens_a_bf16_all_reduce_and_says_by_how_much_at_most():
    fn = jax.shard_map(lambda x: lax.psum(x, "d"), mesh=mesh(), in_specs=P("d"), out_specs=P())
    c = jax.jit(fn).lower(jnp.ones((64, 16), jnp.bfloat16)).compile()
    assert "_promoted" in c.as_text(), "XLA:CPU no longer widens bf16 all-reduces"
    (op,) = collective_ops(c)
    assert (op.kind, op.bytes, op.widened) == ("all-reduce", 8 * 16 * F32, 8 * 16 * 2)
    f32 = jax.jit(fn).lower(jnp.ones((64, 16), jnp.float32)).compile()
    assert collective_ops(f32)[0].widened == 0


@pytest.mark.parametrize("src,dst,kind", [(P("d", None), P(), "all-gather"),
                                           (P("d", None), P(None, "d"), "all-to-all")])
def test_cpu_moves_bf16_as_f32_and_says_by_how_much_at_most(src, dst, kind):
    # XLA:CPU converts a bf16 value to f32 before an all-gather or all-to-all and back after
    # it: the collective moves twice the bytes a GPU or TPU would.
    def fn(x):
        return jnp.sin(x) * 2
    shape = (64, 64)
    c = compiled(fn, src, dst, shape, dtype=jnp.bfloat16)
    (op,) = collective_ops(c)
    assert op.kind == kind and op.widened == op.bytes // 2 > 0
    assert collective_ops(compiled(fn, src, dst, shape))[0].widened == 0  # f32 moves f32


def test_all_to_all_reshard():
    c = compiled(lambda x: x * 2, P("d", None), P(None, "d"), (64, 64))
    assert collective_stats(c) == {"all-to-all": stat(1, 64 * 64 * F32 // 8)}


def _reduce_step(x, c):
    return jnp.tanh(jnp.sum(x * c, axis=0))  # rows of x sharded: a partial sum, all-reduced


LOOPS = {
    "fori": lambda x, c: lax.fori_loop(0, 5, lambda i, c: _reduce_step(x, c), c),
    "scan": lambda x, c: lax.scan(lambda c, _: (_reduce_step(x, c), None), c, None, length=5)[0],
    "nested": lambda x, c: lax.fori_loop(
        0, 3, lambda i, c: lax.fori_loop(0, 4, lambda j, c: _reduce_step(x, c), c), c),
}


@pytest.mark.parametrize("name,times", [("fori", 5), ("scan", 5), ("nested", 12)])
def test_loop_body_counts_trip_count_times(name, times):
    c = compiled(LOOPS[name], (P("d"), P()), P(), (64, 16), (16,))
    assert c.as_text().count(" all-reduce(") == 1
    assert collective_stats(c) == {"all-reduce": stat(times, times * 16 * F32)}


def test_no_collectives():
    c = compiled(lambda x: x * 2 + 1, P("d"), P("d"), (16, 32))
    assert collective_stats(c) == {}


def test_tuple_all_reduce_and_permute_from_shard_map():
    def fn(x, y):
        return lax.psum((x, y), "d"), lax.ppermute(x, "d", [(i, (i + 1) % 8) for i in range(8)])

    sm = jax.shard_map(fn, mesh=mesh(), in_specs=(P("d"), P("d")),
                       out_specs=((P(), P()), P("d")))
    c = jax.jit(sm).lower(jnp.ones((16, 4)), jnp.ones((8,))).compile()
    assert collective_stats(c) == {"all-reduce": stat(1, (2 * 4 + 1) * F32),
                                   "collective-permute": stat(1, 2 * 4 * F32)}


def test_conditional_counts_the_costlier_branch():
    def fn(p, x):
        return lax.cond(p[0], lambda x: lax.all_gather(x, "d", tiled=True)[:2] * 1.0,
                        lambda x: lax.psum(x, "d"), x)

    sm = jax.shard_map(fn, mesh=mesh(), in_specs=(P(), P("d")), out_specs=P(), check_vma=False)
    c = jax.jit(sm).lower(jnp.array([True]), jnp.ones((16, 4))).compile()
    assert " conditional(" in c.as_text()
    assert collective_stats(c) == {"all-gather": stat(1, 16 * 4 * F32)}


AXES = [("a",), ("b",), ("c",), ("a", "c"), ("b", "c"), ("a", "b", "c")]


@pytest.mark.parametrize("axes", AXES)
def test_mesh_replica_groups_match_the_mesh(axes):
    m = mesh((2, 2, 2), ("a", "b", "c"))
    c = compiled(lambda x, w: x @ w, (P(None, axes), P(axes, None)), P(), (16, 32), (32, 64),
                 m=m)
    line = next(ln for ln in c.as_text().splitlines() if " all-reduce(" in ln)
    assert "replica_groups=mesh[" in line
    ids = np.arange(8).reshape(2, 2, 2)
    moved = [m.axis_names.index(a) for a in axes]
    keep = [i for i in range(3) if i not in moved]
    want = ids.transpose(keep + moved).reshape(-1, 2 ** len(axes)).tolist()
    assert sorted(map(sorted, replica_groups(line))) == sorted(map(sorted, want))


def test_scan_training_step_with_iota_groups():
    # A 3-layer (dp=4, tp=2) MLP step under scan: per layer a tp all-reduce forward and one
    # backward, and the weight gradients' dp all-reduce, combined into one tuple all-reduce
    # whose groups XLA prints in iota form ([2,4]<=[4,2]T(1,0)).
    m = mesh((4, 2), ("dp", "tp"))

    def step(w1, w2, x):
        def loss(w1, w2):
            layer = lambda h, w: (jax.nn.relu(h @ w[0]) @ w[1], None)  # noqa: E731
            return jnp.mean(lax.scan(layer, x, (w1, w2))[0] ** 2)
        return jax.grad(loss, argnums=(0, 1))(w1, w2)

    specs = (P(None, None, "tp"), P(None, "tp", None), P("dp"))
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((3, 64, 256), (3, 256, 64), (32, 64))]
    shardings = tuple(NamedSharding(m, s) for s in specs)
    c = jax.jit(step, in_shardings=shardings, out_shardings=shardings[:2]).lower(*args).compile()
    per_layer = 2 * (32 // 4) * 64 * F32 + 2 * 64 * (256 // 2) * F32
    assert collective_stats(c) == {"all-reduce": stat(9, 3 * per_layer)}
    # Devices are 2*dp + tp: the gradients reduce over dp, the activations over tp. Which of
    # them XLA prints first differs between versions; each must parse to one of the two.
    dp, tp = [[0, 2, 4, 6], [1, 3, 5, 7]], [[0, 1], [2, 3], [4, 5], [6, 7]]
    groups = [replica_groups(ln) for ln in c.as_text().splitlines()
              if "all-reduce(" in ln and "<=[" in ln]
    assert dp in groups and all(g in (dp, tp) for g in groups), groups


def test_memory_stats_and_flops_are_per_device():
    c = compiled(lambda x, w: x @ w, (P("d"), P()), P("d"), (64, 32), (32, 16))
    mem = memory_stats(c)
    assert mem["argument_bytes"] == (64 * 32 // 8 + 32 * 16) * F32
    assert mem["output_bytes"] == 64 * 16 // 8 * F32
    assert mem["peak_bytes"] >= mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"]
    assert set(mem) == {"argument_bytes", "output_bytes", "alias_bytes", "temp_bytes",
                        "generated_code_bytes", "peak_bytes"}
    assert flops(c) == 2 * (64 // 8) * 32 * 16


def test_memory_stats_peak_counts_temporaries():
    # XLA:CPU's peak_memory_in_bytes is arguments + outputs - aliased (1 MiB and 20 B here):
    # the temporaries the matmuls' results take were left out. The sort keeps them apart:
    # jaxlib 0.11's CPU backend fuses two matmuls and their elementwise ops into one YNNPACK
    # fusion that reports no temporaries at all.
    def f(x):
        a = jnp.sin(x) @ x
        return jnp.sum(jnp.cos(jnp.sort(a, axis=0)) @ a)

    c = jax.jit(f).lower(jax.ShapeDtypeStruct((512, 512), jnp.float32)).compile()
    mem = memory_stats(c)
    assert mem["temp_bytes"] >= 512 * 512 * F32
    assert mem["peak_bytes"] == compiled_bytes(c)


def test_flops_accepts_a_list_of_dicts():
    class Old:
        def cost_analysis(self):
            return [{"flops": 10.0}, {"flops": 5.0}]

        def as_text(self):  # no library GEMMs to add
            return "HloModule m\n\nENTRY %e () -> f32[] {\n  ROOT %c = f32[] constant(0)\n}\n"

    assert flops(Old()) == 15.0


def test_lowered_text_is_refused():
    lowered = jax.jit(lambda x: x + 1).lower(jnp.ones(4))
    with pytest.raises(ValueError, match="compile"):
        collective_stats(lowered)


@pytest.mark.parametrize("bad, error", [(None, TypeError), (5, TypeError),
                                        ("garbage", ValueError)])
def test_what_is_no_compiled_program_is_refused_naming_it(bad, error):
    # These raised AttributeError ('as_text') or an AssertionError from the HLO parser.
    with pytest.raises(error, match="compiled="):
        collective_stats(bad)
    with pytest.raises(error, match="compiled="):
        estimate_time(bad, MeshInfo(("d",), (8,)), "h100-nvlink")
    with pytest.raises(TypeError, match="compiled="):
        memory_stats(bad)


# ---- HLO text --------------------------------------------------------------------------------

def module(*lines, extra="", partitions=8):
    body = "\n".join(f"  {ln}" for ln in lines)
    return (f"HloModule m, num_partitions={partitions}\n\n%add (a: f32[], b: f32[]) -> f32[] {{\n"
            "  %a = f32[] parameter(0)\n  %b = f32[] parameter(1)\n"
            f"  ROOT %s = f32[] add(%a, %b)\n}}\n{extra}\nENTRY %main () -> f32[] {{\n{body}\n}}\n")


ALL = "replica_groups={{0,1,2,3,4,5,6,7}}"


@pytest.mark.parametrize("text,nbytes", [
    ("f32[8,4]{1,0}", 128), ("(f32[8]{0}, bf16[2,4]{1,0})", 48), ("pred[3]", 3),
    ("s4[8]{0}", 8), ("s4[8]{0:E(4)}", 4), ("f32[<=8]", 32), ("token[]", 0), ("f32[]", 4),
    ("(f32[2]{0}, /*index=1*/s32[2]{0})", 16), ("c64[2]", 16), ("f8e4m3fn[4]", 4)])
def test_shape_bytes(text, nbytes):
    assert shape_bytes(text) == nbytes


def test_tuple_collectives_sum_their_elements():
    text = module("%p = f32[8]{0} parameter(0)", "%q = f32[4]{0} parameter(1)",
                  f"%ar = (f32[8]{{0}}, f32[4]{{0}}) all-reduce(%p, %q), {ALL}, to_apply=%add",
                  f"%a2a = (f32[8]{{0}}, f32[8]{{0}}) all-to-all(%p, %p), {ALL}")
    assert collective_stats(text) == {"all-reduce": stat(1, 48), "all-to-all": stat(1, 64)}


def test_a_promoted_tuple_all_reduce_splits_its_widened_bytes():
    extra = ("%add_promoted (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n"
             "  %b = f32[] parameter(1)\n  ROOT %s = f32[] add(%a, %b)\n}\n")
    text = module("%p = f32[64]{0} parameter(0)", "%q = f32[8]{0} parameter(1)",
                  "%z = s32[] parameter(2)",
                  f"%ar = (f32[64]{{0}}, f32[8]{{0}}) all-reduce(%p, %q), {ALL}, "
                  "to_apply=%add_promoted",
                  "%g0 = f32[64]{0} get-tuple-element(%ar), index=0",
                  "%g1 = f32[8]{0} get-tuple-element(%ar), index=1",
                  "%ds = f32[8]{0} dynamic-slice(%g0, %z), dynamic_slice_sizes={8}",
                  "ROOT %t = (f32[8]{0}, f32[8]{0}) tuple(%ds, %g1)", extra=extra)
    ops = {op.kind: (op.bytes, op.widened) for op in collective_ops(text)}
    assert ops == {"reduce-scatter": (256, 128), "all-reduce": (32, 16)}
    plain = text.replace("to_apply=%add_promoted", "to_apply=%add")
    assert all(op.widened == 0 for op in collective_ops(plain))


def test_a_tuple_element_converted_to_bf16_after_its_all_reduce_is_widened():
    # XLA:CPU computes a bf16 matmul's weight gradient in f32, reduces it under an f32 add
    # and converts it back after: only the element every use converts to bf16 was widened.
    text = module("%p = f32[64]{0} parameter(0)", "%q = f32[8]{0} parameter(1)",
                  f"%ar = (f32[64]{{0}}, f32[8]{{0}}) all-reduce(%p, %q), {ALL}, to_apply=%add",
                  "%g0 = f32[64]{0} get-tuple-element(%ar), index=0",
                  "%g1 = f32[8]{0} get-tuple-element(%ar), index=1",
                  "%c0 = bf16[64]{0} convert(%g0)",
                  "ROOT %t = (bf16[64]{0}, f32[8]{0}) tuple(%c0, %g1)")
    assert [(op.kind, op.bytes, op.widened) for op in collective_ops(text)] == \
        [("all-reduce", 288, 128)]
    kept = text.replace("%c0 = bf16[64]{0} convert(%g0)", "%c0 = f32[64]{0} negate(%g0)")
    assert collective_ops(kept.replace("(bf16[64]", "(f32[64]"))[0].widened == 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_16bit_reduce_scatter_converted_back_before_its_slice_is_one(dtype):
    # XLA:CPU reduces a bf16 matmul's partial sums in f32, converts the whole result back to
    # bf16 (a fusion), and a second fusion converts to f32 again to slice it: the slice was
    # not seen through the converts and the reduce-scatter was reported as an all-reduce.
    mesh, ax = jaxpar.make_mesh(8), ("d0", "d1", "d2")
    x, w = jnp.ones((64, 256), dtype), jnp.ones((256, 32), dtype)
    compiled = jax.jit(lambda x, w: x @ w,
                       in_shardings=(NamedSharding(mesh, P(None, ax)), NamedSharding(mesh, P(ax))),
                       out_shardings=NamedSharding(mesh, P(ax))).lower(x, w).compile()
    (op,) = collective_ops(compiled)
    assert (op.kind, op.bytes) == ("reduce-scatter", 64 * 32 * F32)
    assert op.widened == (64 * 32 * 2 if dtype == jnp.bfloat16 else 0)


def test_a_bf16_weight_gradient_reduced_in_f32_passes_verify():
    # The weight's bf16 gradient is computed and reduced in f32, combined with the scale's f32
    # gradient under one f32 reducer (no `_promoted` clone), and converted back to bf16 after.
    def loss(p, x):
        y = (x * p["g"]).astype(jnp.bfloat16) @ p["w"].astype(jnp.bfloat16)
        return jnp.mean(y.astype(jnp.float32) ** 2)

    def step(p, x):
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(loss)(p, x))

    p, x = {"g": jnp.ones(64), "w": jnp.ones((64, 128))}, jnp.ones((32, 64))
    f = jaxpar.shard(step, in_strategy=({"g": (1,), "w": (1, 1)}, (8, 1)))
    plan, compiled = f.plan(p, x), f.lower(p, x).compile()
    assert "_promoted" not in compiled.as_text()
    (op,) = collective_ops(compiled)
    assert (op.kind, op.bytes, op.widened) == ("all-reduce", (64 + 64 * 128) * F32, 64 * 128 * 2)
    assert plan.verify(compiled).ok


def test_a_step_tail_reductions_combined_by_xla_are_priced_as_one_latency():
    # An Adam step's gradient all-reduces, combined by XLA into one collective: the plan gave
    # each a share 1/m of one latency, m its outputs there (three per parameter), and so
    # modelled a third of the latency the compiled program pays.
    import optax

    from jaxpar.models import mlp

    params = mlp.init_mlp(jax.random.key(0), [64, 128, 64])
    tx = optax.adam(1e-3)
    args = (params, tx.init(params), jnp.ones((32, 64)), jnp.ones((32, 64)))
    mesh8 = jaxpar.make_mesh(8)
    f = jaxpar.shard(mlp.make_train_step(tx), in_strategy=(None, None, P(("d0", "d1", "d2")),
                                                           P(("d0", "d1", "d2"))),
                     mesh=mesh8, hardware="h100-nvlink", search_mode="dynamic_programming")
    plan, compiled = f.plan(*args), f.lower(*args).compile()
    measured = jaxpar.estimate_time(compiled, mesh8, "h100-nvlink")
    assert measured["collectives"]["all-reduce"]["count"] == 1  # XLA combined them
    assert plan.collectives["all-reduce"]["count"] > 1          # the plan makes several
    assert plan.cost.comm_s == pytest.approx(measured["comm_s"], rel=0.02)



def test_a_loop_bodys_tail_reductions_combined_by_xla_are_priced_per_trip():
    # A GRU trained through its scans: each backward trip ends in reductions XLA combines, one
    # collective (one latency) per kind and device group. The loop was priced with the shares
    # graph_cost gives (1/m of a latency each, m the body's outputs there), and nothing added
    # the rest as Plan.cost does for the step's own tail: 168 us modelled, 421 us compiled.
    B, T, D, H = 16, 8, 16, 32

    def loss(p, xs, t):
        def cell(h, x):
            rx, zx, nx = jnp.split(x @ p["wx"], 3, -1)
            rh, zh, nh = jnp.split(h @ p["wh"], 3, -1)
            r, z = jax.nn.sigmoid(rx + rh), jax.nn.sigmoid(zx + zh)
            return (1 - z) * jnp.tanh(nx + r * nh) + z * h, None
        h, _ = jax.lax.scan(cell, jnp.zeros((B, H)), jnp.swapaxes(xs, 0, 1))
        return jnp.mean((h @ p["wo"] - t) ** 2)

    def step(p, xs, t):
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(loss)(p, xs, t))

    rng = np.random.default_rng(0)
    p = {k: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)
         for k, s in {"wx": (D, 3 * H), "wh": (H, 3 * H), "wo": (H, 4)}.items()}
    xs, t = jnp.ones((B, T, D)), jnp.ones((B, 4))
    mesh8 = jaxpar.make_mesh(8)
    f = jaxpar.shard(step, in_strategy=(None, (8, 1, 1), (8, 1)), mesh=mesh8,
                     hardware="h100-nvlink", search_mode="recursive_programming")
    plan, compiled = f.plan(p, xs, t), f.lower(p, xs, t).compile()
    measured = jaxpar.estimate_time(compiled, mesh8, "h100-nvlink")
    loops = [op for op in collective_ops(compiled) if op.count == T]
    assert loops, "the backward loop reduces each trip"
    assert plan.verify(compiled).bytes_ok
    assert plan.cost.comm_s == pytest.approx(measured["comm_s"], rel=0.05)


ASYNC = {
    "all-gather": [
        "%x = f32[8,4]{1,0} parameter(0)",
        f"%s = (f32[8,4]{{1,0}}, f32[64,4]{{1,0}}) all-gather-start(%x), {ALL}, dimensions={{0}}",
        "ROOT %d = f32[64,4]{1,0} all-gather-done(%s)"],
    "all-reduce": [
        "%x = f32[64]{0} parameter(0)",
        f"%s = f32[64]{{0}} all-reduce-start(%x), {ALL}, to_apply=%add",
        "ROOT %d = f32[64]{0} all-reduce-done(%s)"],
    "collective-permute": [
        "%x = f32[64]{0} parameter(0)",
        ("%s = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%x), "
         "source_target_pairs={{0,1},{1,0}}"),
        "ROOT %d = f32[64]{0} collective-permute-done(%s)"],
}


@pytest.mark.parametrize("kind", sorted(ASYNC))
def test_async_start_done_pairs_count_once(kind):
    want = {kind: stat(1, 64 * 4 * F32 if kind == "all-gather" else 64 * F32)}
    assert collective_stats(module(*ASYNC[kind])) == want
    no_done = [ln for ln in ASYNC[kind] if "-done" not in ln]  # start only: read its tuple
    assert collective_stats(module(*no_done)) == want


def test_async_start_wrapping_collectives():
    wrapped = (
        "%rs_body (p: u32[8]) -> u32[4] {\n  %p = u32[8]{0} parameter(0)\n"
        "  ROOT %rs = u32[4]{0} reduce-scatter(u32[8]{0} %p), replica_groups={}, "
        "dimensions={0}, to_apply=%add\n}\n"
        "%a2a_body (q: f32[16]) -> f32[16] {\n  %q = f32[16]{0} parameter(0)\n"
        "  ROOT %t = f32[16]{0} all-to-all(f32[16]{0} %q), replica_groups={{0,1},{2,3}}, "
        "dimensions={0}\n}\n")
    text = module(
        "%x = u32[8]{0} parameter(0)", "%y = f32[16]{0} parameter(1)",
        "%s = ((u32[8]{0}), u32[4]{0}) async-start(u32[8]{0} %x), calls=%rs_body",
        "%u = ((u32[8]{0}), u32[4]{0}) async-update(%s), calls=%rs_body",
        "%d = u32[4]{0} async-done(%u), calls=%rs_body",
        "%s2 = ((f32[16]{0}), f32[16]{0}, s32[]) async-start(%y), calls=%a2a_body",
        "ROOT %d2 = f32[16]{0} async-done(%s2), calls=%a2a_body", extra=wrapped, partitions=2)
    assert collective_stats(text) == {"reduce-scatter": stat(1, 8 * 4), "all-to-all": stat(1, 64)}


# The mesh form as Shardy's partitioner prints it for a (2, 2, 2) mesh (see the real-program test).
MESH_124 = "mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([2,2,2]T(1,0,2))"
MESH_214 = "mesh['axis_0'=2,'axis_1'=1,'axis_2'=4], device_ids=([4,2]T(1,0))"


@pytest.mark.parametrize("attr,groups", [
    ("replica_groups={{0,1},{2,3}}", [[0, 1], [2, 3]]),
    ("replica_groups={}", [list(range(8))]),
    ("replica_groups=[4,2]<=[8]", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("replica_groups=[2,4]<=[4,2]T(1,0)", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}", [list(range(8))]),
    (f"replica_groups={MESH_124} {{'axis_1'}}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    (f"replica_groups={MESH_214} {{'axis_0'}}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("replica_groups=mesh[a=2,b=4] {b,a}", [[0, 4, 1, 5, 2, 6, 3, 7]]),  # listed order
    ("replica_groups=mesh['a'=8] {'a':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("replica_groups=mesh['a'=8] {'a':(1)2,'a':(4)2}", [[0, 1, 4, 5], [2, 3, 6, 7]]),
    ("replica_groups=mesh['a'=4], device_ids=(3,2,1,0) {'a'}", [[3, 2, 1, 0]]),
    ("replica_groups=maximal_mesh[device_id=3] {}", [[3]]),
])
def test_replica_group_forms(attr, groups):
    assert replica_groups(f"{attr}, dimensions={{0}}", 8) == groups


@pytest.mark.parametrize("attr,size", [
    ("replica_groups={{0,1,2,3},{4,5,6,7}}", 4), ("replica_groups=[2,4]<=[4,2]T(1,0)", 4),
    ("replica_groups=[4,2]<=[8]", 2), ("replica_groups={}", 8),
    (f"replica_groups={MESH_124} {{'axis_2'}}", 4)])
def test_reduce_scatter_bytes_use_the_group_size(attr, size):
    rs = f"%rs = f32[16]{{0}} reduce-scatter(%x), {attr}, dimensions={{0}}, to_apply=%add"
    text = module(f"%x = f32[{16 * size}]{{0}} parameter(0)", rs)
    assert collective_stats(text) == {"reduce-scatter": stat(1, 16 * size * F32)}
    text = module(rs)  # operand type unknown: the group size alone gives the input
    assert collective_stats(text) == {"reduce-scatter": stat(1, 16 * size * F32)}


def test_collectives_that_move_nothing_are_left_out():
    text = module(
        "%x = f32[8]{0} parameter(0)",
        "%cp = f32[8]{0} collective-permute(%x), source_target_pairs={{0,0},{1,1}}",
        "%ar = f32[8]{0} all-reduce(%x), replica_groups={{0},{1}}, to_apply=%add",
        "%ag = f32[8]{0} all-gather(%x), replica_groups=mesh['x'=8,'y'=1] {'y'}, dimensions={0}",
        "%cp2 = f32[8]{0} collective-permute(%x), source_target_pairs={{0,0},{1,2},{2,1}}")
    assert collective_stats(text) == {"collective-permute": stat(1, 32)}
    assert source_target_pairs("source_target_pairs={{0,0},{1,2}}, x=1") == [(0, 0), (1, 2)]


def _while(name, body, trip, cond="%cond"):
    cfg = (f', backend_config={{"known_trip_count":{{"n":"{trip}"}}}}' if trip else "")
    return (f"%{name} = (s32[], f32[8]{{0}}) while(%t), condition={cond}, body={body}{cfg}")


LOOP_COMPS = (
    "%cond (c: (s32[], f32[8])) -> pred[] {\n  %c = (s32[], f32[8]{0}) parameter(0)\n"
    "  ROOT %k = pred[] constant(true)\n}\n"
    "%inner (i: (s32[], f32[8])) -> (s32[], f32[8]) {\n  %i = (s32[], f32[8]{0}) parameter(0)\n"
    "  %v = f32[8]{0} get-tuple-element(%i), index=1\n"
    f"  %ar = f32[8]{{0}} all-reduce(%v), {ALL}, to_apply=%add\n"
    "  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %ar)\n}\n"
    "%outer (o: (s32[], f32[8])) -> (s32[], f32[8]) {\n  %t = (s32[], f32[8]{0}) parameter(0)\n"
    f"  ROOT {_while('w', '%inner', 4)}\n}}\n")


@pytest.mark.parametrize("loops,times", [
    ([_while("w", "%outer", 3)], 12),
    ([_while("w", "%inner", 5)], 5),
    ([_while("w", "%inner", None)], 1),
    ([_while("w", "%inner", 2), _while("w2", "%outer", 2)], 10),
])
def test_while_trip_counts_multiply(loops, times):
    text = module("%t = (s32[], f32[8]{0}) parameter(0)", *loops, extra=LOOP_COMPS)
    assert collective_stats(text) == {"all-reduce": stat(times, times * 32)}


def test_escaped_backend_config_trip_count():
    escaped = r'backend_config="{\"known_trip_count\":{\"n\":\"7\"}}"'
    line = f"{_while('w', '%inner', None)}, {escaped}"
    text = module("%t = (s32[], f32[8]{0}) parameter(0)", line, extra=LOOP_COMPS)
    assert collective_stats(text) == {"all-reduce": stat(7, 7 * 32)}


CALLED = (
    "%big (p: f32[64]) -> f32[64] {\n  %p = f32[64]{0} parameter(0)\n"
    f"  ROOT %g = f32[64]{{0}} all-reduce(%p), {ALL}, to_apply=%add\n}}\n"
    "%small (q: f32[64]) -> f32[64] {\n  %q = f32[64]{0} parameter(0)\n"
    "  %h = f32[8]{0} slice(%q), slice={[0:8]}\n"
    "  %ag = f32[64]{0} all-gather(%h), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}\n"
    f"  ROOT %k = f32[64]{{0}} all-reduce(%ag), {ALL}, to_apply=%add\n}}\n")


@pytest.mark.parametrize("line,want", [
    ("%r = f32[64]{0} call(%x), to_apply=%big", {"all-reduce": stat(1, 256)}),
    ("%r = f32[64]{0} fusion(%x), kind=kLoop, calls=%small",
     {"all-reduce": stat(1, 256), "all-gather": stat(1, 256)}),
    ("%r = f32[64]{0} conditional(%i, %x, %x), branch_computations={%big, %small}",
     {"all-reduce": stat(1, 256), "all-gather": stat(1, 256)}),
    ("%r = f32[64]{0} conditional(%pr, %x, %x), true_computation=%big, false_computation=%big",
     {"all-reduce": stat(1, 256)}),
    ("%r = f32[64]{0} custom-call(%x), custom_call_target=\"f\", called_computations={%big}",
     {"all-reduce": stat(1, 256)}),
    ("%r = f32[] reduce(%x, %z), dimensions={0}, to_apply=%big", {}),
])
def test_called_computations(line, want):
    text = module("%x = f32[64]{0} parameter(0)", "%i = s32[] parameter(1)",
                  "%pr = pred[] parameter(2)", "%z = f32[] constant(0)", line, extra=CALLED)
    assert collective_stats(text) == want


FUSED = ("%fused (a: f32[64], o: s32[]) -> f32[8] {\n  %a = f32[64]{0} parameter(0)\n"
         "  %o = s32[] parameter(1)\n"
         "  ROOT %ds = f32[8]{0} dynamic-slice(%a, %o), dynamic_slice_sizes={8}\n}\n")


@pytest.mark.parametrize("users,kind", [
    (["%s = f32[8]{0} dynamic-slice(%ar, %o), dynamic_slice_sizes={8}"], "reduce-scatter"),
    (["%f = f32[8]{0} fusion(%ar, %o), kind=kLoop, calls=%fused"], "reduce-scatter"),
    (["%b = f32[8,8]{1,0} bitcast(%ar)",
      "%s = f32[1,8]{1,0} dynamic-slice(%b, %o, %o), dynamic_slice_sizes={1,8}"],
     "reduce-scatter"),
    (["%s = f32[8]{0} dynamic-slice(%ar, %o), dynamic_slice_sizes={8}",
      "%n = f32[64]{0} negate(%ar)"], "all-reduce"),
    (["%f = f32[8]{0} fusion(%x, %ar), kind=kLoop, calls=%fused"], "all-reduce"),
    ([], "all-reduce"),
])
def test_cpu_reduce_scatter_pattern(users, kind):
    text = module("%x = f32[64]{0} parameter(0)", "%o = s32[] parameter(1)",
                  f"%ar = f32[64]{{0}} all-reduce(%x), {ALL}, to_apply=%add", *users, extra=FUSED)
    assert collective_stats(text) == {kind: stat(1, 256)}


def test_instruction_broken_over_lines():
    text = module("%input = f32[8,256]{1,0} parameter(0)",
                  "%ag-start = (f32[8,256]{1,0}, f32[16,256]{1,0}) all-gather-start(",
                  "    f32[8,256]{1,0} %input), replica_groups={{0,1}},",
                  "    dimensions={0}",
                  "ROOT %ag-done = f32[16,256]{1,0} all-gather-done(",
                  "    (f32[8,256]{1,0}, f32[16,256]{1,0}) %ag-start)")
    mod = parse_module(text)
    assert [i.opcode for i in mod.comps[mod.entry]][-2:] == ["all-gather-start", "all-gather-done"]
    assert collective_stats(text) == {"all-gather": stat(1, 16 * 256 * F32)}


def test_kinds_are_the_public_five():
    assert KINDS == ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                     "collective-permute")


# ---- estimate_time -----------------------------------------------------------------------------

FAST, SLOW = Link("fast", 100e9, 2e-6), Link("slow", 10e9, 20e-6)
# Flop-bound (memory bandwidth out of reach); two nodes of 4 devices: a mesh's outer axis of size
# 2 crosses them (SLOW), its inner axis of size 4 stays inside one (FAST).
PROFILE = HardwareProfile("test", peak_flops=1e12, memory_bytes=1e9, memory_bandwidth=1e30,
                          intra=FAST, inter=SLOW, nodes=2)


def _all_reduce_s(nbytes, n, link):
    """A switch all-reduce by hand: twice (n-1)/n of the bytes, log2(n) latencies."""
    return 2 * (n - 1) / n * nbytes / link.bandwidth + np.log2(n) * link.latency


def test_estimate_time_data_parallel_gradient():
    # x split on the batch, w replicated: the gradient is a partial sum, one all-reduce of w.
    m = mesh((2, 4), ("a", "b"))
    grad = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w)))
    c = compiled(grad, (P(), P(("a", "b"))), P(), (32, 64), (128, 32), m=m)
    t = estimate_time(c, m, PROFILE)
    w_bytes = 32 * 64 * F32
    assert t["collectives"] == {"all-reduce": {"count": 1, "bytes": w_bytes,
                                               "seconds": pytest.approx(
                                                   _all_reduce_s(w_bytes, 8, SLOW))}}
    assert t["compute_s"] == pytest.approx(flops(c) / 1e12) and t["flops"] == flops(c) > 0
    assert t["total_s"] == pytest.approx(flops(c) / 1e12 + _all_reduce_s(w_bytes, 8, SLOW))
    assert t["comm_bytes"] == w_bytes and t["notes"] == []


def test_estimate_time_compute_follows_the_profiles_compute_time():
    m = mesh((2, 4), ("a", "b"))
    c = compiled(lambda x: jnp.tanh(x) * 2.0, P("a"), P("a"), (256, 512), m=m)
    slow_memory = dataclasses.replace(PROFILE, memory_bandwidth=1e6)
    by_flops = estimate_time(c, m, slow_memory)
    assert by_flops["compute_s"] == pytest.approx(by_flops["flop_s"])
    assert by_flops["memory_s"] > 100 * by_flops["flop_s"] > 0  # reported, not added
    roofline = estimate_time(c, m, dataclasses.replace(slow_memory, compute_time="roofline"))
    assert roofline["compute_s"] == pytest.approx(by_flops["memory_s"])
    assert roofline["total_s"] == pytest.approx(roofline["compute_s"] + roofline["comm_s"])


@pytest.mark.parametrize("axis,n,link", [("a", 2, SLOW), ("b", 4, FAST)])
def test_estimate_time_prices_the_axis_a_group_spans(axis, n, link):
    m = mesh((2, 4), ("a", "b"))
    c = compiled(lambda x, w: x @ w, (P(None, axis), P(axis, None)), P(), (16, 32), (32, 64),
                 m=m)
    (op,) = collective_ops(c)
    assert op.kind == "all-reduce" and len(op.groups) == 8 // n
    t = estimate_time(c, MeshInfo.of(m), PROFILE)
    assert t["comm_s"] == pytest.approx(_all_reduce_s(16 * 64 * F32, n, link))


def test_estimate_time_unsharded_program_has_no_communication():
    c = compiled(lambda x, w: x @ w, (P(), P()), P(), (16, 32), (32, 64))
    t = estimate_time(c, mesh(), "h100-nvlink")
    assert t["comm_s"] == 0 and t["collectives"] == {} and t["comm_bytes"] == 0
    assert t["total_s"] == t["compute_s"] == t["flop_s"] > 0 and t["memory_s"] > 0


def test_estimate_time_counts_loop_collectives_and_notes_loop_compute():
    c = compiled(LOOPS["fori"], (P("d"), P()), P(), (64, 16), (16,))
    t = estimate_time(c, mesh(), PROFILE)
    assert t["collectives"]["all-reduce"]["count"] == 5
    assert t["comm_s"] == pytest.approx(5 * _all_reduce_s(16 * F32, 8, SLOW))
    assert any("while body once" in note for note in t["notes"])


def test_estimate_time_partial_and_permute_groups_from_text():
    info = MeshInfo(("a", "b"), (2, 4))
    text = module("%x = f32[64]{0} parameter(0)",
                  # {0,4}: the whole of axis a; {0,2}: half of axis b (a strided subset).
                  "%ar = f32[64]{0} all-reduce(%x), replica_groups={{0,4},{1,5},{2,6},{3,7}}, "
                  "to_apply=%add",
                  "%ar2 = f32[64]{0} all-reduce(%x), replica_groups={{0,2},{1,3},{4,6},{5,7}}, "
                  "to_apply=%add",
                  "%cp = f32[64]{0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}")
    ops = collective_ops(text)
    assert [(o.kind, o.groups[0] if o.groups else o.pairs) for o in ops] == [
        ("all-reduce", (0, 4)), ("all-reduce", (0, 2)), ("collective-permute", ((0, 1), (1, 0)))]
    t = estimate_time(text, info, PROFILE)
    want = (_all_reduce_s(256, 2, SLOW) + _all_reduce_s(256, 2, FAST)
            + 256 / FAST.bandwidth + FAST.latency)
    assert t["comm_s"] == pytest.approx(want) and t["compute_s"] == 0
    assert any("no cost analysis" in note for note in t["notes"])


def test_library_gemm_flops_are_counted():
    # On a GPU, XLA hands large dots to cuBLAS as custom calls that its cost analysis leaves
    # out (0.185 of a GPT step's 3.1 TFLOP on an H100); flops and estimate_time add them from
    # the HLO. The line is as XLA wrote it there, its backend_config cut short.
    text = module(
        "%x = f32[8192,1024]{1,0} parameter(0)",
        "%w = f32[1024,3072]{1,0} parameter(1)",
        "%mm = (f32[8192,3072]{1,0}, s8[33554432]{0}) custom-call(%x, %w), "
        'custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":'
        '{"alpha_real":1,"dot_dimension_numbers":{"lhs_batch_dimensions":[],'
        '"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],'
        '"rhs_contracting_dimensions":["0"]},"epilogue":"DEFAULT"}}',
        '%other = f32[16]{0} custom-call(%x), custom_call_target="Sharding"', partitions=1)
    want = 2.0 * 8192 * 3072 * 1024
    assert library_gemm_flops(parse_module(text)) == want
    t = estimate_time(text, MeshInfo(("d",), (1,)), PROFILE)
    assert t["flops"] == want and t["flop_s"] == pytest.approx(want / PROFILE.peak_flops)
    assert any("cuBLAS" in note for note in t["notes"])


def test_estimate_time_refuses_another_mesh():
    c = compiled(lambda x, w: x @ w, (P(None, "d"), P("d", None)), P(), (16, 32), (32, 64))
    with pytest.raises(ValueError, match="8 devices"):
        estimate_time(c, MeshInfo(("a",), (4,)), PROFILE)


def test_combined_gradient_all_reduce_splits_into_reduce_scatter_and_all_reduce():
    # FSDP-style step: XLA combines the weight and bias gradients (each then sliced to the
    # device's shard) and the loss (used whole) into one tuple all-reduce.
    def step(w, b, x):
        loss, (gw, gb) = jax.value_and_grad(
            lambda w, b: jnp.sum(jnp.tanh(x @ w + b)), argnums=(0, 1))(w, b)
        return w - 0.1 * gw, b - 0.1 * gb, loss

    m = mesh()
    shard = (NamedSharding(m, P("d")), NamedSharding(m, P("d")), NamedSharding(m, P("d")))
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((32, 64), (64,), (128, 32))]
    c = jax.jit(step, in_shardings=shard, out_shardings=shard[:2] + (NamedSharding(m, P()),)
                ).lower(*args).compile()
    assert any(") all-reduce(" in ln for ln in c.as_text().splitlines()), "no tuple all-reduce"
    stats = collective_stats(c)
    assert stats["reduce-scatter"] == stat(1, (32 * 64 + 64) * F32)
    assert stats["all-reduce"] == stat(1, F32)


@pytest.mark.parametrize("uses,want", [
    (["%n = f32[64]{0} negate(%g1)"],
     {"all-reduce": stat(1, 64 * F32), "reduce-scatter": stat(1, 16 * F32)}),
    ([], {"all-reduce": stat(1, 64 * F32), "reduce-scatter": stat(1, 16 * F32)}),  # g1 unused
    (["%s1 = f32[8]{0} dynamic-slice(%g1, %o), dynamic_slice_sizes={8}"],
     {"reduce-scatter": stat(1, 80 * F32)}),
    (["%n = f32[1]{0} negate(%ar)"], {"all-reduce": stat(1, 80 * F32)}),  # the tuple used whole
])
def test_tuple_all_reduce_split_by_element(uses, want):
    text = module("%x = f32[16]{0} parameter(0)", "%y = f32[64]{0} parameter(1)",
                  "%o = s32[] parameter(2)",
                  f"%ar = (f32[16]{{0}}, f32[64]{{0}}) all-reduce(%x, %y), {ALL}, to_apply=%add",
                  "%g0 = f32[16]{0} get-tuple-element(%ar), index=0",
                  "%g1 = f32[64]{0} get-tuple-element(%ar), index=1",
                  "%s0 = f32[2]{0} dynamic-slice(%g0, %o), dynamic_slice_sizes={2}", *uses)
    assert collective_stats(text) == want
