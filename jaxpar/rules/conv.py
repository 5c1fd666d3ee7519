"""Convolutions and windowed reductions: the batch-like dims are loops, the windowed dims are not.

conv_general_dilated (dimension numbers: lhs (batch, feature, spatial...), rhs (out feature, in
feature, spatial...), out (batch, feature, spatial...)) has three loops when ungrouped: batch
(lhs <-> out), output feature (rhs <-> out) and input feature (lhs <-> rhs, a reduction). A grouped
conv keeps the group index major in every dim it splits, so with `feature_group_count` G > 1 the
group loop (lhs feature, rhs out feature, out feature) replaces the two feature loops, and with
`batch_group_count` B > 1 (the weight gradient of a grouped conv, where the lhs "batch" holds the
channels) the group loop (lhs batch, rhs out feature, out feature) replaces batch and output
feature. A cut of a group loop keeps whole groups on each device.

A windowed dim is a loop only where its windows tile it exactly (window == stride, no padding, no
dilation, size == output size * window): then a block of output rows reads exactly the matching
block of input rows, and no halo crosses a shard boundary. Window 1, stride 1 (the untouched
batch and channel dims of a pooling op, the spatial dims of a 1x1 conv) is the common case.
"""

from __future__ import annotations

from jax import lax

from jaxpar.rules.registry import RULES, Loop, OpInfo, loop_strategies
from jaxpar.spec import MeshInfo, OpStrategy


def _tiles(size: int, out: int, window: int, stride: int, pad: tuple[int, int],
           dilations: tuple[int, ...]) -> bool:
    """True when non-overlapping windows cover the dim exactly, so output blocks own input blocks."""
    return (window == stride and tuple(pad) == (0, 0) and all(d == 1 for d in dilations)
            and size == out * window)


def conv_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    p = info.params
    (lb, lf, *ls), (ro, ri, *rs), (ob, of, *os) = p["dimension_numbers"]
    lhs, rhs = info.in_shapes
    out = info.out_shapes[0]
    groups, batch_groups = p["feature_group_count"], p["batch_group_count"]
    loops = []
    if batch_groups == 1:
        loops.append(Loop(out[ob], (lb, None), (ob,)))
    if groups == batch_groups == 1:
        loops.append(Loop(out[of], (None, ro), (of,)))
    if groups == 1:
        loops.append(Loop(lhs[lf], (lf, ri), (None,), reducible=True))
    if groups > 1 or batch_groups > 1:
        loops.append(Loop(max(groups, batch_groups), (lf if groups > 1 else lb, ro), (of,)))
    for i, (l, r, o) in enumerate(zip(ls, rs, os, strict=True)):
        if _tiles(lhs[l], out[o], rhs[r], p["window_strides"][i], p["padding"][i],
                  (p["lhs_dilation"][i], p["rhs_dilation"][i])):
            loops.append(Loop(out[o], (l, None), (o,)))
    return loop_strategies(info, mesh, loops)


RULES[lax.conv_general_dilated_p] = conv_rule


def _window_loops(shape: tuple[int, ...], out: tuple[int, ...], p: dict) -> list[tuple[int, int]]:
    """(dim, loop size) of every dim whose windows tile it exactly."""
    strides = p["window_strides"]
    pads = p.get("padding", ((0, 0),) * len(shape))
    dil = [p.get(k, (1,) * len(shape)) for k in ("base_dilation", "window_dilation")]
    return [(d, out[d]) for d in range(len(shape))
            if _tiles(shape[d], out[d], p["window_dimensions"][d], strides[d], pads[d],
                      (dil[0][d], dil[1][d]))]


def reduce_window_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """reduce_window_{sum,max,min} and generic reduce_window: operands (arrays..., inits...)."""
    shape, out = info.in_shapes[0], info.out_shapes[0]
    n = len(info.out_shapes)
    loops = [Loop(size, tuple(d if k < n else None for k in range(len(info.in_shapes))),
                  (d,) * n)
             for d, size in _window_loops(shape, out, info.params)]
    return loop_strategies(info, mesh, loops)


def select_and_scatter_add_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """select_and_scatter_add(source, operand): source is window-output shaped, result input shaped."""
    source, operand = info.in_shapes
    loops = [Loop(size, (d, d), (d,)) for d, size in _window_loops(operand, source, info.params)]
    return loop_strategies(info, mesh, loops)


def select_and_gather_add_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """select_and_gather_add(tangents, operand): both input shaped, result window-output shaped."""
    operand, out = info.in_shapes[1], info.out_shapes[0]
    loops = [Loop(size, (d, d), (d,)) for d, size in _window_loops(operand, out, info.params)]
    return loop_strategies(info, mesh, loops)


for _prim in (lax.reduce_window_sum_p, lax.reduce_window_max_p, lax.reduce_window_min_p,
              lax.reduce_window_p):
    RULES[_prim] = reduce_window_rule
RULES[lax.select_and_scatter_add_p] = select_and_scatter_add_rule
RULES[lax.select_and_gather_add_p] = select_and_gather_add_rule
