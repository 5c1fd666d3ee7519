"""Hardware profiles: peak flops, memory and the links behind each mesh axis (YAML, one file each).

Before: a profile name, a YAML path or a HardwareProfile (`profile_from_dict` makes one of a
dict, as a YAML file reads). After: a frozen `HardwareProfile` whose
`axis_links(mesh)` says which `Link` every axis of a mesh communicates over.

Which axes cross nodes. jaxpar's meshes (`make_mesh`, `make_hybrid_mesh`) list devices node by
node: a node's devices are consecutive in the mesh's row-major order (sorted by slice, process,
device id), so the node of the device at flat position p is `p // devices_per_node`. A mesh
axis whose device groups all stay inside one node uses the `intra` link (NVLink, ICI, shared
memory); an axis with a group that spans nodes uses `inter` (InfiniBand, DCN), the slower link
setting the pace of the whole group. How many devices a node holds:
- `devices_per_node: 8` (a real cluster of 8-GPU nodes): any mesh, however many nodes it spans;
- otherwise `nodes: N`: the mesh is split evenly into N nodes (`h100-2node-ib` has nodes: 2, so
  on a (2, 4) mesh the outer axis crosses the two nodes and the inner axis stays inside one).
With row-major order the outermost axes are the ones that cross nodes.

Measured links. `axes: {name: link}` (what `jaxpar calibrate` writes) gives a mesh axis of that
name its own link, whatever its position. A link may also carry per-collective figures
(`collectives: {all-gather: {bandwidth, latency}, ...}`), read with `Link.figures(kind)`.

Compute time. `compute_time: flops` (the default) prices an op's compute as its flops over
`peak_flops`, Alpa's convention: what sets plans apart is then their communication and their
heavy ops (matmuls, convolutions), and memory-bound elementwise work, such as an optimizer
update computed on every device under data parallel, costs next to nothing. It is what
`jaxpar.estimate_time` and the benchmarks read from a compiled program (its flops).
`compute_time: roofline` prices the larger of that and the op's operand and result bytes over
`memory_bandwidth`, each op on its own (no fusion), for a machine where memory-bound work is
what a step waits on: replicated elementwise work then costs time, and plans shard the
optimizer update (ZeRO) to save it.

Bandwidths follow the bus-bandwidth convention of `jaxpar.cost.comm`: a ring all-gather of b
bytes per device over n devices takes (n-1)/n * b / bandwidth, an all-reduce twice that.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import yaml

from jaxpar.spec import MeshInfo

PROFILE_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"
TOPOLOGIES = ("switch", "ring")
COMPUTE_TIMES = ("flops", "roofline")
# What a link's `collectives` may hold: {kind: {field: number}} (jaxpar.analysis.KINDS).
COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")
COLLECTIVE_FIELDS = ("bandwidth", "latency")


@dataclass(frozen=True)
class Link:
    """One kind of interconnect."""

    name: str
    bandwidth: float          # bytes/s per device (bus bandwidth)
    latency: float            # seconds per hop
    topology: str = "switch"  # "switch" (full bisection) or "ring" (torus axis)
    # Per-collective figures where measured: {kind: {"bandwidth": ..., "latency": ...}}.
    collectives: dict[str, dict[str, float]] = field(default_factory=dict, hash=False)

    def figures(self, kind: str) -> tuple[float, float]:
        """(bandwidth, latency) for one collective kind: measured ones, else the link's.

        Example:
          >>> Link("ici", 90e9, 1e-6).figures("all-to-all")
          (90000000000.0, 1e-06)
        """
        own = self.collectives.get(kind, {})
        return float(own.get("bandwidth", self.bandwidth)), float(own.get("latency", self.latency))


@dataclass(frozen=True)
class HardwareProfile:
    """Per-device compute and memory, and the links between devices (see the module doc)."""

    name: str
    peak_flops: float         # flop/s per device
    memory_bytes: float       # HBM (or RAM) per device
    memory_bandwidth: float   # bytes/s per device
    intra: Link               # between devices of one node
    inter: Link | None = None  # between nodes (None: as intra)
    nodes: int = 1            # without devices_per_node: the mesh splits evenly into these
    devices_per_node: int = 0  # > 0: a node is this many consecutive devices of the mesh
    axes: dict[str, Link] = field(default_factory=dict, hash=False)  # measured, by axis name
    compute_time: str = "flops"  # "flops" or "roofline" (see the module doc)

    def compute_seconds(self, flops: float, nbytes: float) -> float:
        """Seconds of work of `flops` flops that read and write `nbytes` bytes (compute_time).

        Example:
          >>> p = load_profile("h100-nvlink")
          >>> p.compute_seconds(989e12, 0.0), p.compute_seconds(0.0, 3.35e12)
          (1.0, 0.0)
        """
        seconds = flops / self.peak_flops
        if self.compute_time == "roofline":
            seconds = max(seconds, nbytes / self.memory_bandwidth)
        return seconds

    def devices_in_node(self, mesh: MeshInfo) -> int:
        """How many consecutive devices of `mesh` share one node."""
        if self.devices_per_node > 0:
            if mesh.size > self.devices_per_node and mesh.size % self.devices_per_node:
                raise ValueError(
                    f"hardware profile {self.name!r}: devices_per_node={self.devices_per_node} "
                    f"does not split a mesh of {mesh.size} devices into whole nodes; use a "
                    f"multiple of {self.devices_per_node} devices (or at most "
                    f"{self.devices_per_node}), or a profile whose devices_per_node divides "
                    f"{mesh.size} or is {mesh.size} or more (a copy of this one's YAML with "
                    "that changed).")
            return min(self.devices_per_node, mesh.size)  # (a node past the mesh: all of it)
        if mesh.size > self.nodes and mesh.size % self.nodes:
            raise ValueError(f"hardware profile {self.name!r}: nodes={self.nodes} does not split "
                             f"a mesh of {mesh.size} devices evenly; use a multiple of "
                             f"{self.nodes} devices, or a profile whose nodes divides "
                             f"{mesh.size} or that gives devices_per_node (devices in each "
                             "node).")
        return max(1, mesh.size // max(1, self.nodes))

    def crossing_axes(self, mesh: MeshInfo) -> tuple[str, ...]:
        """The axes of `mesh` with a device group that spans more than one node.

        Example:
          >>> load_profile("h100-2node-ib").crossing_axes(MeshInfo(("node", "gpu"), (2, 4)))
          ('node',)
        """
        node = np.arange(mesh.size).reshape(mesh.sizes) // self.devices_in_node(mesh)
        return tuple(name for i, name in enumerate(mesh.names)
                     if mesh.sizes[i] > 1 and bool(np.any(np.ptp(node, axis=i) > 0)))

    def unknown_axes(self, mesh: MeshInfo) -> tuple[str, ...]:
        """The axes of `axes` (measured links) that `mesh` has no axis of that name for: their
        figures price nothing on it."""
        return tuple(name for name in self.axes if name not in mesh.names)

    def axis_links(self, mesh: MeshInfo) -> dict[str, Link]:
        """The link each mesh axis communicates over: its measured link (`axes`) by name, else
        `inter` when the axis crosses nodes and `intra` when it stays inside one.

        Example:
          >>> links = load_profile("h100-2node-ib").axis_links(MeshInfo(("node", "gpu"), (2, 4)))
          >>> links["node"].name, links["gpu"].name
          ('infiniband-ndr', 'nvlink4')
        """
        crossing = set(self.crossing_axes(mesh))
        outer = self.inter or self.intra
        return {name: self.axes.get(name) or (outer if name in crossing else self.intra)
                for name in mesh.names}


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(profile: str | Path | HardwareProfile | None) -> HardwareProfile:
    """A profile by name (`h100-nvlink`), by YAML path, or the default `cpu` for None.

    A bare word without a suffix is a shipped profile's name, else a file of that name; a
    suffix (`my.yaml`) or a directory part (`./calprof`, `/tmp/calprof`) makes it a path.

    Example:
      >>> load_profile("tpu-v5e").intra.topology
      'ring'
    """
    if isinstance(profile, HardwareProfile):
        return _checked(profile)
    if profile is None:
        profile = "cpu"
    if not isinstance(profile, str | Path):
        raise TypeError(f"hardware={profile!r} must be a profile name, a YAML path or a "
                        "HardwareProfile (jaxpar.cost.hardware.profile_from_dict makes one of a "
                        f"dict); profiles: {available_profiles()}.")
    path = _profile_path(profile)
    if not path.is_file():
        raise ValueError(f"hardware={str(profile)!r}: no such profile or file. Known profiles: "
                         f"{available_profiles()}, or pass the path of a YAML profile.")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, ValueError, yaml.YAMLError) as err:  # ValueError: an int of 4300+ digits
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"hardware={str(profile)!r}: cannot read {path} as a YAML profile "
                         f"({first}). Fix the file, or pass a profile name: "
                         f"{available_profiles()}.") from None
    return profile_from_dict(data, str(path))


def _checked(profile: HardwareProfile) -> HardwareProfile:
    """A HardwareProfile made in Python, checked as a YAML one is (profile_from_dict): a
    ValueError naming the field, before anything is priced with it."""
    where = f"hardware=HardwareProfile(name={_show(profile.name)})"
    try:
        data = profile_to_dict(profile)
    except (TypeError, AttributeError, ValueError, KeyError) as err:
        raise ValueError(f"{where}: malformed hardware profile ({err}).") from None
    return profile_from_dict(data, where)


def is_path(text: str) -> bool:
    """Whether a profile argument is a path whatever files exist: it has a suffix (`my.yaml`)
    or a directory part (`./calprof`); a bare word may be a profile's name."""
    return bool(Path(text).suffix) or "/" in text or os.sep in text


