"""Device meshes with Auto axis types, on one process or across all of them.

Before: JAX's devices (after `jaxpar.init()` in a multi-process launch, `jax.devices()` lists
every process's devices). After: a `jax.sharding.Mesh` whose axes are all `AxisType.Auto`:
`make_mesh(8)`, `make_mesh((4, 2), ("dp", "tp"))`, or a hybrid mesh
`make_hybrid_mesh((1, 4), (2, 1), ("node", "gpu"))` with an outer axis across processes,
hosts or TPU slices (DCN / InfiniBand) and inner axes within one (ICI / NVLink).

Device order. Devices are sorted by (slice, process, device id) before they fill the mesh in
row-major order, so the inner (last) axes stay inside one process, host or slice and the outer
axes cross them. The cost model relies on it: a hardware profile reads a node as consecutive
devices in this order (`HardwareProfile.axis_links`), so the outer axis of a (2, 4) mesh under
`h100-2node-ib` communicates over InfiniBand and the inner one over NVLink. A single-slice TPU
mesh over all devices takes the topology-aware order of `mesh_utils.create_device_mesh`.

Running on a pod. One process per host, holding all its GPUs or TPU chips, each starting with
`jaxpar.init()` (`jaxpar.init(auto=True)` lets `jax.distributed` discover Cloud TPU, SLURM or
Open MPI clusters; on one machine `jaxpar launch -n N` starts and joins the processes). Every
process then builds the same mesh and calls the same sharded function:

    jaxpar.init(auto=True)
    # GPU nodes: NVLink inside a node (inner axis), InfiniBand across nodes (outer axis).
    mesh = jaxpar.make_hybrid_mesh((1, 8), (jax.process_count(), 1), ("node", "gpu"))
    step = jaxpar.shard(train_step, mesh=mesh, search_mode="dynamic_programming",
                        hardware="h100-ib")
    # One TPU slice: ICI spans its hosts, so a plain mesh: make_mesh((4, 4), ("dp", "tp")),
    # hardware="tpu-v5p". Two slices: make_hybrid_mesh((1, 4, 4), (2, 1, 1)) and
    # hardware="tpu-v5p-2slice".

Which profile: `h100-ib` (8 GPUs per node on NVLink, any number of nodes on InfiniBand NDR),
`h100-nvlink` (one node), `h100-2node-ib` (a mesh split in two nodes, e.g. 2 processes x 4
devices), `tpu-v5e` / `tpu-v5p` (one slice, ICI torus), `tpu-v5p-2slice` (two slices over
DCN), `cpu`; or measure the machine at hand with `jaxpar calibrate --mesh 2,8 --names
node,gpu --out my.yaml` and pass `hardware="my.yaml"`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, AxisType, Mesh

from jaxpar.distributed import check_joined

_PLATFORMS = {"CPU": "cpu", "GPU": "gpu", "TPU": "tpu"}


def prime_factors(n: int) -> list[int]:
    """Prime factors of n, largest first: 8 -> [2, 2, 2], 12 -> [3, 2, 2]."""
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    if n > 1:
        factors.append(n)
    return sorted(factors, reverse=True)


def available_platforms() -> list[str]:
    """The device kinds JAX can use here, by jaxpar's names ("CPU", "GPU", "TPU").

    Example:
      >>> available_platforms()
      ['CPU']
    """
    from jax.extend.backend import backends

    return sorted({_KINDS.get(p, p.upper()) for p in backends()})


_KINDS = {"cpu": "CPU", "gpu": "GPU", "cuda": "GPU", "rocm": "GPU", "tpu": "TPU"}


def mesh_devices(device: str | None = None) -> list:
    """Every process's devices of one platform, in mesh order: by (slice, process, id).

    Args:
      device: "CPU", "GPU", "TPU" or None for JAX's default backend.

    Returns:
      A list of `jax.Device`, inner-axis neighbours first (one process's devices together).

    Example:
      >>> [d.id for d in mesh_devices("CPU")][:4]
      [0, 1, 2, 3]
    """
    check_joined("make_mesh")
    if device is not None and device not in _PLATFORMS:
        raise ValueError(f"device={device!r} is not a platform jaxpar knows; use one of "
                         f"{sorted(_PLATFORMS)} or None for JAX's default backend.")
    try:
        devices = jax.devices(_PLATFORMS[device]) if device else jax.devices()
    except RuntimeError:
        raise ValueError(f"device={device!r}: no {device} devices are visible to JAX; available "
                         f"platforms: {available_platforms()}. Install the jaxlib plugin for "
                         f"{device} (and unset JAX_PLATFORMS if it excludes it) or pick one of "
                         "those.") from None
    return sorted(devices, key=_order_key)


def _order_key(d) -> tuple[int, int, int]:
    return (getattr(d, "slice_index", 0) or 0, d.process_index, d.id)


def make_mesh(shape: int | Sequence[int], axis_names: Sequence[str] | None = None, *,
              device: str | None = None) -> Mesh:
    """Build a device mesh with Auto axis types over the devices of every process.

    Devices fill the mesh in (slice, process, id) order, so the last axes stay inside one
    process or host (see the module docstring); a mesh smaller than the device count takes the
    first devices in that order.

    Args:
      shape: a device count, factored into prime axes (8 -> (2, 2, 2)), or an explicit shape.
      axis_names: names of the axes; default `d0, d1, ...`.
      device: "CPU", "GPU", "TPU" or None for JAX's default backend.

    Returns:
      A `jax.sharding.Mesh` whose axes are all `AxisType.Auto`.

    Example:
      >>> mesh = make_mesh(8)            # Mesh('d0': 2, 'd1': 2, 'd2': 2)
      >>> mesh = make_mesh((4, 2), ("dp", "tp"))
    """
    dims = _mesh_shape(shape)
    names = _axis_names(axis_names, dims)
    devices = _take(mesh_devices(device), math.prod(dims), "make_mesh")
    return Mesh(_grid(devices, dims), names, axis_types=(AxisType.Auto,) * len(dims))


def abstract_mesh(shape: int | Sequence[int], axis_names: Sequence[str] | None = None
                  ) -> AbstractMesh:
    """make_mesh's shape and axis names with no devices behind them: a mesh to plan for (a
    cluster larger than this machine, say), which runs nothing.

    Example:
      >>> abstract_mesh(64).axis_sizes  # (2, 2, 2, 2, 2, 2)
    """
    dims = _mesh_shape(shape)
    return AbstractMesh(dims, _axis_names(axis_names, dims, "abstract_mesh"),
                        axis_types=(AxisType.Auto,) * len(dims))


MAX_AXES = 3  # planning_shape's most axes (64 -> 4 x 4 x 4)


def planning_shape(n: int) -> tuple[int, ...]:
    """n devices as at most MAX_AXES axis sizes, smallest first: prime factors, the two
    smallest merged until few enough. The mesh jaxpar plans a device count over where no
    shape is given and no devices stand behind it (`jaxpar plan --devices 64`, a context's
    device_num beyond this machine's): each more axis multiplies every tensor's specs (a
    matmul planned over abstract_mesh(64)'s six axes of 2 took 106 s to price, over 4 x 4 x
    4 a second).

    Example:
      >>> planning_shape(64), planning_shape(16), planning_shape(8)
      ((4, 4, 4), (2, 2, 4), (2, 2, 2))
    """
    factors = sorted(prime_factors(n)) or [1]
    while len(factors) > MAX_AXES:
        factors = sorted([factors[0] * factors[1], *factors[2:]])
    return tuple(factors)


def _take(devices: list, count: int, who: str) -> list:
    if count > len(devices):
        platform = devices[0].platform
        raise ValueError(
            f"{who} asked for {count} devices but only {len(devices)} {platform} device(s) "
            "exist. For simulated CPU devices set XLA_FLAGS=--xla_force_host_platform_device_count"
            f"={count} (or jax.config.update('jax_num_cpu_devices', {count})) before JAX starts; "
            "across processes start them with `jaxpar launch` and call jaxpar.init() first.")
    return devices[:count]


def _grid(devices: list, dims: tuple[int, ...]) -> np.ndarray:
    """Devices as an array of shape dims: TPU's topology-aware order on a whole single-slice
    TPU, else row-major in the given (slice, process, id) order."""
    one_slice = len({getattr(d, "slice_index", 0) for d in devices}) == 1
    if devices[0].platform == "tpu" and one_slice and len(devices) == jax.device_count():
        try:
            return mesh_utils.create_device_mesh(dims, devices)
        except (ValueError, NotImplementedError, AssertionError):
            pass  # a shape the torus cannot hold as whole rings: plain order
    return np.array(devices, dtype=object).reshape(dims)


def make_hybrid_mesh(ici_shape: Sequence[int], dcn_shape: Sequence[int],
                     axis_names: Sequence[str] | None = None, *,
                     device: str | None = None) -> Mesh:
    """A mesh of fast links inside each granule (process, host or TPU slice) and slow ones
    between granules, as `jax.experimental.mesh_utils.create_hybrid_device_mesh` builds it.

    Axis i has size `ici_shape[i] * dcn_shape[i]`, the DCN part outermost: with
    `ici_shape=(1, 4)` and `dcn_shape=(2, 1)` axis 0 (size 2) runs across two granules and
    axis 1 (size 4) inside each. Granules are TPU slices when the devices come from several
    slices, else processes when there are several, else (one process) consecutive blocks of
    `prod(ici_shape)` devices in mesh order: simulated nodes. Axes that cross granules must
    come first (axis sizes of dcn_shape above 1 before those of ici_shape above 1; one axis may
    hold both), so that a granule is a block of consecutive devices as the cost model assumes.

    Args:
      ici_shape: axis sizes inside one granule (ICI, NVLink); their product is the devices
        per granule.
      dcn_shape: axis sizes across granules (DCN, InfiniBand), as many entries as ici_shape;
        their product is the number of granules.
      axis_names: names of the axes; default `d0, d1, ...`.
      device: "CPU", "GPU", "TPU" or None for JAX's default backend.

    Returns:
      A `jax.sharding.Mesh` with Auto axes; pair it with a profile whose nodes match the
      granules (e.g. `hardware="h100-2node-ib"` for dcn_shape (2, 1)). On a single TPU slice,
      whose ICI spans its hosts, use `make_mesh` instead.

    Example:
      >>> mesh = make_hybrid_mesh((1, 4), (2, 1), ("node", "gpu"))   # Mesh('node': 2, 'gpu': 4)
    """
    for what, shape in (("ici_shape", ici_shape), ("dcn_shape", dcn_shape)):
        if isinstance(shape, int) and not isinstance(shape, bool):
            raise TypeError(f"make_hybrid_mesh {what}={shape!r} must be a tuple of axis sizes, "
                            "e.g. ici_shape=(1, 4), dcn_shape=(2, 1).")
    ici = _mesh_shape(ici_shape, "make_hybrid_mesh ici_shape")
    dcn = _mesh_shape(dcn_shape, "make_hybrid_mesh dcn_shape")
    if len(ici) != len(dcn):
        raise ValueError(f"make_hybrid_mesh: ici_shape={tuple(ici)} and dcn_shape={tuple(dcn)} "
                         "must have one entry per mesh axis each, e.g. (1, 4) and (2, 1).")
    _check_dcn_outside(ici, dcn)
    dims = tuple(a * b for a, b in zip(ici, dcn, strict=True))
    names = _axis_names(axis_names, dims, "make_hybrid_mesh", suggest=False)
    grid = hybrid_grid(mesh_devices(device), ici, dcn)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(dims))


def hybrid_grid(devices: list, ici: tuple[int, ...], dcn: tuple[int, ...]) -> np.ndarray:
    """make_hybrid_mesh's device array for devices in mesh order (see there): JAX's
    create_hybrid_device_mesh over slices or processes, else consecutive blocks."""
    attr = _granule_attribute(devices)
    if attr is None:
        return _blocks(_take(devices, math.prod(ici) * math.prod(dcn), "make_hybrid_mesh"),
                       ici, dcn)
    _check_granules(devices, attr, ici, dcn)
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices,
                                                process_is_granule=attr == "process_index")


def _check_dcn_outside(ici: tuple[int, ...], dcn: tuple[int, ...]) -> None:
    """Granules must be consecutive in row-major order (the order hardware profiles read nodes
    in): no axis cut across granules may come after an axis cut inside one."""
    inner = [i for i, n in enumerate(ici) if n > 1]
    outer = [i for i, n in enumerate(dcn) if n > 1]
    if inner and outer and max(outer) > min(inner):
        order = sorted(range(len(ici)), key=lambda i: (dcn[i] == 1, i))
        raise ValueError(
            f"make_hybrid_mesh ici_shape={ici}, dcn_shape={dcn}: axis {max(outer)} runs across "
            f"granules but comes after axis {min(inner)}, which runs inside them; jaxpar's cost "
            "model reads nodes as consecutive devices, so put the axes that cross granules first "
            f"(e.g. reorder the axes as {order}: ici_shape={tuple(ici[i] for i in order)}, "
            f"dcn_shape={tuple(dcn[i] for i in order)}).")


def _granule_attribute(devices: list) -> str | None:
    """"slice_index" on multi-slice TPU, "process_index" across processes, None in one."""
    if len({getattr(d, "slice_index", 0) for d in devices}) > 1:
        return "slice_index"
    if len({d.process_index for d in devices}) > 1:
        return "process_index"
    return None


def _check_granules(devices: list, attr: str, ici: tuple[int, ...],
                    dcn: tuple[int, ...]) -> None:
    what = "slices" if attr == "slice_index" else "processes"
    counts: dict[int, int] = {}
    for d in devices:
        counts[getattr(d, attr)] = counts.get(getattr(d, attr), 0) + 1
    if math.prod(dcn) != len(counts):
        raise ValueError(f"make_hybrid_mesh dcn_shape={dcn} multiplies to {math.prod(dcn)} but "
                         f"the {len(devices)} devices come from {len(counts)} {what}; use a "
                         f"dcn_shape whose product is {len(counts)}, e.g. ({len(counts)}, 1).")
    if set(counts.values()) != {math.prod(ici)}:
        raise ValueError(f"make_hybrid_mesh ici_shape={ici} multiplies to {math.prod(ici)} but "
                         f"the {what} hold {sorted(set(counts.values()))} devices each; use an "
                         f"ici_shape whose product is the devices per {what[:-1]}.")


def _blocks(devices: list, ici: tuple[int, ...], dcn: tuple[int, ...]) -> np.ndarray:
    """create_hybrid_device_mesh's layout for one process: granule g (consecutive devices)
    is block g of the dcn grid, each block an ici-shaped array."""
    rank = len(ici)
    arr = np.array(devices, dtype=object).reshape(dcn + ici)
    interleaved = [k for i in range(rank) for k in (i, rank + i)]  # (dcn0, ici0, dcn1, ...)
    return arr.transpose(interleaved).reshape(tuple(a * b for a, b in zip(dcn, ici, strict=True)))


def _mesh_shape(shape: int | Sequence[int], what: str = "make_mesh shape") -> tuple[int, ...]:
    if isinstance(shape, np.integer):  # numpy counts, as strategies and Layout take them
        shape = int(shape)
    elif isinstance(shape, Sequence) and not isinstance(shape, str):
        shape = tuple(int(d) if isinstance(d, np.integer) else d for d in shape)
    if isinstance(shape, bool | str) or not isinstance(shape, int | Sequence):
        raise TypeError(f"{what}={shape!r} must be a device count (int) or a tuple of "
                        "axis sizes, e.g. 8 or (4, 2).")
    if isinstance(shape, int):
        if shape < 1:
            raise ValueError(f"{what}={shape} must be a positive device count.")
        return tuple(prime_factors(shape)) or (1,)
    dims = tuple(shape)
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims):
        raise ValueError(f"{what}={shape!r} must be a non-empty tuple of positive ints, "
                         "e.g. (4, 2).")
    return dims


def _axis_names(names: Sequence[str] | None, dims: tuple[int, ...], who: str = "make_mesh",
                suggest: bool = True) -> tuple[str, ...]:
    """The mesh's axis names; who: the function named in errors; suggest: a wrong count's error
    shows who's call with a shape for it."""
    rank = len(dims)
    example = tuple(f"d{i}" for i in range(rank))
    if names is None:
        return example
    # An ordered, reusable sequence: a set's order varies from run to run (and so would the
    # axes' order), a generator is used up once read.
    if not isinstance(names, tuple | list):
        raise TypeError(f"{who} axis_names={names!r} must be a tuple or list of strings, one per "
                        f"mesh axis, e.g. {example}.")
    if len(names) != rank:
        k = len(names)
        shape = (math.prod(dims[:rank - k + 1]), *dims[rank - k + 1:]) \
            if suggest and 0 < k < rank else ()
        one = f" For fewer axes, give the shape too: {who}({shape}, {tuple(names)!r})." \
            if shape else ""
        raise ValueError(f"{who} axis_names={names!r} must name each of the {rank} mesh axes, "
                         f"e.g. {example}.{one}")
    if not all(isinstance(n, str) and n for n in names) or len(set(names)) != rank:
        raise ValueError(f"{who} axis_names={names!r} must be distinct non-empty strings.")
    return tuple(names)
