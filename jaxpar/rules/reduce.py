"""Reductions, scans and sorts: ops that work along some dimensions and map the others.

Every dimension an op does not work along is a loop shared by all its operands and results.
The dimensions it works along differ by kind:

- `reduce_*` (sum, max, min, prod, and, or, xor): a reduced dim is a reducible loop. Each
  shard reduces its slice and the partial results combine with an all-reduce of the same kind
  (XLA picks the kind from the op, so the rule only says *that* a reduction is needed).
- `argmax` / `argmin`: the reduced dim is never cut; a shard's local winner carries a local
  index, and the combine needs values and indices together, which a plain all-reduce can't do.
- cumulative ops (`cumsum` ... `cumlogsumexp`): the scanned axis is never cut; a shard would
  need the carry of every shard before it.
- `sort` (several operands sorted together) and `top_k`: the sort / top-k dimension is never cut.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax import lax

from jaxpar.rules.registry import RULES, Loop, OpInfo, loop_strategies
from jaxpar.spec import MeshInfo, OpStrategy


def _mapped_loops(info: OpInfo, worked: Sequence[int]) -> list[Loop]:
    """One loop per operand dim not in `worked`; every array has the operand's rank and layout
    apart from the worked dims, which results drop (reductions) or keep (scans, sorts)."""
    shape = info.in_shapes[0]
    kept = [d for d in range(len(shape)) if d not in worked]
    same_rank = [len(s) == len(shape) for s in info.out_shapes]
    return [Loop(shape[d], tuple(d for _ in info.in_shapes),
                 tuple(d if full else i for full in same_rank))
            for i, d in enumerate(kept)]


def reduce_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    axes = info.params["axes"]
    reduced = [Loop(info.in_shapes[0][d], (d,), (None,), reducible=True) for d in axes]
    return loop_strategies(info, mesh, _mapped_loops(info, axes) + reduced)


def argreduce_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    return loop_strategies(info, mesh, _mapped_loops(info, info.params["axes"]))


def along_axis_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """Cumulative ops, sort and top_k: each names the one dimension it works along."""
    p = info.params
    axis = p.get("dimension", p.get("axis", -1))  # top_k without `axis`: the last dim
    return loop_strategies(info, mesh, _mapped_loops(info, [axis % len(info.in_shapes[0])]))


_FAMILIES = {
    reduce_rule: "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor",
    argreduce_rule: "argmax argmin",
    along_axis_rule: "cumsum cumprod cummax cummin cumlogsumexp sort top_k",
}


def _register() -> None:
    for rule, names in _FAMILIES.items():
        for name in names.split():
            prim = getattr(lax, f"{name}_p", None)
            if prim is not None:
                RULES[prim] = rule


_register()