def _profile_path(profile: str | Path) -> Path:
    """The file a profile argument names: a bare word without a suffix ("h100-nvlink") is a
    profile of PROFILE_DIR, else a file of that name; a suffix or a directory part makes a path."""
    text = str(profile)
    if is_path(text):
        return Path(profile)
    named = PROFILE_DIR / f"{text}.yaml"
    return named if named.is_file() or not Path(text).is_file() else Path(text)


def profile_from_dict(data: dict, where: str = "profile") -> HardwareProfile:
    """Build a profile from YAML data; keys map one to one onto the dataclass fields."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a hardware profile is a mapping of "
                         f"{sorted(f.name for f in fields(HardwareProfile))}, got {data!r}.")
    known = {f.name for f in fields(HardwareProfile)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; expected {sorted(known)}.")
    try:
        data = dict(data)
        data["name"] = _name(data["name"], f"{where}: name")
        data["intra"] = _link(data["intra"], f"{where}: intra")
        if data.get("inter") is not None:
            data["inter"] = _link(data["inter"], f"{where}: inter")
        axes = data.get("axes") or {}
        if not isinstance(axes, dict):
            raise ValueError(f"{where}: axes={_show(axes)} must be a mapping of mesh axis "
                             "names to links, e.g. {data: {name: ib, bandwidth: 5.0e+10, "
                             "latency: 1.0e-5}}.")
        data["axes"] = {str(k): _link(v, f"{where}: axes.{k}") for k, v in axes.items()}
        for key in ("peak_flops", "memory_bytes", "memory_bandwidth"):
            data[key] = _number(data[key], f"{where}: {key}")
        data["nodes"] = _count(data.get("nodes", 1), f"{where}: nodes", least=1)
        data["devices_per_node"] = _count(data.get("devices_per_node", 0),
                                          f"{where}: devices_per_node")
        data["compute_time"] = data.get("compute_time", "flops")
        if data["compute_time"] not in COMPUTE_TIMES:
            raise ValueError(f"{where}: compute_time={data['compute_time']!r}; use one of "
                             f"{list(COMPUTE_TIMES)} (flops: heavy ops' flops at peak; "
                             "roofline: also memory-bound time).")
        return HardwareProfile(**data)
    except KeyError as err:
        raise ValueError(f"{where}: malformed hardware profile, missing key {err}; a profile "
                         f"has {sorted(f.name for f in fields(HardwareProfile))}.") from None
    except (TypeError, AttributeError) as err:
        raise ValueError(f"{where}: malformed hardware profile ({err}).") from None


def _name(value, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}={_show(value)} must be a non-empty string (quote it in "
                         "YAML if it reads as a number, e.g. name: \"v5e\").")
    return value


def _link(data, where: str) -> Link:
    """A Link from YAML: a mapping of {name, bandwidth, latency[, topology, collectives]}."""
    known = [f.name for f in fields(Link)]
    if not isinstance(data, dict):
        raise ValueError(f"{where}={_show(data)} must be a link, a mapping of {known}, e.g. "
                         "{name: nvlink4, bandwidth: 3.7e+11, latency: 5.0e-6}.")
    unknown = set(data) - set(known)
    missing = {"name", "bandwidth", "latency"} - set(data)
    if unknown or missing:
        raise ValueError(f"{where}: " + (f"unknown keys {sorted(map(str, unknown))}"
                                         if unknown else f"missing keys {sorted(missing)}")
                         + f"; a link has {known}.")
    topology = data.get("topology", "switch")
    if topology not in TOPOLOGIES:
        raise ValueError(f"{where}: topology={topology!r}; use one of {list(TOPOLOGIES)}.")
    return Link(_name(data["name"], f"{where}: name"),
                _number(data["bandwidth"], f"{where}: bandwidth"),
                _number(data["latency"], f"{where}: latency", zero=True), topology,
                _collectives(data.get("collectives") or {}, f"{where}: collectives"))


def _collectives(data, where: str) -> dict[str, dict[str, float]]:
    """A link's per-collective figures: {kind: {bandwidth: ..., latency: ...}}."""
    example = "e.g. {all-gather: {bandwidth: 3.0e+11, latency: 6.0e-6}}"
    if not isinstance(data, dict):
        raise ValueError(f"{where}={_show(data)} must be a mapping of collective kinds "
                         f"{list(COLLECTIVE_KINDS)} to figures, {example}.")
    out = {}
    for kind, figures in data.items():
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"{where}: unknown collective {kind!r}; use one of "
                             f"{list(COLLECTIVE_KINDS)}, {example}.")
        if not isinstance(figures, dict) or not set(figures) <= set(COLLECTIVE_FIELDS):
            raise ValueError(f"{where}.{kind}={_show(figures)} must be a mapping of "
                             f"{list(COLLECTIVE_FIELDS)} (either may be left out), {example}.")
        out[kind] = {f: _number(x, f"{where}.{kind}.{f}", zero=f == "latency")
                     for f, x in figures.items()}
    return out


