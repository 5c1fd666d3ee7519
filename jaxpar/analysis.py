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
  all-reduce's buffer as bytes (the full input, as for a native reduce-scatter). A tuple
  all-reduce (XLA's combiner merges a training step's gradient reductions into one) is split
  by element: the elements whose every use slices them are one reduce-scatter, the others one
  all-reduce, each with the bytes of its elements.
- XLA:CPU reduces 16-bit floats (bf16, f16) in float32: it widens such an all-reduce's
  operands and clones its reducer as `<name>_promoted` (the combiner may then merge f32
  reductions into it), or, for a 16-bit matmul it computes in float32 (a bf16 weight's
  gradient), reduces the float32 product and converts it back after (every use of that
  element converts it to 16 bits). It moves them as float32 too: an all-gather, all-to-all or
  collective-permute of converts from 16-bit floats, or whose every use converts back to
  them. Such a collective counts its f32 buffer in `bytes` (what this backend moves) and half
  of it in `CollectiveOp.widened`: what widening added at most, as the HLO no longer tells
  which elements were 16-bit. A backend that moves 16-bit floats natively (GPU, TPU) moves
  between `bytes - widened` and `bytes`; `Plan.verify` accepts a plan within that range.
- A collective that moves nothing is left out: a collective-permute whose source-target pairs
  are all `{i,i}`, or a collective whose every replica group has one device. So `{}` means the
  program does not communicate. A permute with some identity pairs counts its whole buffer
  (the devices that do send, send all of it).

`collective_ops` lists the same collectives one instruction at a time, with their device groups;
`estimate_time` prices them, and XLA's flop and byte counts, under a hardware profile.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from jax.sharding import AbstractMesh, Mesh

from jaxpar._hlo import (
    Instr,
    Module,
    parse_module,
    replica_groups,
    shape_bytes,
    shape_dims,
    source_target_pairs,
    tuple_elements,
)
from jaxpar.cost.comm import Collective, collective_time
from jaxpar.cost.hardware import COLLECTIVE_KINDS, HardwareProfile, Link, load_profile
from jaxpar.spec import MeshInfo

__all__ = ["KINDS", "CollectiveOp", "collective_axes", "collective_ops", "collective_stats",
           "estimate_time",
           "flops", "library_gemm_flops", "memory_stats", "shape_bytes", "stats_by_kind"]

KINDS = COLLECTIVE_KINDS  # the kinds jaxpar predicts and counts

Stats = dict[str, dict[str, int]]
Ops = tuple["CollectiveOp", ...]

# Opcodes of collectives other than the five KINDS themselves: the async starts, and the ragged
# all-to-all (its result is the output buffer, like an all-to-all's).
_ALIASES = {"all-reduce-start": "all-reduce", "all-gather-start": "all-gather",
            "collective-permute-start": "collective-permute", "ragged-all-to-all": "all-to-all"}
# Instructions whose `calls=` names a computation already counted at its `async-start`.
_NO_DESCENT = {"async-update", "async-done"}
# Pure relabelling of a buffer: a dynamic-slice behind one still slices the all-reduce.
_PASS_THROUGH = {"bitcast", "reshape", "copy", "get-tuple-element"}


def _hlo_text(compiled: Any, where: str = "collective_stats") -> str:
    if not isinstance(compiled, str) and not callable(getattr(compiled, "as_text", None)):
        raise TypeError(f"{where}: compiled={type(compiled).__name__}: expected a compiled "
                        "program (`jax.jit(f).lower(*args).compile()`, or a ShardedFunction's "
                        "`.lower(*args).compile()`) or its `as_text()`.")
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    if text.lstrip().startswith("module"):
        raise ValueError(f"{where} reads the partitioned HLO of a compiled program; got "
                         "StableHLO (a `Lowered`?). Pass `lowered.compile()` instead.")
    if "ENTRY" not in text:
        raise ValueError(f"{where}: compiled={text[:40]!r}...: no HLO module in this text; pass "
                         "a compiled program or its `as_text()`.")
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
    return stats_by_kind(collective_ops(compiled))


