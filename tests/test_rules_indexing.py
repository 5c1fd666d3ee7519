"""Indexing rules (dynamic slices, gather, scatter family): every candidate against jax.jit.

Where jnp inserts index arithmetic before the op (`t[i]`, `jnp.take`), the harness feeds the
op's index operand values 0..3, in range for every operand here; the other cases pass the op's
indices in directly, with in-range (and, for overwriting scatters, unique) values.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from rule_harness import check_rule

from jaxpar.mesh import make_mesh

RNG = np.random.default_rng(0)


def arr(*shape):
    return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def ints(high, *shape):
    return jnp.asarray(RNG.integers(0, high, shape), jnp.int32)


def cut_dims(checked, operand):
    """The dims of operand `operand` that some checked strategy cuts."""
    return {d for s in checked for d, axes in enumerate(s.ins[operand].dims) if axes}


def sample_mesh8(fn, args, name):
    check_rule(fn, args, name, mesh=make_mesh(8), limit=8)


@pytest.mark.parametrize("traced", [True, False])
def test_dynamic_slice(traced):
    def fn(x, s):
        return lax.dynamic_slice(x, (s if traced else 3, 0, 0), (4, 8, 4))

    args = (arr(16, 8, 4), jnp.int32(5))
    checked = check_rule(fn, args, "dynamic_slice", grad=True)
    assert cut_dims(checked, 0) == {1, 2}, "dim 0 is sliced at a moving start"
    assert all(s.ins[1].rank == 0 for s in checked)
    if traced:
        sample_mesh8(fn, args, "dynamic_slice")


@pytest.mark.parametrize("traced", [True, False])
def test_dynamic_update_slice(traced):
    def fn(x, u, s):
        return lax.dynamic_update_slice(x, u, (0, s if traced else 6))

    args = (arr(8, 16), arr(8, 4), jnp.int32(9))
    checked = check_rule(fn, args, "dynamic_update_slice", grad=True)
    assert cut_dims(checked, 0) == cut_dims(checked, 1) == {0}
    assert all(s.ins[0].dims[0] == s.ins[1].dims[0] == s.outs[0].dims[0] for s in checked)
    if traced:
        sample_mesh8(fn, args, "dynamic_update_slice")


# case: (fn, args, gathered operand dim, operand dim paired with indices dim 0 or None)
GATHERS = {
    "embedding": (lambda t, i: t[i], (arr(16, 8), ints(16, 4, 8)), 0, None),
    "take": (lambda t, i: jnp.take(t, i, axis=0), (arr(16, 8), ints(16, 4, 8)), 0, None),
    "take_along_axis": (lambda x, y: jnp.take_along_axis(x, y, axis=1),
                        (arr(8, 16), ints(16, 8, 1)), 1, 0),
    "middle_dim": (lambda x, i: x[:, i], (arr(4, 16, 8), ints(16, 6)), 1, None),
    "batched": (jax.vmap(lambda t, i: t[i]), (arr(4, 16, 8), ints(16, 4, 6)), 1, 0),
}


@pytest.mark.parametrize("case", list(GATHERS))
def test_gather(case):
    fn, args, gathered, paired = GATHERS[case]
    checked = check_rule(fn, args, "gather", grad=True)
    # The gathered dim may be cut (each device looks up the rows it holds, the others
    # masked): the result is then partial over exactly those axes.
    rows = [s for s in checked if s.ins[0].dims[gathered]]
    assert rows, "the gathered operand dim is a loop (vocab-parallel lookup)"
    assert all(s.partial[0] == s.ins[0].dims[gathered] for s in checked)
    assert all(not s.ins[1].dims[-1] for s in checked), "nor the index vector dim"
    assert 0 in cut_dims(checked, 1), "index batch dims are loops"
    if paired is not None:
        assert all(s.ins[0].dims[paired] == s.ins[1].dims[0] for s in checked)
    if case == "embedding":
        sample_mesh8(fn, args, "gather")


def assert_rows_local(checked, rows: int) -> None:
    """Some strategies cut the operand's indexed `rows` (each device updates the rows it
    holds); those read the indices and updates whole on those axes, leave nothing partial on
    them, and cut the result so too (and maybe more: a partial sum reduce-scattered onto it)."""
    cut = [s for s in checked if s.ins[0].dims[rows]]
    assert cut, "the indexed operand dim is a loop"
    for s in cut:
        axes = set(s.ins[0].dims[rows])
        assert axes <= set(s.outs[0].dims[rows])
        assert not axes & (set(s.ins[1].axes()) | set(s.ins[2].axes()) | set(s.partial[0]))


def test_scatter_add_embedding_grad():
    def fn(t, i, u):
        return t.at[i].add(u)

    args = (arr(16, 8), ints(16, 8), arr(8, 8))
    checked = check_rule(fn, args, "scatter-add", grad=True)
    assert cut_dims(checked, 0) == {0, 1}
    assert_rows_local(checked, 0)
    partial = [s for s in checked if any(s.partial)]
    assert partial and all(s.ins[2].dims[0] for s in partial), "cut update rows: partial sums"
    sample_mesh8(fn, args, "scatter-add")


def test_scatter_add_from_grad_of_lookup():
    # ids (4, 8): two index batch dims, both reducible
    fn = jax.grad(lambda t, i: jnp.sum(t[i] ** 2))
    checked = check_rule(fn, GATHERS["embedding"][1], "scatter-add", limit=16)
    assert any(any(s.partial) for s in checked)


def test_scatter_add_paired_batch_dims():
    # the take_along_axis gradient: operand rows, label rows and update rows form one loop
    fn = jax.vmap(lambda x, y, u: x.at[y].add(u))
    checked = check_rule(fn, (arr(8, 16), ints(16, 8, 1), arr(8, 1)), "scatter-add", grad=True)
    assert cut_dims(checked, 0) == {0, 1}
    assert_rows_local(checked, 1)
    assert all(s.ins[0].dims[0] == s.ins[1].dims[0] == s.ins[2].dims[0] for s in checked)


ROWS = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                   scatter_dims_to_operand_dims=(0,))
# vmapped `t.at[i].set(u)`: operand, indices and updates share batch dim 0
BATCHED_ROWS = lax.ScatterDimensionNumbers(
    update_window_dims=(2,), inserted_window_dims=(1,), scatter_dims_to_operand_dims=(1,),
    operand_batching_dims=(0,), scatter_indices_batching_dims=(0,))


def unique_rows(n, high, batch=()):
    """Distinct row ids (overwrites must not collide), shaped as the op's (..., n, 1) indices."""
    rows = [RNG.permutation(high)[:n, None] for _ in range(int(np.prod(batch)))]
    return jnp.asarray(np.reshape(rows, (*batch, n, 1)), jnp.int32)


