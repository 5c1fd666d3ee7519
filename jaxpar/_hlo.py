"""Minimal HLO text reader: collectives per computation, multiplied through while trip counts."""

from __future__ import annotations

import re

from jaxpar.analysis import KINDS, shape_bytes

_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def parse_module(text: str):
    """Yield (kind, bytes, times) for every collective in the module."""
    comps, entry = _split(text)
    mult: dict[str, int] = {}
    _visit(comps, entry, 1, mult)
    for name, body in comps.items():
        times = mult.get(name, 0)
        if times == 0:
            continue
        for line in body:
            m = _OP.match(line)
            if not m:
                continue
            _, type_text, opcode, _ = m.groups()
            kind = opcode.removesuffix("-start")
            if kind in KINDS and not opcode.endswith("-done"):
                yield kind, shape_bytes(type_text), times


def _split(text: str):
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def _visit(comps, name, times, mult) -> None:
    if name not in comps:
        return
    mult[name] = mult.get(name, 0) + times
    for line in comps[name]:
        m = _OP.match(line)
        if not m or m.group(3) in KINDS:
            continue
        trip = _TRIP.search(line)
        if m.group(3) == "while":
            body = re.search(r"body=%?([\w.\-]+)", line)
            if body:
                _visit(comps, body.group(1), times * (int(trip.group(1)) if trip else 1), mult)
            continue
        for callee in re.findall(r"(?:calls|branch_computations|to_apply)=\{?%?([\w.\-]+)", line):
            if m.group(3) != "all-reduce":
                _visit(comps, callee, times, mult)