def compiled_bytes(compiled: Any) -> float | None:
    """Per-device bytes a compiled program holds at once, by XLA's own memory analysis:
    arguments, results and temporaries, less the results that reuse (alias) donated
    arguments. None where the backend gives no analysis.

    Example:
      >>> compiled_bytes(jax.jit(f).lower(x).compile())
    """
    m = compiled.memory_analysis()
    if m is None:
        return None
    return float(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                 - m.alias_size_in_bytes)


@dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of a compiled program and how often one run executes it."""

    name: str                               # the HLO instruction (the `-start` of a pair)
    kind: str                               # one of KINDS
    bytes: int                              # per device, one execution (see the module doc)
    count: int                              # executions per run of the program
    groups: tuple[tuple[int, ...], ...] | None  # device groups; None: unreadable (all devices)
    pairs: tuple[tuple[int, int], ...] = ()     # a collective-permute's (source, target) pairs
    widened: int = 0  # of `bytes`, at most this was added by widening 16-bit floats to f32
                      # (XLA:CPU; see the module doc)

    def times(self, k: int) -> CollectiveOp:
        return replace(self, count=self.count * k)


def collective_ops(compiled: Any) -> list[CollectiveOp]:
    """Every collective of a compiled program that moves data, with its device groups.

    The same instructions `collective_stats` sums by kind, one entry per instruction and call
    site (a computation called twice gives two entries), in program order. Device ids are
    partition ids: the position of the device in the flattened mesh.

    Example:
      >>> [(op.kind, op.bytes, op.count) for op in collective_ops(compiled)]
      [('all-reduce', 4096, 1)]
    """
    return module_collectives(program_module(compiled))


def program_module(compiled: Any, where: str = "collective_stats"):
    """The parsed HLO module (_hlo.parse_module) of a compiled program or its HLO text; a
    ValueError naming `where` (the caller) for text that holds no HLO module."""
    text = _hlo_text(compiled, where)
    try:
        return parse_module(text)
    except ValueError as err:
        raise ValueError(f"{where}: compiled={text[:40]!r}...: {err}; pass a compiled program "
                         "or its `as_text()`.") from None


def program_devices(compiled: Any, module) -> int | None:
    """How many devices a compiled program (`module`: its parsed HLO) runs on: the HLO's
    partition or replica count; a compiled program whose HLO names none runs on one device
    (XLA writes num_partitions only past one). None for HLO text that names none (text
    written otherwise than by as_text() may leave it out)."""
    if module.num_devices is not None:
        return module.num_devices
    return None if isinstance(compiled, str) else 1


def module_collectives(module) -> list[CollectiveOp]:
    """collective_ops of a parsed module (_hlo.parse_module)."""
    return list(_comp_ops(module, module.entry, {}))


def _comp_ops(mod: Module, comp: str, memo: dict[str, Ops]) -> Ops:
    """Collectives one execution of `comp` runs, callees included (memoised per computation)."""
    if comp in memo:
        return memo[comp]
    memo[comp] = ()  # a (malformed) recursive call graph counts the cycle once
    out: list[CollectiveOp] = []
    for ins in mod.comps.get(comp, []):
        out += _collectives(mod, comp, ins)
        for ops, times in _called(mod, ins, memo):
            out += [op.times(times) for op in ops]
    memo[comp] = tuple(out)
    return memo[comp]


def stats_by_kind(ops: Iterable[CollectiveOp]) -> Stats:
    """collective_stats of collectives already listed (collective_ops): {kind: {"count",
    "bytes"}}, bytes summed over executions, in `KINDS` order."""
    out: Stats = {}
    for op in ops:
        slot = out.setdefault(op.kind, {"count": 0, "bytes": 0})
        slot["count"] += op.count
        slot["bytes"] += op.bytes * op.count
    return {k: out[k] for k in KINDS if k in out}


def _called(mod: Module, ins: Instr, memo: dict[str, Ops]) -> list[tuple[Ops, int]]:
    """(collectives of a called computation, how many times `ins` runs it) for each callee."""
    if ins.opcode == "while":
        trip = ins.trip_count() or 1
        return ([(_comp_ops(mod, c, memo), trip) for c in ins.attr_names("body")]
                + [(_comp_ops(mod, c, memo), trip + 1) for c in ins.attr_names("condition")])
    if ins.opcode == "conditional":
        names = (ins.attr_names("branch_computations") or ins.attr_names("true_computation")
                 + ins.attr_names("false_computation"))
        return [(max((_comp_ops(mod, c, memo) for c in names), key=_weight, default=()), 1)]
    if ins.opcode in _NO_DESCENT or ins.opcode.endswith("-done"):
        return []
    # `to_apply` is a call's body, but a reduction's combiner everywhere else.
    keys = ("to_apply",) if ins.opcode == "call" else ("calls", "called_computations")
    return [(_comp_ops(mod, c, memo), 1) for k in keys for c in ins.attr_names(k)]


def _weight(ops: Ops) -> tuple[int, int]:
    return (sum(op.bytes * op.count for op in ops), sum(op.count for op in ops))


def _collectives(mod: Module, comp: str, ins: Instr) -> list[CollectiveOp]:
    """`ins` as CollectiveOps run once, [] when it is no collective or moves nothing; a tuple
    all-reduce may give two (see `_split_sliced`)."""
    kind = ins.opcode if ins.opcode in KINDS else _ALIASES.get(ins.opcode)
    if kind is None or _moves_nothing(mod, ins, kind):
        return []
    groups = replica_groups(ins.attrs, mod.num_devices)
    op = CollectiveOp(ins.name, kind, shape_bytes(_result_type(mod, comp, ins)), 1,
                      None if groups is None else tuple(map(tuple, groups)))
    if kind == "all-reduce":
        return _split_sliced(mod, comp, ins, op, _widened(ins))
    if kind == "reduce-scatter":
        operands = sum(shape_bytes(mod.type_of(comp, o)) for o in ins.operands)
        return [replace(op, bytes=max(op.bytes * (len(groups[0]) if groups else 1), operands))]
    if _carries_16bit(mod, comp, ins):
        op = replace(op, widened=op.bytes // 2)
    if kind == "collective-permute":
        return [replace(op, pairs=tuple(source_target_pairs(ins.attrs)))]
    return [op]


def _split_sliced(mod: Module, comp: str, ins: Instr, op: CollectiveOp,
                  wide: bool) -> list[CollectiveOp]:
    """An all-reduce as the reduce-scatter of the elements every use slices and the all-reduce
    of the others (XLA's combiner merges a step's gradient reductions into one tuple); wide:
    whether XLA:CPU may have widened its elements from 16 bits (_widened)."""
    elements = tuple_elements(ins.type)
    users = mod.users(comp, ins.name)
    if not ins.type.lstrip().startswith("(") or not all(
            u.opcode == "get-tuple-element" for u in users):
        wide = wide or (_float32(ins.type) and _to_16bit(mod, comp, ins.name))
        op = replace(op, widened=op.bytes // 2 if wide else 0)
        return [replace(op, kind="reduce-scatter") if _only_sliced(mod, comp, ins.name) else op]
    uses: dict[int, list[Instr]] = {}
    for u in users:
        uses.setdefault(u.int_attr("index"), []).append(u)
    sliced = [bool(uses.get(i)) and all(_only_sliced(mod, comp, u.name) for u in uses[i])
              for i in range(len(elements))]
    # An element is widened when the reducer is (every one is), or when every use converts
    # it to a 16-bit float: the gradient of a bf16 matmul, which XLA:CPU computes in f32 and
    # reduces before converting back, under a reducer of its own.
    narrow = [wide or (_float32(e) and bool(uses.get(i)) and
                       all(_to_16bit(mod, comp, u.name) for u in uses[i]))
              for i, e in enumerate(elements)]
    parts = {"all-reduce": [i for i, s in enumerate(sliced) if not s],
             "reduce-scatter": [i for i, s in enumerate(sliced) if s]}
    return [replace(op, kind=k, bytes=sum(shape_bytes(elements[i]) for i in es),
                    widened=sum(shape_bytes(elements[i]) // 2 for i in es if narrow[i]))
            for k, es in parts.items() if es]


def _widened(ins: Instr) -> bool:
    """Whether XLA:CPU widened an all-reduce from 16-bit floats to float32: its reducer is a
    `*_promoted` clone (float normalization names it so)."""
    return any(name.endswith("_promoted") for name in ins.attr_names("to_apply"))


def _carries_16bit(mod: Module, comp: str, ins: Instr) -> bool:
    """Whether XLA:CPU widened the 16-bit floats a data-moving collective (all-gather,
    all-to-all, collective-permute) carries to float32: its result is float32 and every
    operand is a convert from a 16-bit float, or every use converts it back to one (directly,
    through bitcasts, reshapes, copies and tuple elements, or as what a fusion does with it
    first)."""
    if not all(_float32(t) for t in tuple_elements(_result_type(mod, comp, ins))):
        return False
    operands = [o for o in ins.operands if mod.type_of(comp, o)]
    if operands and all(_from_16bit(mod, comp, o) for o in operands):
        return True
    return _to_16bit(mod, comp, ins.name)


def _float32(type_text: str) -> bool:
    return type_text.lstrip().startswith("f32[")


def _is_16bit(type_text: str) -> bool:
    return type_text.lstrip().startswith(("bf16[", "f16["))


def _from_16bit(mod: Module, comp: str, value: str) -> bool:
    """`value` is a float32 convert of a 16-bit float (directly, through pass-through ops, or
    as a fusion's root)."""
    ins = mod.instr(comp, value)
    if ins is None:
        return False
    if ins.opcode == "convert":
        return bool(ins.operands) and _is_16bit(mod.type_of(comp, ins.operands[0]))
    if ins.opcode in _PASS_THROUGH - {"get-tuple-element"} and ins.operands:
        return _from_16bit(mod, comp, ins.operands[0])
    if ins.opcode == "fusion" and ins.attr_names("calls"):
        fused = ins.attr_names("calls")[0]
        root = mod.root(fused)
        return root is not None and _from_16bit(mod, fused, root.name)
    return False


def _to_16bit(mod: Module, comp: str, value: str) -> bool:
    """Every use of `value` converts it to a 16-bit float (directly, through pass-through ops,
    or as the first thing a fusion does with it)."""
    return _every_use(mod, comp, value,
                      lambda user, _: user.opcode == "convert" and _is_16bit(user.type))


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
    """Every use of `value` in `comp` dynamic-slices it (the CPU reduce-scatter pattern),
    through converts too: XLA:CPU converts an all-reduce it widened from 16-bit floats back
    to them before slicing (and the slicing fusion may convert to float32 again)."""
    return _every_use(mod, comp, value, lambda user, v: user.opcode == "dynamic-slice" and
                      user.operands[0] == v and v not in user.operands[1:],
                      _PASS_THROUGH | {"convert"})


def _every_use(mod: Module, comp: str, value: str, does, through=_PASS_THROUGH,
               out: tuple[str, str] | None = None) -> bool:
    """Every use of `value` in `comp` is one that `does(user, value)` accepts: directly,
    through `through` ops (bitcast, reshape, copy, get-tuple-element), or as the first thing
    a fusion does with its parameter. `out`: (computation, fusion) when `comp` is that
    fusion's body: a value that is its ROOT is used as the fusion's result (a fusion that
    only converts or reshapes passes its operand on)."""
    users = mod.users(comp, value)
    if out is not None and mod.roots.get(comp) == value:
        return all(_use_does(mod, comp, value, u, does, through, out) for u in users) and \
            _every_use(mod, *out, does, through)
    return bool(users) and all(_use_does(mod, comp, value, u, does, through, out) for u in users)


def _use_does(mod: Module, comp: str, value: str, user: Instr, does, through, out) -> bool:
    if does(user, value):
        return True
    if user.opcode in through:
        return _every_use(mod, comp, user.name, does, through, out)
    if user.opcode != "fusion" or not user.attr_names("calls"):
        return False
    fused = user.attr_names("calls")[0]
    params = [mod.parameter(fused, i) for i, o in enumerate(user.operands) if o == value]
    return all(p is not None and _every_use(mod, fused, p.name, does, through, (comp, user.name))
               for p in params)


def memory_stats(compiled: Any) -> dict[str, int]:
    """Memory of a compiled program per device, in bytes, from `compiled.memory_analysis()`.

    Returns:
      {"argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "generated_code_bytes",
      "peak_bytes"}; peak is arguments + outputs + temporaries - aliased bytes (what
      compiled_bytes gives), or XLA's own peak figure where that is larger. `{}` when the
      backend has no memory analysis.

    Example:
      >>> memory_stats(jax.jit(f).lower(x).compile())["peak_bytes"]
    """
    if not callable(getattr(compiled, "memory_analysis", None)):
        raise TypeError(f"compiled={type(compiled).__name__}: expected a compiled program "
                        "(`jax.jit(f).lower(*args).compile()`).")
    m = compiled.memory_analysis()
    m = m[0] if isinstance(m, (list, tuple)) and m else m
    if m is None or not hasattr(m, "temp_size_in_bytes"):
        return {}
    keys = ("argument", "output", "alias", "temp", "generated_code")
    out = {f"{k}_bytes": int(getattr(m, f"{k}_size_in_bytes", 0)) for k in keys}
    estimate = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    # The runtime allocates the temporaries as one block held for the whole run, beside the
    # arguments and outputs: the estimate is what a run holds. XLA's peak_memory_in_bytes
    # leaves them out on XLA:CPU (jaxlib 0.10.2: arguments + outputs - aliased, 4.2 MB for a
    # program that allocates 12.6 MB); the larger of the two is kept where a backend counts
    # more than the estimate.
    out["peak_bytes"] = max(int(getattr(m, "peak_memory_in_bytes", 0) or 0), estimate)
    return out


def flops(compiled: Any) -> float:
    """Floating-point operations per device of a compiled program: XLA's cost analysis, plus
    the matmuls it cannot see, those XLA hands to a library as custom calls (cuBLAS on a GPU:
    a GPT step's large matmuls; its cost analysis counted 0.185 of 3.1 TFLOP on an H100).

    `compiled.cost_analysis()` is a dict in current JAX and a list of dicts (one per module) in
    older ones; the list is summed. 0.0 when the backend gives no estimate.

    Example:
      >>> flops(jax.jit(jnp.dot).lower(a, b).compile())
    """
    return _cost_sum(compiled, "flops") + library_gemm_flops(program_module(compiled, "flops"))


# Custom calls XLA's GPU backend emits for a dot (cuBLAS, cuBLASLt, its fp8 variant).
_GEMM_TARGETS = re.compile(r'custom_call_target="__cublas\$(?:gemm|lt\$matmul(?:\$f8)?)"')
_LHS_CONTRACTING = re.compile(r'lhs_contracting_dimensions\\?"\s*:\s*\[([^\]]*)\]')


def library_gemm_flops(module: Module) -> float:
    """2 x result elements x contracted size of every library GEMM custom call, once per
    instruction (as XLA's cost analysis counts a loop body once)."""
    total = 0.0
    for comp, body in module.comps.items():
        for ins in body:
            if ins.opcode != "custom-call" or not _GEMM_TARGETS.search(ins.attrs):
                continue
            m = _LHS_CONTRACTING.search(ins.attrs)
            lhs = shape_dims(module.type_of(comp, ins.operands[0])) if ins.operands else ()
            if m is None or not lhs:
                continue
            k = math.prod(lhs[int(d)] for d in re.findall(r"\d+", m.group(1)))
            total += 2.0 * math.prod(shape_dims(ins.type)) * k
    return total


def _cost_sum(compiled: Any, key: str) -> float:
    """One figure of XLA's per-device cost analysis, summed over modules (0.0 when absent)."""
    cost = compiled.cost_analysis()
    entries = cost if isinstance(cost, (list, tuple)) else [cost]
    return float(sum(max(float((c or {}).get(key, 0.0)), 0.0) for c in entries))


# ---- time under a hardware profile -----------------------------------------------------------

def estimate_time(compiled: Any, mesh: Mesh | MeshInfo,
                  hardware: str | HardwareProfile | None) -> dict[str, Any]:
    """Seconds one run of a compiled program takes per device on `hardware`, read from its HLO.

    What it prices is what XLA compiled, not what a plan predicted:
    - compute: from XLA's per-device cost analysis (plus the library GEMM custom calls it
      leaves out, see `flops`), flops / peak_flops ("flop_s"), and with a
      profile of `compute_time: roofline` the larger of that and bytes accessed /
      memory_bandwidth ("memory_s", always reported; on CPU it is inflated: XLA's CPU backend
      fuses less than a GPU or TPU one). The planner prices compute the same way. XLA's cost
      analysis counts a while body once, so a program with loops gets its compute
      underestimated (a note says so); the communication of loops is counted in full.
    - communication: every collective of `collective_ops`, each execution priced by
      `jaxpar.cost.comm.collective_time` (the alpha-beta model the planner uses) over the mesh
      axes its device groups span. Device (partition) id p sits at `np.unravel_index(p, sizes)`
      of the mesh, the order jax.jit assigns a NamedSharding's devices in; a group spans the
      axes along which its devices' coordinates differ. A group that covers only part of
      those axes (a sub-axis, a strided subset) is priced as one axis of the group's size on
      the slowest of their links. Of a collective's groups the slowest one counts; a
      collective-permute spans the axes its sources and targets differ in.
    - total: compute + communication, nothing overlapped: an upper bound for a runtime that
      overlaps collectives with compute.

    Args:
      compiled: a `jax.stages.Compiled` (HLO text is accepted too; it has no cost analysis,
        so compute counts only library GEMMs, and a note says so).
      mesh: the mesh it was compiled for (a `jax.sharding.Mesh` or a `MeshInfo`).
      hardware: a profile name (`"h100-nvlink"`), a YAML path or a `HardwareProfile`.

    Returns:
      {"hardware", "mesh", "flops", "bytes_accessed", "flop_s", "memory_s", "compute_s",
      "comm_bytes", "comm_s", "total_s", "collectives": {kind: {"count", "bytes", "seconds"}},
      "notes": [str]}; seconds and bytes per device.

    Example:
      >>> t = estimate_time(jax.jit(step).lower(*args).compile(), mesh, "h100-nvlink")
      >>> t["compute_s"], t["comm_s"], t["collectives"]["all-reduce"]["seconds"]
    """
    if not isinstance(mesh, MeshInfo | Mesh | AbstractMesh):
        raise TypeError(f"estimate_time: mesh={mesh!r} must be the jax.sharding.Mesh (or "
                        "MeshInfo) the program was compiled for, e.g. jaxpar.make_mesh(8).")
    info = mesh if isinstance(mesh, MeshInfo) else MeshInfo.of(mesh)
    profile = load_profile(hardware)
    module = program_module(compiled, "estimate_time")
    devices = program_devices(compiled, module)
    if devices is not None and devices != info.size:
        raise ValueError(f"estimate_time: the program runs on {devices} devices but "
                         f"mesh={info.describe()} has {info.size}; pass the mesh it was compiled "
                         "for.")
    comm, notes = _comm_times(list(_comp_ops(module, module.entry, {})), info, profile), []
    text = isinstance(compiled, str)
    gemm = library_gemm_flops(module)
    n_flops = gemm + (0.0 if text else _cost_sum(compiled, "flops"))
    n_bytes = 0.0 if text else _cost_sum(compiled, "bytes accessed")
    if text:
        notes.append("HLO text has no cost analysis: compute counts only library GEMMs")
    if gemm:
        notes.append(f"{gemm:.4g} flops of library GEMM custom calls (cuBLAS), which XLA's "
                     "cost analysis leaves out, are added")
    loops = sum(i.trip_count() != 1 for body in module.comps.values() for i in body
                if i.opcode == "while")
    if loops:
        notes.append(f"XLA's cost analysis counts a while body once: compute leaves out the "
                     f"repeated iterations of {loops} loop(s)")
    flop_s, memory_s = n_flops / profile.peak_flops, n_bytes / profile.memory_bandwidth
    compute_s = profile.compute_seconds(n_flops, n_bytes)
    comm_s = sum(v["seconds"] for v in comm.values())
    return {"hardware": profile.name, "mesh": info.describe(), "flops": n_flops,
            "bytes_accessed": n_bytes, "flop_s": flop_s, "memory_s": memory_s,
            "compute_s": compute_s,
            "comm_bytes": float(sum(v["bytes"] for v in comm.values())), "comm_s": comm_s,
            "total_s": compute_s + comm_s, "collectives": comm, "notes": notes}


def _comm_times(ops: list[CollectiveOp], mesh: MeshInfo,
                profile: HardwareProfile) -> dict[str, dict[str, float]]:
    """{kind: {"count", "bytes", "seconds"}} of the collectives, priced on the profile's links."""
    links = profile.axis_links(mesh)
    out: dict[str, dict[str, float]] = {}
    for op in ops:
        slot = out.setdefault(op.kind, {"count": 0, "bytes": 0, "seconds": 0.0})
        slot["count"] += op.count
        slot["bytes"] += op.bytes * op.count
        slot["seconds"] += _op_time(op, mesh, links)
    return {k: out[k] for k in KINDS if k in out}


def _op_time(op: CollectiveOp, mesh: MeshInfo, links: dict[str, Link]) -> float:
    """Seconds for every execution of `op`: its slowest device group (see `estimate_time`)."""
    if op.kind == "collective-permute":
        axes = collective_axes(op, mesh)
        spans = {(axes, mesh.group_size(axes))}
    else:
        groups = op.groups or (tuple(range(mesh.size)),)
        spans = {(_axes_of(g, mesh), len(g)) for g in groups}
    return max(_group_time(op, axes, n, mesh, links) for axes, n in spans)


def _group_time(op: CollectiveOp, axes: tuple[str, ...], n: int, mesh: MeshInfo,
                links: dict[str, Link]) -> float:
    c = Collective(op.kind, axes, op.bytes * op.count, op.count)
    if mesh.group_size(axes) == n or op.kind == "collective-permute":
        return collective_time(c, mesh, links)
    # Part of the axes it spans: one axis of the group's own size, on their slowest link.
    slowest = Link("+".join(axes), min(links[a].bandwidth for a in axes),
                   max(links[a].latency for a in axes),
                   "ring" if any(links[a].topology == "ring" for a in axes) else "switch")
    return collective_time(replace(c, axes=("group",)), MeshInfo(("group",), (n,)),
                           {"group": slowest})


def collective_axes(op: CollectiveOp, mesh: MeshInfo) -> tuple[str, ...]:
    """The mesh axes a compiled collective spans, in mesh order: those along which the devices
    of one of its groups differ (a collective-permute: those of a source and its target), the
    links it runs on (estimate_time's); every axis where the HLO lists no groups.

    Example:
      >>> [(op.kind, collective_axes(op, MeshInfo.of(mesh))) for op in collective_ops(c)]
      [('collective-permute', ('d0', 'd1'))]
    """
    spans = op.pairs if op.kind == "collective-permute" else op.groups
    if not spans:
        return mesh.names
    found = {a for devices in spans for a in _axes_of(tuple(devices), mesh)}
    return tuple(a for a in mesh.names if a in found)


def _axes_of(devices: tuple[int, ...], mesh: MeshInfo) -> tuple[str, ...]:
    """Mesh axes along which the coordinates of `devices` (partition ids) differ."""
    coords = np.unravel_index(np.asarray(devices, dtype=np.int64), mesh.sizes)
    return tuple(n for n, c in zip(mesh.names, coords, strict=True) if len(np.unique(c)) > 1)
