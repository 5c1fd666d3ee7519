"""Convolutions and windowed reductions: batch-like dims are loops, windowed dims mostly are not.

conv_general_dilated (dimension numbers: lhs (batch, feature, spatial...), rhs (out feature, in
feature, spatial...), out (batch, feature, spatial...)) has three loops when ungrouped: batch
(lhs <-> out), output feature (rhs <-> out) and input feature (lhs <-> rhs, a reduction), plus any
spatial dim a 1x1 window, stride 1, unpadded, leaves pointwise. Grouped convs keep the group index
majormost in every dim it splits, so cutting the group loop keeps whole groups on a device, but
XLA's partitioner only handles some of them (each restriction below was seen on XLA, not derived):

* `feature_group_count` G > 1: only depthwise convs (one input channel per group) partition
  without communication, on batch and on the group loop (lhs feature, rhs out feature, out
  feature); a batch cut must leave no mesh axis unused, or jax.grad's weight gradient comes out
  wrong. Other grouped convs all-gather even a batch cut, so they get no cuts.
* `batch_group_count` B > 1 (jax.grad's weight gradient of a grouped conv: lhs "batch" holds the
  channels, lhs "feature" the real batch): only the group loop (lhs batch, rhs out feature, out
  feature). Cutting the contraction there gives wrong values.

A windowed-reduction dim is a loop where its windows tile it exactly (window == stride, no
padding, no dilation, size == output size * window): a block of output rows then reads exactly
the matching block of input rows, with no halo across shards. Window 1, stride 1 (the untouched
batch and channel dims of a pool) is the common case; a 2x2 stride-2 pool also tiles.
"""

from __future__ import annotations

from jax import lax

from jaxpar.rules.registry import RULES, Loop, OpInfo, loop_strategies
from jaxpar.spec import MeshInfo, OpStrategy


def _tiles(size: int, out: int, window: int, stride: int, pad, dilations) -> bool:
    """Non-overlapping windows cover the dim exactly: output blocks own input blocks."""
    return (window == stride and tuple(pad) == (0, 0) and all(d == 1 for d in dilations)
            and size == out * window)


def conv_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    p = info.params
    (lb, lf, *ls), (ro, ri, *rs), (ob, of, *os) = p["dimension_numbers"]
    (lhs, rhs), out = info.in_shapes, info.out_shapes[0]
    groups, batch_groups = p["feature_group_count"], p["batch_group_count"]
    if batch_groups > 1:  # the group loop only (module docstring)
        return loop_strategies(info, mesh, [Loop(batch_groups, (lb, ro), (of,))])
    batch = Loop(out[ob], (lb, None), (ob,))
    if groups > 1 and rhs[ri] > 1:  # grouped, not depthwise: no cut partitions cleanly
        return []
    if groups > 1:
        return _depthwise(info, mesh, [batch, Loop(groups, (lf, ro), (of,))])
    loops = [batch, Loop(out[of], (None, ro), (of,)),
             Loop(lhs[lf], (lf, ri), (None,), reducible=True)]
    # Only 1x1 windows: XLA miscomputes conv cuts along tiling spatial dims of larger windows.
    spatial = [Loop(out[o], (d, None), (o,))
               for i, (d, r, o) in enumerate(zip(ls, rs, os, strict=True))
               if rhs[r] == 1 and _tiles(lhs[d], out[o], 1, p["window_strides"][i],
                                         p["padding"][i], (p["lhs_dilation"][i],))]
    # A partial result reduce-scattered onto a spatial dim of a windowed conv makes XLA's
    # backward convs all-reduce over the whole mesh (wrong gradients): keep them as targets
    # only where that dim is a loop (1x1, stride 1).
    targets = [ob, of] + [loop.outs[0] for loop in spatial]
    return loop_strategies(info, mesh, loops + spatial, scatter_dims=targets)


def _depthwise(info: OpInfo, mesh: MeshInfo, loops: list[Loop]) -> list[OpStrategy]:
    # XLA all-reduces the weight gradient of a batch-cut depthwise conv over the whole mesh, so
    # a batch cut is right only when no mesh axis is left replicated.
    batch = loops[0].ins[0]
    real = {a for a in mesh.names if mesh.axis_size(a) > 1}
    return [s for s in loop_strategies(info, mesh, loops)
            if not s.ins[0].dims[batch] or real <= set(s.ins[0].axes())]


def _window_loops(shape: tuple[int, ...], out: tuple[int, ...], p: dict) -> list[tuple[int, int]]:
    """(dim, loop size) of every dim whose windows tile it exactly."""
    ones = (1,) * len(shape)
    pads = p.get("padding", ((0, 0),) * len(shape))
    base, win = p.get("base_dilation", ones), p.get("window_dilation", ones)
    return [(d, out[d]) for d in range(len(shape))
            if _tiles(shape[d], out[d], p["window_dimensions"][d], p["window_strides"][d],
                      pads[d], (base[d], win[d]))]


def reduce_window_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """reduce_window_{sum,max,min} (one operand) and reduce_window (operands..., inits...)."""
    n = len(info.out_shapes)
    loops = [Loop(size, tuple(d if k < n else None for k in range(len(info.in_shapes))),
                  (d,) * n)
             for d, size in _window_loops(info.in_shapes[0], info.out_shapes[0], info.params)]
    return loop_strategies(info, mesh, loops)


def select_and_scatter_add_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """select_and_scatter_add(source, operand): the gradient of a max/min pool."""
    source, operand = info.in_shapes
    loops = [Loop(size, (d, d), (d,)) for d, size in _window_loops(operand, source, info.params)]
    return loop_strategies(info, mesh, loops)


def select_and_scatter_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """select_and_scatter(operand, source, init): result shaped like operand."""
    operand, source = info.in_shapes[:2]
    loops = [Loop(size, (d, d, None), (d,))
             for d, size in _window_loops(operand, source, info.params)]
    return loop_strategies(info, mesh, loops)


def select_and_gather_add_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """select_and_gather_add(tangents, operand): the JVP of a max/min pool."""
    operand, out = info.in_shapes[1], info.out_shapes[0]
    loops = [Loop(size, (d, d), (d,)) for d, size in _window_loops(operand, out, info.params)]
    return loop_strategies(info, mesh, loops)


RULES[lax.conv_general_dilated_p] = conv_rule
RULES[lax.reduce_window_sum_p] = reduce_window_rule
RULES[lax.reduce_window_max_p] = reduce_window_rule
RULES[lax.reduce_window_min_p] = reduce_window_rule
RULES[lax.reduce_window_p] = reduce_window_rule
RULES[lax.select_and_scatter_add_p] = select_and_scatter_add_rule
RULES[lax.select_and_scatter_p] = select_and_scatter_rule
RULES[lax.select_and_gather_add_p] = select_and_gather_add_rule
