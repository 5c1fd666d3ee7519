"""Reductions, scans and sorts: ops that work along some dimensions and map the others.

Every dimension an op does not work along is a loop shared by all its operands and results.
The dimensions it works along ("worked" dims) differ by kind:

- `reduce_sum/max/min/prod/and/or/xor`: a reduced dim is a reducible loop. Each shard reduces its
  slice and the partial results combine with an all-reduce of the same kind (XLA takes the kind
  from the op, so the rule only says *that* a reduction is left). Where XLA has no all-reduce of
  that kind and dtype ("Unsupported reduction computation": xor of anything, and/or of
  integers, max/min of complex numbers) the reduced dims are never cut.
- `argmax` / `argmin`: the reduced dim is never cut; a shard's winner carries a local index,
  and combining needs values and indices together, which a plain all-reduce can't do.
- cumulative ops (`cumsum` ... `cumlogsumexp`): the scanned axis is never cut; a shard would
  need the carry of every shard before it.
- `sort` (operands sorted together): the sort dimension is never cut.

- `top_k` / `approx_top_k` (`approx_max_k`, `approx_min_k`): the dimension they pick along is
  never cut (a shard's winners are not the whole row's); every other dim is a loop. XLA rewrites
  top_k into a `TopK` custom call before partitioning and replicates that call's operand (an
  all-gather) even where only other dims are cut (a strict xfail in tests/test_rules_reduce.py
  says when that changes), so both are in `registry.LOCAL`: the lowering binds them per shard
  in a shard_map, where a row's top k are found on the device that holds the row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jax import lax

from jaxpar.rules.registry import LOCAL, RULES, Loop, OpInfo, loop_strategies
from jaxpar.spec import MeshInfo, OpStrategy


def _mapped_loops(info: OpInfo, worked: Sequence[int]) -> list[Loop]:
    """A loop per operand dim not in `worked`, over all operands and results; results have
    the operand's layout with the worked dims kept (scans, sorts) or dropped (reductions)."""
    shape = info.in_shapes[0]
    kept = [d for d in range(len(shape)) if d not in worked]
    same_rank = [len(s) == len(shape) for s in info.out_shapes]
    return [Loop(shape[d], tuple(d for _ in info.in_shapes),
                 tuple(d if full else i for full in same_rank))
            for i, d in enumerate(kept)]


def _worked(info: OpInfo) -> list[int]:
    """Dims the op works along: `axes` of a reduction, `axis` of a scan, `dimension` of sort."""
    p = info.params
    if "axes" in p:
        return list(p["axes"])
    return [p.get("dimension", p.get("axis")) % len(info.in_shapes[0])]


def _real(dtype: np.dtype) -> bool:
    return not np.issubdtype(dtype, np.complexfloating)


def _bool(dtype: np.dtype) -> bool:
    return dtype == np.bool_


# Operand dtypes whose partial results XLA can all-reduce with the op's combiner (checked on
# CPU); reduce_xor has none.
_PARTIALS_OK = {
    lax.reduce_sum_p: lambda dtype: True, lax.reduce_prod_p: lambda dtype: True,
    lax.reduce_max_p: _real, lax.reduce_min_p: _real,
    lax.reduce_and_p: _bool, lax.reduce_or_p: _bool,
}


def reduce_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    axes = info.params["axes"]
    loops = _mapped_loops(info, axes)
    dtype = np.dtype(info.in_dtypes[0] if info.in_dtypes else np.float32)  # hand-built: float
    if _PARTIALS_OK.get(info.primitive, lambda dtype: False)(dtype):
        loops += [Loop(info.in_shapes[0][d], (d,), (None,), reducible=True) for d in axes]
    return loop_strategies(info, mesh, loops)


def mapped_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """Only the dims the op does not work along are cut."""
    return loop_strategies(info, mesh, _mapped_loops(info, _worked(info)))


def top_k_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """Every dim but the one the op picks along (`axis`, `reduction_dimension`; the last when
    the op has neither) is cut on operand and both results alike."""
    p = info.params
    axis = p.get("axis", p.get("reduction_dimension", -1))
    return loop_strategies(info, mesh, _mapped_loops(info, [axis % len(info.in_shapes[0])]))


_FAMILIES = {
    reduce_rule: "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor",
    mapped_rule: "argmax argmin cumsum cumprod cummax cummin cumlogsumexp sort",
    top_k_rule: "top_k approx_top_k",
}


def _register() -> None:
    for rule, names in _FAMILIES.items():
        for name in names.split():
            prim = getattr(lax, f"{name}_p", None)
            if prim is not None:
                RULES[prim] = rule
                if rule is top_k_rule:
                    LOCAL.add(prim)


_register()
