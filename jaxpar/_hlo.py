"""HLO text -> computations of instructions: the parsing half of `jaxpar.analysis`.

Before: the text XLA prints for a module (`compiled.as_text()`, one instruction per line; an
instruction broken over several lines, as in XLA's own tests, is joined back). After: a `Module`
of computations, each an ordered list of `Instr` with its result type, opcode, operand names and
the attribute text, plus readers for the attributes that matter to collectives: replica groups
(explicit, iota and mesh-axes forms), source-target pairs, while-loop trip counts and integer
attributes (a get-tuple-element's index). No semantics live here: what counts as a collective
and how many bytes it moves is `analysis.py`.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

# Bits per element of every HLO primitive type; sub-byte types take a byte each unless the layout
# packs them (`E(4)`), as XLA's ShapeUtil::ByteSizeOf does.
_DTYPE_BITS = {"pred": 8, "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
               "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32,
               "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128, "f4e2m1fn": 4,
               "f8e8m0fnu": 8, "f8e4m3fn": 8, "f8e5m2": 8, "f8e4m3": 8, "f8e3m4": 8,
               "f8e4m3b11fnuz": 8, "f8e4m3fnuz": 8, "f8e5m2fnuz": 8}
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_PACKED = re.compile(r"E\((\d+)\)")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{$")
# `name = ` then a type or an opcode: attribute lines of a broken instruction (`dimensions={0}`)
# never match.
_NAME = re.compile(r"^(?:ROOT\s+)?%?([^\s=(){},]+)\s*=\s*(?=\(|[a-z][a-z0-9]*\[|[a-z][\w\-]*\()")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_MODULE_INT = re.compile(r"\b(num_partitions|replica_count)=(\d+)")
_TRIP = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"(\d+)')
_INTS = re.compile(r"-?\d+")


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in `text` (a tuple type sums its elements).

    Example:
      >>> shape_bytes("(f32[8]{0}, bf16[2,4]{1,0})")
      48
    """
    total = 0
    for dtype, dims, layout in _SHAPE.findall(text):
        bits = _DTYPE_BITS.get(dtype)
        if bits is None:
            continue
        n = math.prod(int(d) for d in _dims(dims) if d.isdigit())
        packed = _PACKED.search(layout)
        total += -(-n * int(packed.group(1)) // 8) if packed else n * max(bits // 8, 1)
    return total


def shape_dims(type_text: str) -> tuple[int, ...]:
    """Dimensions of the first array shape written in `type_text` (() when there is none).

    Example:
      >>> shape_dims("(f32[8192,3072]{1,0}, s8[33554432]{0})")
      (8192, 3072)
    """
    m = _SHAPE.search(type_text)
    return tuple(int(d) for d in _dims(m.group(2))) if m and m.group(2) else ()


def _dims(text: str) -> list[str]:
    """The sizes written between a shape's brackets; `<=8` (a bounded dynamic dim) is 8."""
    return [d.removeprefix("<=") for d in text.split(",")]


def split_top(text: str, sep: str = ",") -> list[str]:
    """`text` cut at every `sep` outside brackets, braces and parentheses, pieces stripped."""
    pieces, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            pieces.append(text[start:i].strip())
            start = i + 1
    last = text[start:].strip()
    return pieces + [last] if last or pieces else pieces


def tuple_elements(type_text: str) -> list[str]:
    """Top-level element types of a tuple type; a non-tuple type is its only element."""
    t = re.sub(r"/\*.*?\*/", "", type_text).strip()
    return split_top(t[1:-1]) if t.startswith("(") else [t]


@dataclass(frozen=True)
class Instr:
    """One HLO instruction: `name = type opcode(operands), attrs`."""

    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str

    def attr_names(self, key: str) -> list[str]:
        """Computation names in attribute `key` (`calls=%f`, `branch_computations={%a, %b}`)."""
        m = re.search(rf"(?<![\w\-]){key}=(\{{[^}}]*\}}|%?[\w.\-]+)", self.attrs)
        return [] if not m else [n.lstrip("%") for n in split_top(m.group(1).strip("{}")) if n]

    def int_attr(self, key: str) -> int | None:
        """An integer attribute (`index=2` of a get-tuple-element), None when absent."""
        m = re.search(rf"(?<![\w\-]){key}=(-?\d+)", self.attrs)
        return int(m.group(1)) if m else None

    def trip_count(self) -> int | None:
        """A while loop's `known_trip_count` from its backend_config, None when XLA gave none."""
        m = _TRIP.search(self.attrs)
        return int(m.group(1)) if m else None


@dataclass
class Module:
    """Computations by name (instructions in order), the entry's name and the device count."""

    comps: dict[str, list[Instr]]
    entry: str
    num_devices: int | None = None
    roots: dict[str, str] = field(default_factory=dict)  # computation -> its ROOT's name
    _users: dict[str, dict[str, list[Instr]]] = field(default_factory=dict, repr=False)

    def users(self, comp: str, value: str) -> list[Instr]:
        """Instructions of computation `comp` that take `value` as an operand."""
        if comp not in self._users:
            table: dict[str, list[Instr]] = {}
            for ins in self.comps.get(comp, []):
                for op in dict.fromkeys(ins.operands):
                    table.setdefault(op, []).append(ins)
            self._users[comp] = table
        return self._users[comp].get(value, [])

    def parameter(self, comp: str, index: int) -> Instr | None:
        """The `parameter(index)` instruction of `comp`."""
        return self._params.get((comp, index))

    @cached_property
    def _params(self) -> dict[tuple[str, int], Instr]:
        return {(c, int(i.operands[0])): i for c, body in self.comps.items() for i in body
                if i.opcode == "parameter" and i.operands and i.operands[0].isdigit()}

    def instr(self, comp: str, value: str) -> Instr | None:
        """Instruction `value` of computation `comp` (None if there is none)."""
        return self._instrs.get((comp, value))

    @cached_property
    def _instrs(self) -> dict[tuple[str, str], Instr]:
        return {(c, i.name): i for c, body in self.comps.items() for i in body}

    def root(self, comp: str) -> Instr | None:
        """The ROOT instruction of `comp` (None if the text marks none)."""
        return self.instr(comp, self.roots.get(comp, ""))

    def type_of(self, comp: str, value: str) -> str:
        """Result type of instruction `value` of computation `comp` ("" if there is none)."""
        return self._types.get((comp, value), "")

    @cached_property
    def _types(self) -> dict[tuple[str, str], str]:
        return {(c, i.name): i.type for c, body in self.comps.items() for i in body}


def parse_instr(line: str) -> Instr | None:
    """One instruction line (operands printed bare or with their types), None if it is not one."""
    m = _NAME.match(line.strip())
    if not m:
        return None
    rest = line.strip()[m.end():]
    type_text, rest = _take_type(rest)
    op = _OPCODE.match(rest)
    if not op:
        return None
    args, attrs = _take_group(rest[op.end() - 1:])
    return Instr(m.group(1), type_text, op.group(1), _operand_names(args), attrs.lstrip(", "))


def _take_type(text: str) -> tuple[str, str]:
    if text.startswith("("):
        inner, rest = _take_group(text)
        return f"({inner})", rest
    if _OPCODE.match(text):  # no type printed: `ROOT t = tuple(a, b)`
        return "", text
    head, _, tail = text.partition(" ")
    return head, tail


def _take_group(text: str) -> tuple[str, str]:
    """Split `(...)rest` at the parenthesis matching the first one: (inside, rest)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0:
            return text[1:i], text[i + 1:].strip()
    return text[1:], ""


def _operand_names(args: str) -> tuple[str, ...]:
    names = []
    for piece in split_top(args):
        token = re.sub(r"/\*.*?\*/", "", piece).split()
        names.append(token[-1].lstrip("%") if token else "")
    return tuple(names)


def parse_module(text: str) -> Module:
    """Computations of an HLO module's text. The entry is the `ENTRY` one (else the last)."""
    comps: dict[str, list[Instr]] = {}
    roots: dict[str, str] = {}
    entry, current, pending = None, None, ""
    first = re.search(r"^\s*HloModule.*$", text, re.MULTILINE)
    num = {k: int(v) for k, v in _MODULE_INT.findall(first.group() if first else "")}
    for raw in text.splitlines():
        line = raw.strip()
        header = _HEADER.match(line) if "=" not in line.split("(")[0] else None
        if header or line.startswith("}") or _NAME.match(line) or not line:
            _flush(comps, current, pending, roots)
            pending = ""
        if header:
            current = header.group(2)
            comps[current] = []
            entry = current if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None and line:
            pending = f"{pending} {line}" if pending else line
    _flush(comps, current, pending, roots)
    if not comps:
        raise ValueError("no HLO computation found in the text")
    devices = max(num.values()) if num else None
    return Module(comps, entry or list(comps)[-1], devices, roots)


def _flush(comps: dict[str, list[Instr]], current: str | None, pending: str,
           roots: dict[str, str]) -> None:
    ins = parse_instr(pending) if pending and current is not None else None
    if ins is not None:
        comps[current].append(ins)
        if pending.startswith("ROOT"):
            roots[current] = ins.name


# ---- replica groups --------------------------------------------------------------------------

def replica_groups(attrs: str, num_devices: int | None = None) -> list[list[int]] | None:
    """Device groups of a collective's `replica_groups=` attribute, in any of XLA's forms.

    Explicit `{{0,1},{2,3}}`; empty `{}` (all `num_devices` in one group); iota
    `[4,2]<=[8]`, `[2,4]<=[4,2]T(1,0)`; mesh axes
    `mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}`, sub-axes written `'b':(1)2`.
    None when the attribute is absent or unreadable.

    Example:
      >>> replica_groups("replica_groups=[2,4]<=[4,2]T(1,0)")
      [[0, 2, 4, 6], [1, 3, 5, 7]]
    """
    m = re.search(r"replica_groups=(.*)", attrs)
    if not m:
        return None
    text = m.group(1)
    if text.startswith("{"):
        inner, _ = _take_group(text)
        groups = [[int(x) for x in _INTS.findall(g)] for g in split_top(inner)]
        groups = [g for g in groups if g]
        return groups or ([list(range(num_devices))] if num_devices else None)
    if text.startswith("["):
        return _iota_groups(text)
    if text.startswith("mesh["):
        return _mesh_groups(text)
    if text.startswith("maximal_mesh["):
        return [[int(_INTS.search(text).group())]]
    return None


def _iota(text: str) -> tuple[np.ndarray, str] | None:
    """`[d0,d1]T(p0,p1)...`: iota over prod(d) reshaped to d and transposed; and the rest."""
    m = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if not m:
        return None
    dims = [int(d) for d in m.group(1).split(",")]
    perm = [int(p) for p in m.group(2).split(",")] if m.group(2) else list(range(len(dims)))
    return np.arange(math.prod(dims)).reshape(dims).transpose(perm), text[m.end():]


def _iota_groups(text: str) -> list[list[int]] | None:
    m = re.match(r"\[(\d+),(\d+)\]<=", text)
    ids = _iota(text[m.end():]) if m else None
    if ids is None:
        return None
    return ids[0].reshape(int(m.group(1)), int(m.group(2))).tolist()


def _mesh_groups(text: str) -> list[list[int]] | None:
    m = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^{]*)\))?\s*\{([^}]*)\}", text)
    if not m:
        return None
    axes = [(n.strip("'\" "), int(s)) for n, s in (a.split("=") for a in split_top(m.group(1)))]
    sizes = [s for _, s in axes]
    devices = _device_ids(m.group(2), math.prod(sizes))
    if devices is None:
        return None
    refs = [_axis_ref(r) for r in split_top(m.group(3)) if r]
    names = [n for n, _ in axes]
    if None in refs or any(r[0] not in names for r in refs):
        return None
    return _group_devices(devices.reshape(sizes), names, refs)


