"""dot_general: batch dims, free dims of each side, and contracting dims (a reduction).

Result layout is (batch..., lhs free..., rhs free...). Cutting a contracting dim leaves the
result partial: the Megatron row-parallel case. ragged_dot (grouped matmul) likewise, its group
dim never cut.
"""

from __future__ import annotations

from dataclasses import replace

from jax import lax
from jax._src.lax import lax as lax_internal

from jaxpar.rules.registry import RULES, Loop, OpInfo, loop_strategies
from jaxpar.spec import MeshInfo, OpStrategy


def dot_general_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    (lc, rc), (lb, rb) = info.params["dimension_numbers"]
    lhs, rhs = info.in_shapes[:2]
    lfree = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rhs)) if d not in rc and d not in rb]
    pairs = enumerate(zip(lb, rb, strict=True))
    loops = [Loop(lhs[a], (a, b), (i,)) for i, (a, b) in pairs]
    loops += [Loop(lhs[a], (a, None), (len(lb) + i,)) for i, a in enumerate(lfree)]
    loops += [Loop(rhs[b], (None, b), (len(lb) + len(lfree) + i,)) for i, b in enumerate(rfree)]
    loops += [Loop(lhs[a], (a, b), (None,), reducible=True) for a, b in zip(lc, rc, strict=True)]
    strategies = loop_strategies(info, mesh, loops)
    return _no_scatter_onto_cut_batch(strategies, len(lb), len(info.out_shapes[0]), mesh)


def _no_scatter_onto_cut_batch(strategies: list[OpStrategy], batch: int, rank: int,
                               mesh: MeshInfo) -> list[OpStrategy]:
    """XLA's partitioner miscompiles a batched dot whose batch dim is cut and whose contraction
    is cut over two or more axes when the result's batch dim takes some but not all of them
    by reduce-scatter (wrong numbers, reproduced with jax.jit alone: a strict xfail in
    tests/test_rules_core.py). Such strategies reduce-scatter onto the other dims only."""
    if not batch:
        return strategies
    others = tuple(range(batch, rank))
    return mesh.derived("dot: no scatter onto a cut batch dim", strategies, (batch, rank),
                        lambda: [replace(s, scatter_dims=others) if len(s.partial[0]) > 1 and
                                 any(s.outs[0].dims[d] for d in range(batch)) else s
                                 for s in strategies])


def ragged_dot_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """lax.ragged_dot (an MoE's grouped matmul): lhs rows in consecutive groups, group g's rows
    times rhs[g]; and its weight gradient, where the ragged rows are contracted into one result
    per group. Free dims are loops (the ragged rows too: XLA finds each device's groups from the
    replicated group sizes), contracting dims reductions (the ragged one too: per-group partial
    sums); the group dim and the group sizes are never cut. Forms with batch dims or a group
    offset get no candidates but the replicated one."""
    p = info.params
    numbers = p["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = numbers.dot_dimension_numbers
    lhs, rhs = info.in_shapes[:2]
    ragged, groups = tuple(numbers.lhs_ragged_dimensions), tuple(numbers.rhs_group_dimensions)
    grouped = groups == (0,) and not any(d in lc for d in ragged)  # forward: rhs[g] per row
    summed = groups == () and len(ragged) == 1 and ragged[0] in lc  # result [g, ...]
    if lb or rb or p.get("group_offset") is not None or not (grouped or summed):
        return []
    lfree = [d for d in range(len(lhs)) if d not in lc]
    rfree = [d for d in range(len(rhs)) if d not in rc and d not in groups]
    first = 1 if summed else 0  # the result's leading group dim
    loops = [Loop(lhs[a], (a, None, None), (first + i,)) for i, a in enumerate(lfree)]
    loops += [Loop(rhs[b], (None, b, None), (first + len(lfree) + i,))
              for i, b in enumerate(rfree)]
    loops += [Loop(lhs[a], (a, b, None), (None,), reducible=True)
              for a, b in zip(lc, rc, strict=True)]
    return loop_strategies(info, mesh, loops)


RULES[lax.dot_general_p] = dot_general_rule
if hasattr(lax_internal, "ragged_dot_general_p"):  # no public handle
    RULES[lax_internal.ragged_dot_general_p] = ragged_dot_rule
