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
    pairs = enumerate(zip(lb, rb, strict=True))
    loops = [Loop(lhs[a], (a, b), (i,)) for i, (a, b) in pairs]
    loops += [Loop(lhs[a], (a, None), (len(lb) + i,)) for i, a in enumerate(lfree)]
    loops += [Loop(rhs[b], (None, b), (len(lb) + len(lfree) + i,)) for i, b in enumerate(rfree)]
    loops += [Loop(lhs[a], (a, b), (None,), reducible=True) for a, b in zip(lc, rc, strict=True)]
    return loop_strategies(info, mesh, loops)


RULES[lax.dot_general_p] = dot_general_rule