def _device_ids(text: str | None, n: int) -> np.ndarray | None:
    """A mesh's device order: iota (absent), iota-with-transpose `[2,4]T(1,0)` or a list."""
    if not text:
        return np.arange(n)
    iota = _iota(text.strip())
    if iota is not None and not iota[1].strip():
        return iota[0].reshape(-1)
    ids = [int(x) for x in _INTS.findall(re.sub(r"^\[[\d,]+\]", "", text.strip()))]
    return np.array(ids) if len(ids) == n else None


def _axis_ref(text: str) -> tuple[str, int, int | None] | None:
    """`'b'` or `'b':(2)2` -> (name, pre_size, size); size None for the whole axis."""
    m = re.match(r"""['"]?([^'":]+)['"]?(?::\((\d+)\)(\d+))?$""", text.strip())
    if not m:
        return None
    return m.group(1), int(m.group(2) or 1), int(m.group(3)) if m.group(3) else None


def _group_devices(mesh: np.ndarray, names: list[str],
                   refs: list[tuple[str, int, int | None]]) -> list[list[int]]:
    # Cut each mesh axis (major to minor) at the boundaries of its referenced sub-axes: sub-axis
    # `(pre)size` is the factor that follows the first `pre` of the axis. The grouped factors go
    # last, in the order listed, so each row of the flattened array is one group (as XLA builds
    # MeshAxesReplicaGroupList::flattened_replica_groups).
    factors: list[int] = []
    covers: dict[tuple[str, int | None], list[int]] = {}
    for name, size in zip(names, mesh.shape, strict=True):
        cuts = sorted({1, size} | {c for n, pre, sub in refs if n == name and sub
                                   for c in (pre, pre * sub)})
        first = len(factors)
        for lo, hi in itertools.pairwise(cuts):
            covers[(name, lo)] = [len(factors)]
            factors.append(hi // lo)
        covers[(name, None)] = list(range(first, len(factors)))
    grouped = [i for n, pre, sub in refs for i in covers[(n, pre if sub else None)]]
    rest = [i for i in range(len(factors)) if i not in grouped]
    arr = mesh.reshape(factors).transpose(rest + grouped)
    return arr.reshape(-1, math.prod(factors[i] for i in grouped)).tolist()


def source_target_pairs(attrs: str) -> list[tuple[int, int]]:
    """The (source, target) pairs of a collective-permute."""
    m = re.search(r"source_target_pairs=(\{.*)", attrs)
    if not m:
        return []
    inner, _ = _take_group(m.group(1))
    return [(int(a), int(b)) for a, b in re.findall(r"(\d+)\s*,\s*(\d+)", inner)]
