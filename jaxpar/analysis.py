"""Compiled program -> what it really communicates, stores and computes, per device.

Before: a `jax.stages.Compiled` (its SPMD-partitioned HLO text, memory and cost analyses).
After: plain dicts and floats; nothing is modified.

`collective_stats` counts every collective instruction of the partitioned program with its bytes
per device, the larger of its operand and result buffers:
  all-gather -> the gathered result; reduce-scatter -> the full input (result x group size);
  all-reduce, all-to-all, collective-permute -> the buffer.
- Tuple collectives sum their elements.
- Async pairs (`all-gather-start`/`-done`, `all-reduce-start`, `collective-permute-start`, and
  `async-start` wrapping a collective computation) count once, at the start, with the bytes of
  the result the `-done` returns (a start's tuple also holds its operands and u32 context).
- A collective in a while body counts `known_trip_count` times (nested loops multiply; a loop
  XLA gave no trip count counts once); collectives in called computations (call, fusion, async
  and custom-call computations) count where they are called. A conditional counts the branch
  that communicates most (by bytes, then count): an upper bound for one execution, and exact
  when the branches agree.
- On CPU the partitioner writes a reduce-scatter as an all-reduce whose only users
  dynamic-slice it (directly, through bitcast/reshape/get-tuple-element, or as the first op of
  a fusion on that operand): that all-reduce is reported as a "reduce-scatter" with the
  all-reduce's buffer as bytes (the full input, as for a native reduce-scatter).
- A collective that moves nothing is left out: a collective-permute whose source-target pairs
  are all `{i,i}`, or a collective whose every replica group has one device. So `{}` means the
  program does not communicate. A permute with some identity pairs counts its whole buffer
  (the devices that do send, send all of it).
"""

from __future__ import annotations

from typing import Any

from jaxpar._hlo import (
    Instr,
    Module,
    parse_module,
    replica_groups,
    shape_bytes,
    source_target_pairs,
    tuple_elements,
)

