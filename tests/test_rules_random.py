"""Random-number rules: every candidate must give the same bits as unsharded jax.jit, with no
communication.

rule_harness.check_rule compares results with np.asarray, which key arrays refuse, so ops with key
*results* (random_wrap, random_split, random_fold_in, ...) go through `check_key_rule` below: the
same check on the op found in the plain jaxpr, comparing `key_data`. random_bits (key in, bits
out) also runs through check_rule, and whole random programs through jaxpar.shard.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.random import prng
from jax.extend import core as jcore
from jax.extend import random as jex_random
from jax.sharding import NamedSharding
from rule_harness import check_rule

import jaxpar
from jaxpar.analysis import collective_stats
from jaxpar.mesh import make_mesh
from jaxpar.rules import OpInfo, candidates
from jaxpar.spec import MeshInfo

KEY = jax.random.key(0)
KEYS = jax.random.split(KEY, 8)
RAW_KEY = jax.random.PRNGKey(0)


def _find(jaxpr, consts, args, name):
    """(eqn, operand values) of the first `name` eqn, looking inside jit calls; eqns before it
    are evaluated so operands need not be function inputs."""
    env = dict(zip([*jaxpr.constvars, *jaxpr.invars], [*consts, *args], strict=True))
    for eqn in jaxpr.eqns:
        ins = [v.val if isinstance(v, jcore.Literal) else env[v] for v in eqn.invars]
        if eqn.primitive.name == name:
            return eqn, ins
        body = eqn.params.get("jaxpr")
        found = body is not None and _find(body.jaxpr, body.consts, ins, name)
        if found:
            return found
        outs = eqn.primitive.bind(*ins, **eqn.params)
        env.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else [outs],
                       strict=True))
    return None


def _bits(x):
    return np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                      else x)


def check_key_rule(fn, args, name, *, mesh=None, limit=None):
    """check_rule for ops with key operands or results: every candidate of the first `name` op
    gives the same bits as unsharded and compiles without collectives."""
    mesh = mesh or make_mesh((4, 2), ("a", "b"))
    closed = jax.make_jaxpr(fn)(*args)
    eqn, operands = _find(closed.jaxpr, closed.consts, args, name)
    ins, outs = [v.aval for v in eqn.invars], [v.aval for v in eqn.outvars]
    info = OpInfo(eqn.primitive, eqn.params, tuple(a.shape for a in ins),
                  tuple(a.shape for a in outs), tuple(a.dtype for a in ins),
                  tuple(a.dtype for a in outs))

    def bind(*a):
        out = eqn.primitive.bind(*a, **eqn.params)
        return out if eqn.primitive.multiple_results else [out]

    expected = [_bits(o) for o in jax.jit(bind)(*operands)]
    strategies = candidates(info, MeshInfo.of(mesh))
    checked = strategies if limit is None else strategies[::max(1, len(strategies) // limit)]
    for s in checked:
        in_sh = [NamedSharding(mesh, spec.to_pspec()) for spec in s.ins]
        out_sh = [NamedSharding(mesh, spec.to_pspec()) for spec in s.outs]
        placed = [jax.device_put(x, sh) for x, sh in zip(operands, in_sh, strict=True)]
        compiled = jax.jit(bind, in_shardings=in_sh, out_shardings=out_sh).lower(*placed).compile()
        for got, want in zip(compiled(*placed), expected, strict=True):
            np.testing.assert_array_equal(_bits(got), want, err_msg=f"{name} {s.label()}")
        assert not collective_stats(compiled), f"{name} {s.label()}: {collective_stats(compiled)}"
    return checked


SAMPLERS = {
    "normal": lambda k: jax.random.normal(k, (8, 16)),
    "uniform": lambda k: jax.random.uniform(k, (8, 16)),
    "bernoulli": lambda k: jax.random.bernoulli(k, 0.5, (8, 16)),
}


@pytest.mark.parametrize("sampler,key", [("normal", KEY), ("normal", RAW_KEY),
                                         ("uniform", KEY), ("bernoulli", KEY)])
def test_random_bits(sampler, key):
    checked = check_key_rule(SAMPLERS[sampler], (key,), "random_bits")
    # the key stays whole; each result dim can be cut, and both at once
    assert all(s.ins[0].rank == 0 for s in checked)
    assert any(s.outs[0].dims[0] and s.outs[0].dims[1] for s in checked)
    assert len(checked) == 9


def test_random_bits_batched_keys():
    checked = check_key_rule(jax.vmap(SAMPLERS["normal"]), (KEYS,), "random_bits", limit=6)
    assert all(s.ins[0].dims[0] == s.outs[0].dims[0] for s in checked)
    assert any(s.outs[0].dims[2] for s in checked)


def test_random_bits_not_partitionable():
    # the original threefry hashes one flat counter: cutting the result dims needs communication
    with jax.threefry_partitionable(False):
        checked = check_key_rule(jax.vmap(SAMPLERS["normal"]), (KEYS,), "random_bits")
    assert not any(s.outs[0].dims[1] or s.outs[0].dims[2] for s in checked)
    assert any(s.outs[0].dims[0] for s in checked)


def test_random_bits_other_impl_keeps_result_dims_whole():
    checked = check_key_rule(SAMPLERS["uniform"], (jax.random.key(0, impl="rbg"),),
                             "random_bits")
    assert len(checked) == 1


@pytest.mark.parametrize("fn,args,new_dims", [
    (lambda k: jax.random.split(k, 8), (KEY,), [0]),
    (lambda k: jax.random.split(k, (4, 2)), (KEY,), [0, 1]),
    (jax.vmap(lambda k: jax.random.split(k, 4)), (KEYS,), [1]),
    (lambda k: jax.random.split(k, 8), (RAW_KEY,), [0]),
])
def test_random_split(fn, args, new_dims):
    checked = check_key_rule(fn, args, "random_split")
    assert all(any(s.outs[0].dims[d] for s in checked) for d in new_dims)


@pytest.mark.parametrize("fn,args", [
    (lambda k: jax.random.fold_in(k, 3), (KEY,)),
    (jax.vmap(jax.random.fold_in), (KEYS, jnp.arange(8, dtype=jnp.uint32))),
])
def test_random_fold_in(fn, args):
    checked = check_key_rule(fn, args, "random_fold_in")
    assert all(s.ins[0] == s.outs[0] for s in checked)


@pytest.mark.parametrize("name,fn,args,count", [
    ("random_wrap", jax.random.wrap_key_data, (jax.random.key_data(KEYS),), 4),
    ("random_wrap", SAMPLERS["normal"], (RAW_KEY,), 1),
    ("random_unwrap", jax.random.key_data, (KEYS,), 4),
    ("random_unwrap", lambda k: jax.random.split(k, 8), (RAW_KEY,), 4),
    ("random_seed", jax.vmap(jax.random.key), (jnp.arange(8),), 4),
    ("random_seed", jax.vmap(jax.random.PRNGKey), (jnp.arange(8),), 4),
    ("random_clone", jax.random.clone, (KEYS,), 4),
])
def test_key_batch_ops(name, fn, args, count):
    checked = check_key_rule(fn, args, name)
    # batch dims are cut together; the trailing key-data dim of a uint32 key array never is
    for s in checked:
        assert all(not spec.dims[-1] for spec in (*s.ins, *s.outs) if spec.rank == 2), s.label()
    assert len(checked) == count


def _threefry(key_data):
    """What random_bits lowers to for a threefry key: hash the (8, 16) counter grid."""
    hi, lo = prng.iota_2x32_shape((8, 16))
    return jex_random.threefry2x32_p.bind(key_data[0], key_data[1], hi, lo)


@pytest.mark.parametrize("name", ["threefry2x32", "iota_2x32_shape"])
def test_threefry_primitives(name):
    args = (jax.random.key_data(KEY),)
    checked = check_rule(_threefry, args, name)
    check_rule(_threefry, args, name, mesh=make_mesh(8), limit=8)
    assert len(checked) == 9
    assert all(s.outs[0] == s.outs[1] for s in checked)


@pytest.mark.parametrize("name,fn,args", [
    ("random_bits", SAMPLERS["normal"], (KEY,)),
    ("random_split", lambda k: jax.random.split(k, (4, 2)), (KEY,)),
    ("random_fold_in", jax.vmap(jax.random.fold_in), (KEYS, jnp.arange(8, dtype=jnp.uint32))),
    ("random_wrap", jax.random.wrap_key_data, (jax.random.key_data(KEYS),)),
    ("random_unwrap", jax.random.key_data, (KEYS,)),
    ("random_seed", jax.vmap(jax.random.key), (jnp.arange(8),)),
    ("random_clone", jax.random.clone, (KEYS,)),
])
def test_three_axis_mesh(name, fn, args):
    assert check_key_rule(fn, args, name, mesh=make_mesh(8), limit=8)


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_random_bits_through_graph(sampler):
    checked = check_rule(SAMPLERS[sampler], (KEY,), "random_bits")
    assert any(s.outs[0].axes() for s in checked)


@pytest.mark.parametrize("key", [jax.random.PRNGKey(0), jax.random.key(1)],
                         ids=["raw-uint32", "typed"])
def test_dropout_program_through_shard_is_bit_identical(key):
    def fn(key, x):
        k1, k2 = jax.random.split(key)
        return x * jax.random.bernoulli(k1, 0.5, x.shape) + jax.random.normal(k2, x.shape)

    x = jnp.ones((16, 8))
    f = jaxpar.shard(fn, in_strategy=(None, (8, 1)))
    np.testing.assert_array_equal(np.asarray(f(key, x)), np.asarray(jax.jit(fn)(key, x)))
    bits = [r for r in f.plan(key, x).rows if r.op == "random_bits"]
    assert bits and all("d0+d1+d2" in r.chosen for r in bits)  # sampled where the data lives
