"""The rule table: primitive -> function listing every legal strategy of one op.

A rule sees an `OpInfo` (primitive, params, operand and result shapes) and the mesh, and returns
candidate `OpStrategy`s; it never prices or chooses them. Most rules describe their op as a set
of *loops* (DTensor's einsum view): each loop indexes one dimension of some operands and results,
and a mesh axis that cuts a loop cuts those dimensions together. A loop that no result indexes is
a reduction: cutting it leaves the results partial. `candidates()` then turns each partial result
into concrete choices: an all-reduce (result replicated on the axis) or a reduce-scatter (result
cut on the axis along one of its dimensions).

Primitives without a rule get the replicated strategy only, and `has_rule()` says so, so the plan
can mark them. Primitives in `LOCAL` are bound per shard by the lowering (XLA would gather them).
Ops with the same loops over the same shapes (an add and a mul) get the same candidate lists, kept
per mesh in `MeshInfo.cache`: a deep model lists each kind of op once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxpar.spec import Axes, MeshInfo, OpStrategy, Spec


@dataclass(frozen=True)
class OpInfo:
    """What a rule sees of one op."""

    primitive: Any
    params: dict
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    in_dtypes: tuple[np.dtype, ...] = ()
    out_dtypes: tuple[np.dtype, ...] = ()

    @staticmethod
    def of(op, graph) -> OpInfo:
        """The op's info in `graph`, remembered on the op (the searches ask for it per op,
        several times over)."""
        memo = op.__dict__.get("_info")
        if memo is not None and memo[0] is graph:
            return memo[1]
        info = OpInfo(op.primitive, op.params,
                      tuple(graph.shape(v) for v in op.inputs),
                      tuple(graph.shape(v) for v in op.outputs),
                      tuple(graph.dtype(v) for v in op.inputs),
                      tuple(graph.dtype(v) for v in op.outputs))
        op.__dict__["_info"] = (graph, info)
        return info


Rule = Callable[[OpInfo, MeshInfo], list[OpStrategy]]
RULES: dict[Any, Rule] = {}
# Primitives that run only as their rule says when it gives a candidate (a shard_map in its
# own specs): no replicated candidate beside it, which would stand for a run that never happens.
EXCLUSIVE: set[Any] = set()
# Primitives XLA's SPMD partitioner runs whole even where their rule's cut needs no data from
# other devices (top_k, fft: it all-gathers the operand first), or cuts with communication the
# cut needs not (igamma: its loop all-reduces the devices' flags each turn). The lowering binds
# them per shard inside a shard_map of the chosen strategy's specs (lower/jit.py), so the cut
# runs as planned, with no communication, on every backend.
LOCAL: set[Any] = set()


@dataclass(frozen=True)
class Loop:
    """One shardable iteration dimension of an op.

    `ins[i]` / `outs[j]` is the dimension of operand i / result j this loop indexes (None when it
    does not index that array). `reducible` loops index no result: cutting them leaves every
    result partial.
    """

    size: int
    ins: tuple[int | None, ...]
    outs: tuple[int | None, ...]
    reducible: bool = False


def loop_strategies(info: OpInfo, mesh: MeshInfo, loops: Sequence[Loop],
                    scatter_dims: Sequence[int] | None = None) -> list[OpStrategy]:
    """Every assignment of mesh axes to loops (each axis to one loop or to none).

    scatter_dims: the result dims a partial result may be reduce-scattered onto (None: any),
    for ops where XLA mishandles some of them. Ops with the same loops over the same ranks get
    the same list (kept in `mesh.cache`), so callers may key further work on it.
    """
    allowed = None if scatter_dims is None else tuple(scatter_dims)
    key = ("loops", tuple(map(len, info.in_shapes)), tuple(map(len, info.out_shapes)),
           tuple(loops), allowed)
    hit = mesh.cache.get(key)
    if hit is not None:
        return hit
    for loop in loops:
        assert loop.reducible or any(d is not None for d in loop.outs), \
            f"{info.primitive}: a loop indexing no result must be reducible"
    # Every assignment whatever the loops' sizes, made once per loop structure (ops of one
    # kind over many shapes share its strategies); the sizes only choose among them.
    shapeless = ("loop cuts", *key[1:3], tuple((lp.ins, lp.outs, lp.reducible) for lp in loops),
                 allowed)
    every = mesh.cache.get(shapeless)
    if every is None:
        every = mesh.cache[shapeless] = []
        for choice in itertools.product(range(len(loops) + 1), repeat=len(mesh.names)):
            cut = [tuple(a for a, c in zip(mesh.names, choice, strict=True) if c == li)
                   for li in range(len(loops))]
            every.append((cut, _assemble(info, loops, cut, allowed)))
    strategies = [s for cut, s in every
                  if all(loop.size % mesh.group_size(axes) == 0
                         for loop, axes in zip(loops, cut, strict=True))]
    mesh.cache[key] = strategies
    return strategies


def same_dim_strategies(info: OpInfo, mesh: MeshInfo, dims: Iterable[int],
                        arrays: int = 1) -> list[OpStrategy]:
    """One loop per dim in `dims`, indexing that dim of the first `arrays` operands and of every
    result: ops that take those dims whole (slice, pad, concatenate, dynamic_slice, ...)."""
    outs = len(info.out_shapes)
    ins = len(info.in_shapes)
    loops = [Loop(info.out_shapes[0][d], tuple(d if i < arrays else None for i in range(ins)),
                  (d,) * outs) for d in dims]
    return loop_strategies(info, mesh, loops)


def _assemble(info: OpInfo, loops: Sequence[Loop], cut: list[Axes],
              scatter_dims: Sequence[int] | None) -> OpStrategy:
    def specs(shapes, side):
        dims = [[() for _ in shape] for shape in shapes]
        for loop, axes in zip(loops, cut, strict=True):
            for k, d in enumerate(getattr(loop, side)):
                if d is not None and axes:
                    dims[k][d] = dims[k][d] + axes
        return tuple(Spec(tuple(d)) for d in dims)

    partial = tuple(a for loop, axes in zip(loops, cut, strict=True) if loop.reducible
                    for a in axes)
    allowed = None if scatter_dims is None else tuple(scatter_dims)
    return OpStrategy(specs(info.in_shapes, "ins"), specs(info.out_shapes, "outs"),
                      tuple(partial for _ in info.out_shapes), scatter_dims=allowed)


def replicated(info: OpInfo) -> OpStrategy:
    return OpStrategy(tuple(Spec.replicated(len(s)) for s in info.in_shapes),
                      tuple(Spec.replicated(len(s)) for s in info.out_shapes),
                      tuple(() for _ in info.out_shapes))


def has_rule(primitive) -> bool:
    _load_families()
    return primitive in RULES


def is_local(primitive) -> bool:
    """Whether the lowering binds this primitive per shard (see LOCAL)."""
    _load_families()
    return primitive in LOCAL


def candidates(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """All concrete strategies of an op: rule candidates with partial results resolved. Ops
    whose rule gave the same list (loop_strategies) on the same shapes share the result."""
    _load_families()
    rule = RULES.get(info.primitive)
    raw = rule(info, mesh) if rule else []
    if not raw:
        return _resolved(raw, info, mesh)
    return mesh.derived("candidates", raw, (info.in_shapes, info.out_shapes),
                        lambda: _resolved(raw, info, mesh))


def _resolved(raw: list[OpStrategy], info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """candidates' list from the rule's (the replicated strategy first, unless the op is
    EXCLUSIVE), each partial result resolved, duplicates dropped."""
    out, seen = [], set()
    for strategy in raw if raw and info.primitive in EXCLUSIVE else [replicated(info), *raw]:
        for s in _resolve_partials(strategy, info, mesh):
            key_s = (s.ins, s.outs, s.partial)
            if key_s not in seen:
                seen.add(key_s)
                out.append(s)
    return out


def _resolve_partials(s: OpStrategy, info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """A partial result becomes an all-reduce, or (single result) a reduce-scatter onto a dim
    (the variants whose result spec fits the result's shape)."""
    if not any(s.partial):
        return [s]
    if len(s.outs) != 1:
        return [s]
    (shape,) = info.out_shapes
    return [v for v, spec in _partial_variants(s, len(shape), mesh) if spec.fits(shape, mesh)]


def _partial_variants(s: OpStrategy, rank: int, mesh: MeshInfo
                      ) -> list[tuple[OpStrategy, Spec]]:
    """_resolve_partials' variants of a strategy with one partial result of `rank` dims,
    each with its result spec, whatever the result's shape: worked out once per strategy and
    mesh (remembered on the strategy; loop_strategies shares strategies between ops of one
    kind over many shapes)."""
    memo = s.__dict__.get("_partial_variants")
    if memo is None or memo[0] is not mesh:
        memo = s.__dict__["_partial_variants"] = (mesh, {})
    hit = memo[1].get(rank)
    if hit is not None:
        return hit
    (out,), (partial,) = s.outs, s.partial
    targets = range(rank) if s.scatter_dims is None else s.scatter_dims
    variants = []
    for dims in itertools.product((-1, *targets), repeat=len(partial)):
        new = [list(d) for d in out.dims]
        for axis, d in zip(partial, dims, strict=True):
            if d >= 0:
                new[d] = list(mesh.order(new[d] + [axis]))
        spec = Spec(tuple(tuple(d) for d in new))
        variants.append((OpStrategy(s.ins, (spec,), s.partial, s.name), spec))
    memo[1][rank] = variants
    return variants


_loaded = False


def _load_families() -> None:
    """Import the rule modules once; each registers its rules in RULES on import."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import importlib
    import pkgutil

    import jaxpar.rules as pkg
    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name != "registry":
            importlib.import_module(f"jaxpar.rules.{mod.name}")
