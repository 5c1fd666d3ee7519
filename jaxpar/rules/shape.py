"""Shape and layout ops: broadcast, reshape, transpose, slicing, padding, concatenation, stacking,
iota.

These ops move elements without combining them, so no loop is ever a reduction. A dimension is a
loop only when cutting it gives every device exactly the operand block its result block needs:
dims that slicing, padding, reversal or concatenation cross are never cut, reshape cuts only the
majormost dims of each group of merged or split dims, and an op that pins its own result sharding
(a non-None `sharding` param, from explicit-axis meshes) keeps only the replicated strategy.
Scalar operands (the pad value) always stay replicated. dynamic_slice and
dynamic_update_slice live with the indexing family (indexing.py).
"""

from __future__ import annotations

import math

from jax import lax
from jax._src.lax import lax as lax_internal

from jaxpar.rules.registry import (
    RULES,
    Loop,
    OpInfo,
    loop_strategies,
    same_dim_strategies,
)
from jaxpar.spec import MeshInfo, OpStrategy


def _index(info: OpInfo, dims: dict[int, int]) -> tuple[int | None, ...]:
    """`ins` of a loop indexing dim dims[i] of operand i; every other operand is not indexed."""
    return tuple(dims.get(i) for i in range(len(info.in_shapes)))


def slice_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    p, shape = info.params, info.in_shapes[0]
    strides = p["strides"] or (1,) * len(shape)
    whole = [d for d, n in enumerate(shape)
             if (p["start_indices"][d], p["limit_indices"][d], strides[d]) == (0, n, 1)]
    return same_dim_strategies(info, mesh, whole)


def pad_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    config = info.params["padding_config"]
    unpadded = [d for d, c in enumerate(config) if tuple(c) == (0, 0, 0)]
    return same_dim_strategies(info, mesh, unpadded)


def rev_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    reversed_ = info.params["dimensions"]
    kept = [d for d in range(len(info.in_shapes[0])) if d not in reversed_]
    return same_dim_strategies(info, mesh, kept)


def concatenate_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    rank, axis = len(info.out_shapes[0]), info.params["dimension"]
    others = [d for d in range(rank) if d != axis]
    return same_dim_strategies(info, mesh, others, arrays=len(info.in_shapes))


def split_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    rank, axis = len(info.in_shapes[0]), info.params["axis"]
    return same_dim_strategies(info, mesh, [d for d in range(rank) if d != axis])


def bitcast_convert_type_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    # Changing the element width adds or drops a trailing dim; the leading dims are shared.
    rank = min(len(info.in_shapes[0]), len(info.out_shapes[0]))
    return same_dim_strategies(info, mesh, range(rank))


def transpose_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    perm, shape = info.params["permutation"], info.out_shapes[0]
    return loop_strategies(info, mesh, [Loop(n, (perm[d],), (d,)) for d, n in enumerate(shape)])


def squeeze_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    removed = info.params["dimensions"]
    kept = [d for d in range(len(info.in_shapes[0])) if d not in removed]
    shape = info.out_shapes[0]
    return loop_strategies(info, mesh, [Loop(n, (kept[d],), (d,)) for d, n in enumerate(shape)])


def broadcast_in_dim_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    if info.params.get("sharding") is not None:
        return []
    operand, shape = info.in_shapes[0], info.out_shapes[0]
    source = {d: i for i, d in enumerate(info.params["broadcast_dimensions"])
              if operand[i] == shape[d]}
    # A new or size-1-broadcast result dim is still a loop: each device fills its own block.
    loops = [Loop(n, _index(info, {0: source[d]} if d in source else {}), (d,))
             for d, n in enumerate(shape)]
    return loop_strategies(info, mesh, loops)


def iota_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    if info.params.get("sharding") is not None:
        return []
    shape = info.out_shapes[0]
    return loop_strategies(info, mesh, [Loop(n, (), (d,)) for d, n in enumerate(shape)])