MAX_LATENCY = 3600.0  # seconds: no link's latency is longer, and prices stay finite


def _number(value, where: str, zero: bool = False) -> float:
    """A float of at least 1 (non-negative with zero=True) from YAML, where 5e9 reads as a
    string."""
    try:
        x = float("nan") if isinstance(value, bool) else float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond 1.8e308
        x = float("nan")
    # A latency may be 0; a rate or a size is divided by, and below 1 (byte/s, flop/s) its
    # prices overflow to inf (1e-300 bytes/s passed, and failed deep in the search). A
    # latency is added per collective and per trip: 1e308 s overflowed to inf the same way.
    if not (x >= 0 if zero else x >= 1) or not math.isfinite(x) or (zero and x > MAX_LATENCY):
        raise ValueError(
            f"{where}={_show(value)} must be a "
            + (f"number of seconds from 0 to {MAX_LATENCY:g} (an hour), e.g. 5.0e-6."
               if zero else "finite positive number of at least 1 (bytes, bytes/s or flop/s: "
               "prices divide by it) below 1.8e+308, e.g. 5.0e+9."))
    return x


def _count(value, where: str, least: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{where}={_show(value)} must be an int of {least} or more.")
    return value


def _show(value) -> str:
    """repr(value), an int of hundreds of digits or a long list cut short."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 30:
        return f"<an int of {len(str(abs(value)))} digits>" if abs(value) < 10 ** 4000 \
            else "<an int of over 4000 digits>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def profile_to_dict(profile: HardwareProfile) -> dict:
    """The YAML data of a profile (what `profile_from_dict` reads back), empty fields left out.

    Example:
      >>> profile_from_dict(profile_to_dict(load_profile("cpu"))) == load_profile("cpu")
      True
    """
    data = asdict(profile)
    for key, empty in (("inter", None), ("axes", {}), ("devices_per_node", 0),
                       ("compute_time", "flops")):
        if data[key] == empty:
            del data[key]
    for link in [data["intra"], data.get("inter"), *data.get("axes", {}).values()]:
        if isinstance(link, dict) and "collectives" in link and not link["collectives"]:
            del link["collectives"]  # (a link given as a dict, not a Link: read as YAML's)
    return data


def save_profile(profile: HardwareProfile, path: str | Path, comment: str = "") -> Path:
    """Write a profile as YAML (with `comment` lines on top); `load_profile(path)` reads it.

    Example:
      >>> save_profile(profile, "my-cluster.yaml", "measured by jaxpar calibrate")
    """
    path = Path(path)
    head = "".join(f"# {line}\n" for line in comment.splitlines())
    path.write_text(head + yaml.safe_dump(profile_to_dict(profile), sort_keys=False))
    return path
