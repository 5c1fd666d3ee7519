"""Shared checks for sharding rules: run every candidate of one op on 8 CPU devices.

`check_rule(fn, args, primitive_name)` traces fn, takes the first op of that primitive, and for
every strategy `candidates()` lists: runs the op alone under `jax.jit` with the strategy's input
shardings and its output constrained to the strategy's output specs (ops in registry.LOCAL bound
per shard, as the lowering binds them), compares values (and, where `grad=True`, the gradient
of a weighted sum of the outputs) with unsharded `jax.jit`, and checks
that the compiled program communicates exactly when the strategy says it must (partial results)
or reshards. Returns the strategies it checked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxpar.analysis import collective_stats
from jaxpar.ir import build_graph, trace
from jaxpar.lower.jit import bind_local
from jaxpar.mesh import make_mesh
from jaxpar.rules import OpInfo, candidates
from jaxpar.rules.registry import is_local
from jaxpar.spec import MeshInfo


def find_op(graph, name: str):
    for _, op in graph.walk():
        if op.name == name:
            return op
    raise AssertionError(f"no {name} op in the traced program")


def _bind(op, *args):
    with op.ctx.manager:
        out = op.primitive.bind(*args, **op.primitive.get_bind_params(op.params))
    return out if op.primitive.multiple_results else [out]


def check_rule(fn, args, name: str, *, mesh=None, grad: bool = False, rtol: float = 1e-5,
               atol: float = 1e-5, limit: int | None = None, grad_limit: int = 6):
    """Run candidate strategies of the first `name` op of fn(*args); see module docstring.

    mesh: default (4, 2) over the 8 devices, where every candidate is run; pass
    `make_mesh(8)` with `limit` for a spread sample over three axes. Gradients are checked on a
    spread sample of `grad_limit` strategies.
    """
    mesh = mesh or make_mesh((4, 2), ("a", "b"))
    info_mesh = MeshInfo.of(mesh)
    traced = trace(fn, tuple(args))
    graph = build_graph(traced.closed_jaxpr)
    op = find_op(graph, name)
    operands = [_operand(graph, v, args, traced) for v in op.inputs]
    info = OpInfo.of(op, graph)
    strategies = candidates(info, info_mesh)
    assert strategies, f"{name}: no candidates"
    expected = [np.asarray(o) for o in jax.jit(lambda *a: _bind(op, *a))(*operands)]
    checked = strategies if limit is None else _spread(strategies, limit)
    with_grad = {id(s) for s in _spread(checked, grad_limit)} if grad else set()
    want = _unsharded_grad(op, operands) if grad else None
    for s in checked:
        _check_one(op, s, operands, expected, mesh, want if id(s) in with_grad else None,
                   rtol, atol)
    return checked


def _spread(items, k):
    if len(items) <= k:
        return items
    idx = np.linspace(0, len(items) - 1, k).round().astype(int)
    return [items[i] for i in sorted(set(idx))]


def _operand(graph, v, args, traced):
    """Concrete value for one op operand: a literal, a graph input, or a fresh random array."""
    if not isinstance(v, int):
        return jnp.asarray(v.value, v.dtype)
    flat = jax.tree_util.tree_leaves(args)
    if v in graph.inputs:
        return flat[graph.inputs.index(v)]
    info = graph.values[v]
    rng = np.random.default_rng(v)
    if np.issubdtype(info.dtype, np.floating):
        return jnp.asarray(rng.standard_normal(info.shape), info.dtype)
    if info.dtype == np.bool_:
        return jnp.asarray(rng.random(info.shape) > 0.5)
    return jnp.asarray(rng.integers(0, 4, info.shape), info.dtype)


def _check_one(op, s, operands, expected, mesh, want_grad, rtol, atol):
    in_sh = tuple(NamedSharding(mesh, spec.to_pspec()) for spec in s.ins)
    out_sh = tuple(NamedSharding(mesh, spec.to_pspec()) for spec in s.outs)

    def run(*a):
        # Ops XLA would gather whole run per shard, as the lowering binds them.
        outs = bind_local(op, list(a), s, mesh) if is_local(op.primitive) else _bind(op, *a)
        return [jax.lax.with_sharding_constraint(o, sh) for o, sh in zip(outs, out_sh, strict=True)]

    placed = [jax.device_put(x, sh) for x, sh in zip(operands, in_sh, strict=True)]
    compiled = jax.jit(run, in_shardings=in_sh, out_shardings=list(out_sh)).lower(*placed).compile()
    got = compiled(*placed)
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(np.asarray(g), e, rtol=rtol, atol=atol,
                                   err_msg=f"{op.name} strategy {s.label()}")
    stats = collective_stats(compiled)
    if any(s.partial):
        assert stats, f"{op.name} {s.label()}: partial result but no collective in the program"
    else:
        assert not stats, f"{op.name} {s.label()}: rule promises no communication, got {stats}"
    if want_grad is not None:
        _check_grad(run, operands, placed, in_sh, s, op, want_grad)


def _weighted_loss(run):
    def loss(*a):
        return sum(jnp.sum(o * jnp.cos(jnp.arange(o.size).reshape(o.shape)))
                   for o in run(*a) if jnp.issubdtype(o.dtype, jnp.floating))
    return loss


def _diff_args(operands) -> list[int]:
    return [i for i, x in enumerate(operands) if jnp.issubdtype(x.dtype, jnp.floating)]


def _unsharded_grad(op, operands):
    """Gradient of a weighted sum of the op's float results, unsharded (None: nothing to
    differentiate, e.g. argmax's integer result)."""
    def run(*a):
        return _bind(op, *a)

    diff = _diff_args(operands)
    outs = jax.eval_shape(run, *operands)
    if not diff or not any(jnp.issubdtype(o.dtype, jnp.floating) for o in outs):
        return None
    return jax.jit(jax.grad(_weighted_loss(run), argnums=diff))(*operands)


def _check_grad(run, operands, placed, in_sh, s, op, want):
    got = jax.jit(jax.grad(_weighted_loss(run), argnums=_diff_args(operands)),
                  in_shardings=in_sh)(*placed)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4,
                                   err_msg=f"grad of {op.name} strategy {s.label()}")
