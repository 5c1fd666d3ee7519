"""Compiled program -> what it really communicates, read from the optimised HLO text.

`collective_stats(compiled)` counts every collective instruction of the partitioned program with
its bytes per device: the larger of its operand and result buffers (all-gather: the gathered
result; reduce-scatter: the full input; all-reduce, all-to-all, collective-permute: the buffer).
Collectives inside a while loop count once per iteration (the loop's known trip count); tuple
collectives sum their elements; async `-start`/`-done` pairs count once; on CPU, where the
partitioner writes a reduce-scatter as an all-reduce whose only users are dynamic-slices, that
all-reduce is reported as a reduce-scatter.
"""

from __future__ import annotations

import re
from collections import defaultdict

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
                "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+"
                    r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                    r"(-start)?\(")


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in `text` (a tuple type sums its elements)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in _DTYPE_BYTES:
            n = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
            total += n * _DTYPE_BYTES[dtype]
    return total


def _hlo_text(compiled) -> str:
    if isinstance(compiled, str):
        return compiled
    return compiled.as_text()


def collective_stats(compiled) -> dict[str, dict[str, int]]:
    """Collectives of a compiled program: {kind: {"count": n, "bytes": per-device bytes}}.

    Args:
      compiled: a `jax.stages.Compiled` (or its HLO text).

    Example:
      >>> stats = collective_stats(jax.jit(f).lower(x).compile())
      >>> stats.get("all-reduce", {}).get("bytes", 0)
    """
    from jaxpar._hlo import parse_module

    stats: dict[str, dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for kind, nbytes, times in parse_module(_hlo_text(compiled)):
        stats[kind]["count"] += times
        stats[kind]["bytes"] += nbytes * times
    return dict(stats)
