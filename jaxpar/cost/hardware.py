"""Hardware profiles: peak flops, memory and the links behind each mesh axis (YAML, one file each).

A profile's devices are split evenly into `nodes` groups in device order. A mesh axis whose
devices all sit inside one node uses the `intra` link; an axis that spans nodes uses `inter`.
With row-major device order the outermost axes are the ones that cross nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from jaxpar.spec import MeshInfo

PROFILE_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"


@dataclass(frozen=True)
class Link:
    """One kind of interconnect."""

    name: str
    bandwidth: float          # bytes/s per device
    latency: float            # seconds per hop
    topology: str = "switch"  # "switch" (full bisection) or "ring" (torus axis)


@dataclass(frozen=True)
class HardwareProfile:
    """Per-device compute and memory, and the links between devices."""

    name: str
    peak_flops: float         # flop/s per device
    memory_bytes: float       # HBM (or RAM) per device
    memory_bandwidth: float   # bytes/s per device
    intra: Link
    inter: Link | None = None
    nodes: int = 1            # the devices are split evenly into this many nodes

    def axis_links(self, mesh: MeshInfo) -> dict[str, Link]:
        """The link each mesh axis communicates over."""
        per_node = max(1, mesh.size // self.nodes)
        links, stride = {}, 1
        for name, size in reversed(list(zip(mesh.names, mesh.sizes, strict=True))):
            crosses = self.nodes > 1 and size * stride > per_node
            links[name] = (self.inter or self.intra) if crosses else self.intra
            stride *= size
        return links


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(profile: str | Path | HardwareProfile | None) -> HardwareProfile:
    """A profile by name (`h100-nvlink`), by YAML path, or the default `cpu` for None."""
    if isinstance(profile, HardwareProfile):
        return profile
    if profile is None:
        profile = "cpu"
    if not isinstance(profile, str | Path):
        raise TypeError(f"hardware={profile!r} must be a profile name, a YAML path or a "
                        f"HardwareProfile; profiles: {available_profiles()}.")
    path = Path(profile)
    if not path.suffix:
        path = PROFILE_DIR / f"{profile}.yaml"
    if not path.is_file():
        raise ValueError(f"hardware={str(profile)!r}: no such profile or file. Known profiles: "
                         f"{available_profiles()}, or pass the path of a YAML profile.")
    return profile_from_dict(yaml.safe_load(path.read_text()), str(path))


def profile_from_dict(data: dict, where: str = "profile") -> HardwareProfile:
    """Build a profile from YAML data; keys map one to one onto the dataclass fields."""
    known = {f.name for f in fields(HardwareProfile)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; expected {sorted(known)}.")
    try:
        data = dict(data)
        data["intra"] = Link(**data["intra"])
        if data.get("inter"):
            data["inter"] = Link(**data["inter"])
        for key in ("peak_flops", "memory_bytes", "memory_bandwidth"):
            data[key] = float(data[key])
        return HardwareProfile(**data)
    except (KeyError, TypeError) as err:
        raise ValueError(f"{where}: malformed hardware profile ({err}).") from None