__all__ = ["KINDS", "collective_stats", "flops", "memory_stats", "shape_bytes"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

Stats = dict[str, dict[str, int]]

# Opcodes of collectives other than the five KINDS themselves: the async starts, and the ragged
# all-to-all (its result is the output buffer, like an all-to-all's).
_ALIASES = {"all-reduce-start": "all-reduce", "all-gather-start": "all-gather",
            "collective-permute-start": "collective-permute", "ragged-all-to-all": "all-to-all"}
# Instructions whose `calls=` names a computation already counted at its `async-start`.
_NO_DESCENT = {"async-update", "async-done"}
# Pure relabelling of a buffer: a dynamic-slice behind one still slices the all-reduce.
_PASS_THROUGH = {"bitcast", "reshape", "copy", "get-tuple-element"}


def _hlo_text(compiled: Any) -> str:
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    if text.lstrip().startswith("module"):
        raise ValueError("collective_stats reads the partitioned HLO of a compiled program; got "
                         "StableHLO (a `Lowered`?). Pass `lowered.compile()` instead.")
    return text


def collective_stats(compiled: Any) -> Stats:
    """Collectives of a compiled program: {kind: {"count": n, "bytes": per-device bytes}}.

    Counts are executions (loop bodies times their trip count); bytes are summed over them.
    Kinds are those of `KINDS`; a kind that does not occur is absent, so a program that does
    not communicate gives `{}`.

    Args:
      compiled: a `jax.stages.Compiled` (or the text of its `as_text()`).

    Returns:
      A dict from kind to {"count": int, "bytes": int}, in `KINDS` order.

    Example:
      >>> stats = collective_stats(jax.jit(f).lower(x).compile())
      >>> stats.get("all-reduce", {}).get("bytes", 0)
    """
    module = parse_module(_hlo_text(compiled))
    stats = _comp_stats(module, module.entry, {})
    return {k: stats[k] for k in KINDS if k in stats}


def _comp_stats(mod: Module, comp: str, memo: dict[str, Stats]) -> Stats:
    """Collectives one execution of `comp` runs, callees included (memoised per computation)."""
    if comp in memo:
        return memo[comp]
    memo[comp] = {}  # a (malformed) recursive call graph counts the cycle once
    out: Stats = {}
    for ins in mod.comps.get(comp, []):
        found = _collective(mod, comp, ins)
        if found is not None:
            _add(out, {found[0]: {"count": 1, "bytes": found[1]}}, 1)
        for stats, times in _called(mod, ins, memo):
            _add(out, stats, times)
    memo[comp] = out
    return out


def _add(into: Stats, stats: Stats, times: int) -> None:
    for kind, v in stats.items():
        slot = into.setdefault(kind, {"count": 0, "bytes": 0})
        slot["count"] += v["count"] * times
        slot["bytes"] += v["bytes"] * times


def _called(mod: Module, ins: Instr, memo: dict[str, Stats]) -> list[tuple[Stats, int]]:
    """(stats of a called computation, how many times `ins` runs it) for each callee."""
    if ins.opcode == "while":
        trip = ins.trip_count() or 1
        return ([(_comp_stats(mod, c, memo), trip) for c in ins.attr_names("body")]
                + [(_comp_stats(mod, c, memo), trip + 1) for c in ins.attr_names("condition")])
    if ins.opcode == "conditional":
        names = (ins.attr_names("branch_computations") or ins.attr_names("true_computation")
                 + ins.attr_names("false_computation"))
        return [(max((_comp_stats(mod, c, memo) for c in names), key=_weight, default={}), 1)]
    if ins.opcode in _NO_DESCENT or ins.opcode.endswith("-done"):
        return []
    # `to_apply` is a call's body, but a reduction's combiner everywhere else.
    keys = ("to_apply",) if ins.opcode == "call" else ("calls", "called_computations")
    return [(_comp_stats(mod, c, memo), 1) for k in keys for c in ins.attr_names(k)]


def _weight(stats: Stats) -> tuple[int, int]:
    return (sum(v["bytes"] for v in stats.values()), sum(v["count"] for v in stats.values()))


def _collective(mod: Module, comp: str, ins: Instr) -> tuple[str, int] | None:
    """(kind, bytes per device) when `ins` is a collective that moves data, else None."""
    kind = ins.opcode if ins.opcode in KINDS else _ALIASES.get(ins.opcode)
    if kind is None or _moves_nothing(mod, ins, kind):
        return None
    nbytes = shape_bytes(_result_type(mod, comp, ins))
    if kind == "all-reduce" and _only_sliced(mod, comp, ins.name):
        return "reduce-scatter", nbytes
    if kind == "reduce-scatter":
        groups = replica_groups(ins.attrs, mod.num_devices)
        operands = sum(shape_bytes(mod.type_of(comp, o)) for o in ins.operands)
        nbytes = max(nbytes * (len(groups[0]) if groups else 1), operands)
    return kind, nbytes


def _moves_nothing(mod: Module, ins: Instr, kind: str) -> bool:
    if kind == "collective-permute":
        pairs = source_target_pairs(ins.attrs)
        return bool(pairs) and all(a == b for a, b in pairs)
    groups = replica_groups(ins.attrs, mod.num_devices)
    return groups is not None and all(len(g) <= 1 for g in groups)


def _result_type(mod: Module, comp: str, ins: Instr) -> str:
    """The collective's own result: for a `-start`, what its `-done` returns."""
    if not ins.opcode.endswith("-start"):
        return ins.type
    done = [u.type for u in mod.users(comp, ins.name) if u.opcode.endswith("-done")]
    if done:
        return done[0]
    # No -done in sight: an all-reduce-start's shape is its result; the other starts are
    # (operands, result, context...).
    elements = tuple_elements(ins.type)
    return ins.type if ins.opcode == "all-reduce-start" or len(elements) < 2 else elements[1]


def _only_sliced(mod: Module, comp: str, value: str) -> bool:
    """Every use of `value` in `comp` dynamic-slices it (the CPU reduce-scatter pattern)."""
    users = mod.users(comp, value)
    return bool(users) and all(_slices(mod, comp, value, u) for u in users)


def _slices(mod: Module, comp: str, value: str, user: Instr) -> bool:
    if user.opcode == "dynamic-slice":
        return user.operands[0] == value and value not in user.operands[1:]
    if user.opcode in _PASS_THROUGH:
        return _only_sliced(mod, comp, user.name)
    if user.opcode != "fusion" or not user.attr_names("calls"):
        return False
    fused = user.attr_names("calls")[0]
    params = [mod.parameter(fused, i) for i, o in enumerate(user.operands) if o == value]
    return all(p is not None and _only_sliced(mod, fused, p.name) for p in params)


def memory_stats(compiled: Any) -> dict[str, int]:
    """Memory of a compiled program per device, in bytes, from `compiled.memory_analysis()`.

    Returns:
      {"argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "generated_code_bytes",
      "peak_bytes"}; peak is XLA's own figure where it gives one, else arguments + outputs +
      temporaries - aliased bytes. `{}` when the backend has no memory analysis.

    Example:
      >>> memory_stats(jax.jit(f).lower(x).compile())["peak_bytes"]
    """
    m = compiled.memory_analysis()
    m = m[0] if isinstance(m, (list, tuple)) and m else m
    if m is None or not hasattr(m, "temp_size_in_bytes"):
        return {}
    keys = ("argument", "output", "alias", "temp", "generated_code")
    out = {f"{k}_bytes": int(getattr(m, f"{k}_size_in_bytes", 0)) for k in keys}
    estimate = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    out["peak_bytes"] = int(getattr(m, "peak_memory_in_bytes", 0) or 0) or estimate
    return out


def flops(compiled: Any) -> float:
    """Floating-point operations per device of a compiled program (XLA's cost analysis).

    `compiled.cost_analysis()` is a dict in current JAX and a list of dicts (one per module) in
    older ones; the list is summed. 0.0 when the backend gives no estimate.

    Example:
      >>> flops(jax.jit(jnp.dot).lower(a, b).compile())
    """
    cost = compiled.cost_analysis()
    entries = cost if isinstance(cost, (list, tuple)) else [cost]
    return float(sum(max(float((c or {}).get("flops", 0.0)), 0.0) for c in entries))