def stack_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    # Every operand dim is a loop of the result's dim at its place. The new dim (one slot per
    # operand) is never cut: XLA's partitioner builds it with all-to-alls even from replicated
    # operands, as it does a concatenation's dim.
    axis, shape, n = info.params["axis"], info.out_shapes[0], len(info.in_shapes)
    loops = [Loop(size, (d - (d > axis),) * n, (d,)) for d, size in enumerate(shape)
             if d != axis]
    return loop_strategies(info, mesh, loops)


def unstack_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    # Each result is one slice along `axis`, so that dim is never cut; the others are shared.
    axis, operand = info.params["axis"], info.in_shapes[0]
    loops = [Loop(size, (d,), (d - (d > axis),) * len(info.out_shapes))
             for d, size in enumerate(operand) if d != axis]
    return loop_strategies(info, mesh, loops)


def tile_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    # An untiled dim is shared with the operand; a dim tiled r times can be cut by p | r, each
    # device then holding r/p whole copies of the (replicated) operand dim.
    reps, operand = info.params["reps"], info.in_shapes[0]
    loops = [Loop(n, (d,), (d,)) if r == 1 else Loop(r, (None,), (d,))
             for d, (n, r) in enumerate(zip(operand, reps, strict=True))]
    return loop_strategies(info, mesh, loops)


def reshape_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    if info.params.get("sharding") is not None:
        return []
    # `dimensions` transposes the operand first: group the dims in that order.
    operand, dst = info.in_shapes[0], info.out_shapes[0]
    perm = info.params.get("dimensions") or tuple(range(len(operand)))
    src = tuple(operand[d] for d in perm)
    loops = [Loop(math.gcd(src[i], dst[j]), _index(info, {0: perm[i]}), (j,))
             for i, j in _reshape_groups(src, dst) if math.gcd(src[i], dst[j]) > 1]
    return loop_strategies(info, mesh, loops)


def _reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int]]:
    """(operand dim, result dim) heading each minimal run of dims with equal products.

    Cutting both heads p ways (p dividing both) gives each device the same contiguous run of
    row-major elements on both sides; any other dim of a group would need a reshuffle. Size-1
    dims are skipped: they belong to no group.
    """
    if 0 in src:
        return []
    a = [d for d, n in enumerate(src) if n != 1]
    b = [d for d, n in enumerate(dst) if n != 1]
    heads, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        heads.append((a[i], b[j]))
        pa, pb = src[a[i]], dst[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa, i = pa * src[a[i]], i + 1
            else:
                pb, j = pb * dst[b[j]], j + 1
    return heads


def identity_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """Ops that return their operands unchanged (device_put, optimization_barrier, and
    jax.ad_checkpoint.checkpoint_name's `name`, which tags a value for remat policies)."""
    if any(d is not None for d in info.params.get("devices", ())):
        return []
    k = len(info.in_shapes)
    loops = [Loop(n, _index(info, {i: d}), tuple(d if o == i else None for o in range(k)))
             for i, shape in enumerate(info.in_shapes) for d, n in enumerate(shape)]
    return loop_strategies(info, mesh, loops)


_RULES = {
    "broadcast_in_dim": broadcast_in_dim_rule, "reshape": reshape_rule,
    "transpose": transpose_rule, "squeeze": squeeze_rule, "concatenate": concatenate_rule,
    "pad": pad_rule, "slice": slice_rule, "split": split_rule, "iota": iota_rule,
    "rev": rev_rule, "tile": tile_rule, "stack": stack_rule, "unstack": unstack_rule,
    "bitcast_convert_type": bitcast_convert_type_rule, "device_put": identity_rule,
    "optimization_barrier": identity_rule,
}


def _register() -> None:
    for name, rule in _RULES.items():
        # stack and unstack (jax 0.10) live only in jax._src.lax.lax
        prim = getattr(lax, f"{name}_p", None) or getattr(lax_internal, f"{name}_p", None)
        if prim is not None:
            RULES[prim] = rule
    from jax._src.ad_checkpoint import name_p  # checkpoint_name (no public handle)
    RULES[name_p] = identity_rule


_register()
