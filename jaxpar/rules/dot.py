"""dot_general: batch dims, free dims of each side, and contracting dims (a reduction).

Result layout is (batch..., lhs free..., rhs free...). Cutting a contracting dim leaves the
result partial: the Megatron row-parallel case.
"""

from __future__ import annotations

from jax import lax

from jaxpar.rules.registry import RULES, Loop, OpInfo, loop_strategies
from jaxpar.spec import MeshInfo, OpStrategy


def dot_general_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    (lc, rc), (lb, rb) = info.params["dimension_numbers"]
    lhs, rhs = info.in_shapes[:2]
    lfree = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rhs)) if d not in rc and d not in rb]
    loops = [Loop(lhs[l], (l, r), (i,)) for i, (l, r) in enumerate(zip(lb, rb, strict=True))]
    loops += [Loop(lhs[l], (l, None), (len(lb) + i,)) for i, l in enumerate(lfree)]
    loops += [Loop(rhs[r], (None, r), (len(lb) + len(lfree) + i,)) for i, r in enumerate(rfree)]
    loops += [Loop(lhs[l], (l, r), (None,), reducible=True) for l, r in zip(lc, rc, strict=True)]
    return loop_strategies(info, mesh, loops)


RULES[lax.dot_general_p] = dot_general_rule