def test_scatter_sub():
    def fn(t, i, u):
        return lax.scatter_sub(t, i, u, ROWS)

    # the scatter-add rule again: a spread sample of its candidates is enough
    checked = check_rule(fn, (arr(16, 8), unique_rows(8, 16), arr(8, 8)), "scatter-sub",
                         grad=True, limit=12)
    assert any(any(s.partial) for s in checked)


@pytest.mark.parametrize("batched", [False, True])
def test_scatter_set(batched):
    # t.at[i].set(u), with unique rows passed straight to the op
    dnums, batch = (BATCHED_ROWS, (4,)) if batched else (ROWS, ())

    def fn(t, i, u):
        return lax.scatter(t, i, u, dnums, unique_indices=True)

    args = (arr(*batch, 16, 8), unique_rows(6, 16, batch), arr(*batch, 6, 8))
    checked = check_rule(fn, args, "scatter", grad=True)
    rows = len(batch)
    assert rows not in cut_dims(checked, 2), \
        "overwrites from different devices cannot be combined: update rows are never cut"
    assert rows + 1 in cut_dims(checked, 0)
    assert_rows_local(checked, rows)
    assert not any(any(s.partial) for s in checked)
    if batched:
        assert all(s.ins[0].dims[0] == s.ins[1].dims[0] == s.ins[2].dims[0] for s in checked)
    else:
        sample_mesh8(fn, args, "scatter")


@pytest.mark.parametrize("name,method", [("scatter-mul", "multiply"), ("scatter-min", "min"),
                                         ("scatter-max", "max")])
def test_scatter_combiners(name, method):
    def fn(t, i, u):
        return getattr(t.at[i], method)(u)

    args = (arr(16, 8), ints(16, 8), arr(8, 8))
    # jax differentiates scatter-mul in its updates only with unique_indices=True
    checked = check_rule(fn, args, name, grad=name != "scatter-mul")
    assert cut_dims(checked, 0) == {0, 1} and cut_dims(checked, 2) == {1}
    assert_rows_local(checked, 0)
    assert not any(any(s.partial) for s in checked)
    sample_mesh8(fn, args, name)


@pytest.mark.parametrize("out,kind", [(P("dp", None, None), "all-reduce"),
                                      (P("dp", None, "mp"), "reduce-scatter")], ids=str)
def test_a_vocab_parallel_lookup_moves_only_its_result(out, kind):
    # Megatron's vocab-parallel embedding: the table cut on its rows over mp, the ids on the
    # batch over dp. Each device looks up the rows it holds; the result is reduced over mp.
    # The table never moves, and the plan predicts what the compiled program moves.
    import jaxpar

    mesh = make_mesh((4, 2), ("dp", "mp"))
    table, ids = arr(64, 16), ints(64, 8, 4)
    # take(mode="clip"): the gather alone (t[i] adds index arithmetic for negative ids)
    f = jaxpar.shard(lambda t, i: jnp.take(t, i, axis=0, mode="clip"), mesh=mesh,
                     in_strategy=(P("mp", None), P("dp", None)), out_strategy=(out,))
    plan = f.plan(table, ids)
    check = plan.verify(f.lower(table, ids).compile())
    assert check.ok, str(check)
    # an all-reduce of every device's (8/4, 4, 16) f32 piece; sliced where out cuts mp, which
    # makes it a reduce-scatter (XLA's reduce-scatter creator; the plan predicted an
    # all-reduce: propagation.sliced_reductions)
    assert plan.collectives == {kind: {"count": 1, "bytes": 2 * 4 * 16 * 4}}
    assert check.predicted == check.measured, str(check)
    np.testing.assert_allclose(f(table, ids), table[ids], rtol=1e-6)
    # ids past the end are clipped to the last row, as unsharded
    far = ids.at[0, 0].set(99)
    np.testing.assert_allclose(f(table, far), jnp.take(table, far, axis=0, mode="clip"))
