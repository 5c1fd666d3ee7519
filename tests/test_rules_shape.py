"""Shape and layout rules: every candidate against unsharded jax.jit, and what each may cut."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src.lax import lax as lax_internal
from rule_harness import check_rule

from jaxpar.mesh import make_mesh
from jaxpar.rules import has_rule

RNG = np.random.default_rng(0)


def arr(*shape):
    return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def cut(spec, d):
    return bool(spec.dims[d])


def check_grad(fn, args, name, **kw):
    """check_rule with gradients; the gradient of a layout op is another layout op (its
    transpose), so a small sample of strategies suffices."""
    return check_rule(fn, args, name, grad=True, grad_limit=3, **kw)


@pytest.mark.parametrize("fn,shape,new_dims", [
    (lambda x: jnp.expand_dims(x, 1), (4, 8), [1]),
    (lambda x: x[None], (4, 8), [0]),
    (lambda x: lax.broadcast_in_dim(x, (2, 4, 8), (1, 2)), (4, 8), [0]),
    (lambda x: lax.broadcast_in_dim(x, (8, 4, 2), (0, 1)), (8, 1), [1, 2]),
    (lambda x: lax.broadcast_in_dim(x, (8, 4), ()), (), [0, 1]),
])
def test_broadcast_in_dim(fn, shape, new_dims):
    checked = check_grad(fn, (arr(*shape),), "broadcast_in_dim")
    # an operand dim is cut only with the result dim it maps to, never when it is broadcast
    assert all(not any(s.ins[0].dims[d] for d in range(len(shape)) if shape[d] == 1)
               for s in checked)
    out_shape = jax.eval_shape(fn, arr(*shape)).shape
    wide = [d for d in new_dims if out_shape[d] > 1]
    assert all(any(cut(s.outs[0], d) for s in checked) for d in wide), "new dims must be cut"


@pytest.mark.parametrize("src,dst,heads", [
    ((4, 8), (32,), [(0, 0)]),            # merge
    ((32,), (4, 8), [(0, 0)]),            # split
    ((4, 6), (8, 3), [(0, 0)]),           # regroup, 4 ways at most
    ((6, 4), (4, 6), [(0, 0)]),           # regroup, 2 ways at most
    ((2, 12), (24,), [(0, 0)]),           # dim 1 is not majormost: never cut
    ((4, 8), (4, 1, 2, 4), [(0, 0), (1, 2)]),  # size-1 dim inserted, second group split
    ((8, 1, 4), (8, 4), [(0, 0), (2, 1)]),     # size-1 dim dropped
])
def test_reshape(src, dst, heads):
    checked = check_grad(lambda x: x.reshape(dst), (arr(*src),), "reshape")
    head_ins = {i for i, _ in heads}
    head_outs = {j for _, j in heads}
    for s in checked:
        assert not any(cut(s.ins[0], d) for d in range(len(src)) if d not in head_ins)
        assert not any(cut(s.outs[0], d) for d in range(len(dst)) if d not in head_outs)
        assert all(s.ins[0].dims[i] == s.outs[0].dims[j] for i, j in heads)
    assert all(any(cut(s.ins[0], i) for s in checked) for i in head_ins)


def test_reshape_with_dimensions():
    # dimensions=(1, 0) reads the (4, 6) operand transposed: the head of (6, 4) -> (24,) is dim 1
    def fn(x):
        return lax.reshape(x, (24,), dimensions=(1, 0))
    checked = check_grad(fn, (arr(4, 6),), "reshape")
    assert all(not cut(s.ins[0], 0) and s.ins[0].dims[1] == s.outs[0].dims[0] for s in checked)
    assert {s.ins[0].dims[1] for s in checked} == {(), ("b",)}


def test_reshape_regroup_cut_sizes():
    checked = check_rule(lambda x: x.reshape(8, 3), (arr(4, 6),), "reshape")
    # the heads are cut at most gcd(4, 8) = 4 ways: by a or by b, never by a+b
    assert {s.ins[0].dims[0] for s in checked} == {(), ("a",), ("b",)}
    checked = check_rule(lambda x: x.reshape(4, 6), (arr(6, 4),), "reshape")
    assert {s.ins[0].dims[0] for s in checked} == {(), ("b",)}


def test_transpose():
    checked = check_grad(lambda x: x.transpose(2, 0, 1), (arr(8, 4, 2),), "transpose")
    assert all(s.outs[0].dims == tuple(s.ins[0].dims[p] for p in (2, 0, 1)) for s in checked)
    # result (2, 8, 4) on mesh (a4, b2): a on none/dim 1/dim 2 times b on none or any dim,
    # less a+b on the size-4 dim
    assert len(checked) == 11


@pytest.mark.parametrize("shape,dims", [((4, 1, 8), (1,)), ((1, 8, 1), (0, 2))])
def test_squeeze(shape, dims):
    checked = check_grad(lambda x: lax.squeeze(x, dims), (arr(*shape),), "squeeze")
    kept = [d for d in range(len(shape)) if d not in dims]
    assert all(s.outs[0].dims == tuple(s.ins[0].dims[d] for d in kept) for s in checked)
    assert any(any(s.outs[0].dims) for s in checked)


@pytest.mark.parametrize("shapes,axis", [
    ([(8, 4), (8, 4)], 1),
    ([(2, 8), (4, 8), (2, 8)], 0),
])
def test_concatenate(shapes, axis):
    def fn(*xs):
        return jnp.concatenate(xs, axis)
    args = tuple(arr(*s) for s in shapes)
    checked = check_grad(fn, args, "concatenate")
    assert all(not cut(s.outs[0], axis) for s in checked)
    assert all(len({x.dims for x in s.ins}) == 1 for s in checked), "operands cut alike"
    assert any(any(s.outs[0].dims) for s in checked)


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_stack(axis):
    # jax 0.10's jnp.stack is one `stack` primitive: it ran replicated before this rule.
    checked = check_grad(lambda a, b: jnp.stack([a, b], axis), (arr(8, 4), arr(8, 4)), "stack")
    old = [d for d in range(3) if d != axis]
    for s in checked:
        assert len({x.dims for x in s.ins}) == 1, "operands cut alike"
        assert [s.outs[0].dims[d] for d in old] == list(s.ins[0].dims)
    assert not any(cut(s.outs[0], axis) for s in checked), "the partitioner all-to-alls it"
    assert all(any(cut(s.ins[0], d) for s in checked) for d in range(2))


@pytest.mark.parametrize("axis", [0, 1])
def test_unstack(axis):
    checked = check_grad(lambda x: jnp.unstack(x, axis=axis), (arr(4, 4, 8),), "unstack")
    assert all(not cut(s.ins[0], axis) for s in checked)
    kept = [d for d in range(3) if d != axis]
    for s in checked:
        assert all(o.dims == tuple(s.ins[0].dims[d] for d in kept) for o in s.outs)
    assert all(any(cut(s.ins[0], d) for s in checked) for d in kept)


@pytest.mark.parametrize("config,kept", [
    (((0, 0, 0), (1, 2, 0)), [0]),
    (((0, 0, 1), (0, 0, 0)), [1]),
    (((-2, 2, 0), (0, 0, 0)), [1]),
    (((0, 0, 0), (0, 0, 0)), [0, 1]),
])
def test_pad(config, kept):
    def fn(x):
        return lax.pad(x, 0.5, config)
    checked = check_grad(fn, (arr(8, 4),), "pad")
    assert all(not cut(s.outs[0], d) for s in checked for d in (0, 1) if d not in kept)
    assert all(any(cut(s.outs[0], d) for s in checked) for d in kept)
    assert all(s.ins[1].rank == 0 for s in checked)


@pytest.mark.parametrize("index,kept", [
    ((slice(2, 6),), [1]),
    ((slice(None), slice(None, None, 2)), [0]),
    ((slice(None), slice(0, 4)), [0, 1]),
    ((slice(1, 3), slice(0, 2)), []),
])
def test_slice(index, kept):
    def fn(x):
        return x[index]
    checked = check_grad(fn, (arr(8, 8),), "slice")
    assert all(not cut(s.ins[0], d) for s in checked for d in (0, 1) if d not in kept)
    assert all(s.ins[0].dims == s.outs[0].dims for s in checked)
    if not kept:
        assert len(checked) == 1, "a slice of every dim is only replicated"


@pytest.mark.parametrize("sizes,axis", [((3, 3), 1), ((2, 6), 0)])
def test_split(sizes, axis):
    def fn(x):
        return lax.split(x, sizes, axis)
    checked = check_grad(fn, (arr(8, 6),), "split")
    assert all(not cut(s.ins[0], axis) for s in checked)
    assert all(o.dims == s.ins[0].dims for s in checked for o in s.outs)
    assert any(any(s.ins[0].dims) for s in checked)


@pytest.mark.parametrize("dtype,dim", [(jnp.float32, 1), (jnp.int32, 0)])
def test_iota(dtype, dim):
    def fn(x):
        return x + lax.broadcasted_iota(dtype, (8, 4), dim)
    checked = check_rule(fn, (jnp.zeros((8, 4), dtype),), "iota")
    assert all(not s.ins for s in checked)
    assert len(checked) == 8, "every placement of a, b over (8, 4)"


@pytest.mark.parametrize("dims", [(0,), (1,), (0, 1)])
def test_rev(dims):
    checked = check_grad(lambda x: jnp.flip(x, dims), (arr(8, 4),), "rev")
    assert all(not cut(s.ins[0], d) for s in checked for d in dims)
    assert all(s.ins[0].dims == s.outs[0].dims for s in checked)


@pytest.mark.parametrize("reps", [(2, 1), (1, 4)])
def test_tile(reps):
    checked = check_grad(lambda x: jnp.tile(x, reps), (arr(4, 8),), "tile")
    tiled = reps.index(max(reps))
    assert all(not cut(s.ins[0], tiled) for s in checked), "a tiled operand dim stays whole"
    assert any(cut(s.outs[0], tiled) for s in checked)


@pytest.mark.parametrize("shape,dtype", [
    ((8, 4), jnp.int32), ((8, 4), jnp.int16), ((8, 4, 2), jnp.float32)])
def test_bitcast_convert_type(shape, dtype):
    x = arr(*shape) if len(shape) == 2 else jnp.asarray(RNG.integers(0, 99, shape), jnp.int16)
    def fn(x):
        return lax.bitcast_convert_type(x, dtype)
    checked = check_rule(fn, (x,), "bitcast_convert_type")
    assert all(not cut(s.ins[0], 2) for s in checked if len(shape) == 3)
    assert any(cut(s.ins[0], 1) for s in checked)


def test_device_put():
    checked = check_grad(lambda x: jax.device_put(x), (arr(8, 4),), "device_put")
    assert all(s.ins[0].dims == s.outs[0].dims for s in checked)
    assert len(checked) == 8, "every placement of a, b over (8, 4)"


def test_optimization_barrier():
    def fn(x, y):
        return lax.optimization_barrier((x, y))
    args = (arr(8, 4), arr(4,))
    checked = check_grad(fn, args, "optimization_barrier", limit=12)
    assert all(i.dims == o.dims for s in checked for i, o in zip(s.ins, s.outs, strict=True))


def test_checkpoint_name():
    # checkpoint_name tags a value for remat policies; it had no rule, so the tagged value was
    # gathered whole (a data parallel matmul's result, in every mode).
    from jax.ad_checkpoint import checkpoint_name

    import jaxpar

    checked = check_grad(lambda x: checkpoint_name(x, "h"), (arr(8, 4),), "name")
    assert all(s.ins[0].dims == s.outs[0].dims for s in checked)
    x, w = arr(64, 32), arr(32, 32)

    def f(x, w):
        return jnp.sum(jnp.tanh(checkpoint_name(x @ w, "h")) @ w)
    sharded = jaxpar.shard(f, in_strategy=((8, 1), None))
    # the loss's sum is the only collective: no gather of the tagged value
    assert set(jaxpar.collective_stats(sharded.lower(x, w).compile())) == {"all-reduce"}
    policy = jax.checkpoint_policies.save_only_these_names("h")
    grad = jax.grad(jax.checkpoint(f, policy=policy), argnums=1)
    # Sums reordered: each entry sums 64 rows' terms, the largest entries near 50, so an entry
    # near 0 may be 2e-5 off in float32 (seen in a CI run): atol 1e-4, 5e-6 of the largest.
    want = grad(x, w)
    assert float(jnp.abs(want).max()) > 1.0
    np.testing.assert_allclose(jaxpar.shard(grad, in_strategy=((8, 1), None))(x, w), want,
                               rtol=1e-4, atol=1e-4)


MESH8 = [
    ("broadcast_in_dim", lambda x: lax.broadcast_in_dim(x, (2, 4, 8), (1, 2)), (arr(4, 8),)),
    ("reshape", lambda x: x.reshape(8, 6), (arr(4, 12),)),
    ("transpose", lambda x: x.T, (arr(8, 4),)),
    ("squeeze", lambda x: x[:, 0], (arr(8, 1),)),
    ("concatenate", lambda x, y: jnp.concatenate([x, y], 1), (arr(8, 4), arr(8, 2))),
    ("pad", lambda x: jnp.pad(x, ((0, 0), (1, 1))), (arr(8, 4),)),
    ("slice", lambda x: x[:, 1:5], (arr(8, 8),)),
    ("split", lambda x: jnp.split(x, 2, 1), (arr(8, 4),)),
    ("iota", lambda x: x + lax.broadcasted_iota(jnp.int32, (8, 4), 0), (jnp.zeros((8, 4), int),)),
    ("rev", lambda x: x[:, ::-1], (arr(8, 4),)),
    ("tile", lambda x: jnp.tile(x, (4, 1)), (arr(2, 8),)),
    ("bitcast_convert_type", lambda x: lax.bitcast_convert_type(x, jnp.int32), (arr(8, 4),)),
    ("device_put", jax.device_put, (arr(8, 4),)),
    ("optimization_barrier", lambda x: lax.optimization_barrier(x), (arr(8, 4),)),
    ("stack", lambda x, y: jnp.stack([x, y], 1), (arr(8, 4), arr(8, 4))),
    ("unstack", lambda x: jnp.unstack(x, axis=1), (arr(8, 2, 4),)),
]


@pytest.mark.parametrize("name,fn,args", MESH8, ids=[m[0] for m in MESH8])
def test_mesh8(name, fn, args):
    """The 3-axis mesh (2, 2, 2), on a spread sample of candidates."""
    checked = check_rule(fn, args, name, mesh=make_mesh(8), limit=8)
    assert any(any(o.dims) for s in checked for o in s.outs)


def test_every_family_member_has_a_rule():
    prims = [getattr(lax, f"{name}_p", None) or getattr(lax_internal, f"{name}_p")
             for name, _, _ in MESH8]
    missing = [name for (name, _, _), p in zip(MESH8, prims, strict=True) if not has_rule(p)]
    assert not missing, f"no rule registered for {missing}"
