"""`jaxpar calibrate`: measure the devices at hand and write a hardware profile for `hardware=`.

Before: JAX's devices, in one process or in every process of a multi-process job (the command
line joins one through `jaxpar.init()`, which reads what `jaxpar launch` sets). After: a
`HardwareProfile` (printed as a table, written as YAML that `load_profile` reads) whose
figures were measured:

- peak flops per device: a square matmul of random numbers on every device at once (bf16 on
  GPU/TPU, f32 on CPU);
- memory bandwidth per device: a large elementwise pass on every device at once (read + write);
- memory per device: `device.memory_stats()["bytes_limit"]` (what JAX's allocator may use,
  below the physical HBM) where the device reports it, else
  `--memory-gb`, else the host's RAM shared among its devices;
- per mesh axis and collective (all-reduce, all-gather, reduce-scatter, all-to-all,
  collective-permute): the time of a small message (1 KB per device: latency) and a large one
  (4 MB: bandwidth), every group of the axis running at once as in a sharded program. Each
  timing runs the collective k times inside one compiled loop (k grown until the loop lasts
  about 20 ms), minus the same program run 0 times, over k, the fastest of a few runs: the
  dispatch cost cancels and the timer's noise is small against the loop.

The fit follows `jaxpar.cost.comm`'s alpha-beta model, so that the cost model gives back the
measured times: for n devices on the axis and b bytes per device (the larger of operand and
result) a collective takes `factor * b / bandwidth + hops * latency`, with factor (n-1)/n for
all-gather, reduce-scatter and all-to-all (switch), 2(n-1)/n for all-reduce, 1 for a permute,
and hops ceil(log2 n) on a switch (n - 1 on a TPU ring; 1 for a permute). The two sizes give
bandwidth (bus bandwidth, NCCL's convention) and latency. The axis's link takes the
all-reduce figures, the others go to its `collectives`. Axes inside one process make `intra`
(the slowest of them), axes across processes `inter`, with `devices_per_node` the devices per
process; every axis's own link goes under `axes` by name.

On a GPU or TPU pod, run it once per cluster shape with the mesh you will train on, e.g.
`jaxpar calibrate --mesh 2,8 --names node,gpu --out my-cluster.yaml` in every process of the
job, then `jaxpar.shard(..., hardware="my-cluster.yaml")`.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import progress
from jaxpar.context import MAX_DEVICES
from jaxpar.cost.hardware import (
    COLLECTIVE_KINDS,
    HardwareProfile,
    Link,
    is_path,
    save_profile,
)
from jaxpar.mesh import make_mesh, mesh_devices
from jaxpar.plan import check_writable

KINDS = COLLECTIVE_KINDS


def _positive(x) -> bool:
    """A finite number above 0 (not a bool)."""
    return isinstance(x, int | float | np.number) and not isinstance(x, bool | np.bool_) \
        and bool(np.isfinite(x)) and x > 0


@dataclass(frozen=True)
class Settings:
    """What one calibration measures; sizes are bytes per device."""

    small_bytes: int = 1 << 10     # latency message
    large_bytes: int = 4 << 20     # bandwidth message
    target_s: float = 0.02         # a timed run repeats its op until it lasts about this long
    trials: int = 5                # timed runs of each; the fastest counts
    matmul_size: int = 0           # 0: 512 on CPU, 8192 on GPU/TPU
    matmul_dtype: str = ""         # "": float32 on CPU, bfloat16 on GPU/TPU
    copy_bytes: int = 0            # 0: 8 MB on CPU, 1 GB on GPU/TPU

    def __post_init__(self) -> None:
        # Checked when made: trials=0 measured nothing and gave NaN figures, and sizes given
        # the wrong way round fitted a latency of 0 and a bandwidth of a few MB/s.
        for field_, least in (("small_bytes", 1), ("large_bytes", 1), ("trials", 1),
                              ("matmul_size", 0), ("copy_bytes", 0)):
            value = getattr(self, field_)
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or \
                    value < least:
                raise ValueError(f"Settings({field_}={value!r}): give an int of at least "
                                 f"{least}" + (" (0: the platform's default)." if least == 0
                                               else "."))
        if self.small_bytes >= self.large_bytes:
            raise ValueError(f"Settings(small_bytes={self.small_bytes}, large_bytes="
                             f"{self.large_bytes}): the latency message must be smaller than "
                             "the bandwidth message (the fit takes the line through both).")
        if not _positive(self.target_s):
            raise ValueError(f"Settings(target_s={self.target_s!r}): give the seconds a timed "
                             "run should last, a finite number > 0, e.g. 0.02.")
        if self.matmul_dtype not in ("", "float32", "bfloat16", "float16"):
            raise ValueError(f"Settings(matmul_dtype={self.matmul_dtype!r}): use 'float32', "
                             "'bfloat16', 'float16', or '' for the platform's default.")


QUICK = Settings(large_bytes=2 << 20, target_s=0.008, trials=3)
_MAX_REPS = 1 << 14


@dataclass(frozen=True)
class Measurement:
    """One collective on one mesh axis: the two timings and the alpha-beta fit."""

    axis: str
    devices: int          # devices in one group of the axis
    kind: str
    small_bytes: int
    small_s: float
    large_bytes: int
    large_s: float
    bandwidth: float      # bytes/s, bus bandwidth
    latency: float        # seconds per hop


@dataclass(frozen=True)
class Calibration:
    """What `calibrate` measured and the profile it makes of it."""

    profile: HardwareProfile
    measurements: tuple[Measurement, ...]
    seconds: float                 # wall time of the calibration
    notes: tuple[str, ...] = ()    # where figures come from when not measured


def calibrate(mesh: Mesh | None = None, *, name: str | None = None, quick: bool = False,
              memory_bytes: float | None = None, settings: Settings | None = None,
              matmul_dtype: str | None = None) -> Calibration:
    """Measure compute, memory and every collective on every axis of `mesh`.

    Every process of a multi-process run must call it with the same mesh (collectives span
    them all); each gets the same figures back.

    Args:
      mesh: the mesh to measure; default one axis over all devices, or (processes, devices per
        process) when there are several processes.
      name: the profile's name; default "calibrated-<platform>-<device count>".
      quick: fewer and smaller runs (about half the time, noisier figures).
      memory_bytes: memory per device when the device does not report it.
      settings: explicit sizes and repetitions (overrides quick).
      matmul_dtype: the dtype peak_flops is measured in: the one the program's matmuls use
        ("float32", "bfloat16", "float16"; default float32 on CPU, bfloat16 elsewhere). On an
        H100, f32 at JAX's default precision (TF32) ran at 428 TFLOP/s, bf16 at 843.

    Returns:
      A Calibration: `.profile` (a HardwareProfile for `hardware=`), `.measurements`.

    Example:
      >>> cal = calibrate(jaxpar.make_mesh((2, 4)), quick=True)
      >>> save_profile(cal.profile, "cpu8.yaml"); jaxpar.shard(f, hardware="cpu8.yaml")
    """
    start = time.perf_counter()
    mesh = mesh if mesh is not None else default_mesh()
    if not isinstance(mesh, Mesh):
        raise TypeError(f"calibrate(mesh={mesh!r}): pass a jax.sharding.Mesh, e.g. "
                        "jaxpar.make_mesh((2, 4)), or None for all devices.")
    if memory_bytes is not None and not (_positive(memory_bytes) and memory_bytes >= 1):
        raise ValueError(f"calibrate(memory_bytes={memory_bytes!r}): give the memory per device "
                         "in bytes (a finite number of at least 1), or None to read it from the "
                         "device or the host.")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"calibrate(name={name!r}): give the profile's name as a non-empty "
                         "string, or None for calibrated-<platform>-<device count>.")
    if not isinstance(quick, bool):
        raise TypeError(f"calibrate(quick={quick!r}): pass True or False.")
    if settings is not None and not isinstance(settings, Settings):
        raise TypeError(f"calibrate(settings={settings!r}): pass a "
                        "jaxpar.calibrate.Settings(...), e.g. Settings(trials=3), or None.")
    s = settings or (QUICK if quick else Settings())
    if matmul_dtype is not None:
        if matmul_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"calibrate(matmul_dtype={matmul_dtype!r}): use 'float32', "
                             "'bfloat16' or 'float16', the dtype of the program's matmuls.")
        s = replace(s, matmul_dtype=matmul_dtype)
    s = _platform_sizes(s, mesh.devices.flat[0].platform)
    trips = _trips(mesh)
    links = [(axis, kind) for axis in mesh.axis_names if mesh.shape[axis] > 1 for kind in KINDS]
    devices = f"{mesh.size} device" + ("s" if mesh.size > 1 else "")
    with progress.activity(f"calibrating {devices}"), \
            progress.stage("", total=len(links) + 2):
        measured = []
        for axis, kind in links:
            progress.step(f"{kind} over {axis}")
            measured.append(_measure_axis(mesh, axis, kind, s, trips))
        progress.step("peak flops")
        peak = _peak_flops(mesh, s, trips)
        progress.step("memory bandwidth")
        bandwidth = _memory_bandwidth(mesh, s, trips)
    memory, notes = _memory_per_device(mesh, memory_bytes)
    notes.append(f"peak_flops: {s.matmul_dtype} matmuls of {s.matmul_size}^2 at JAX's default "
                 "precision")
    if not measured:
        notes.append("one device: no link to measure; intra is the device's memory bandwidth")
    profile = build_profile(mesh, measured, name=name, peak_flops=peak,
                            memory_bandwidth=bandwidth, memory_bytes=memory)
    return Calibration(profile, tuple(measured), time.perf_counter() - start, tuple(notes))


def default_mesh() -> Mesh:
    """One axis over all devices; (processes, devices per process) across processes."""
    if jax.process_count() > 1:
        return make_mesh((jax.process_count(), jax.local_device_count()), ("node", "device"))
    return make_mesh((jax.device_count(),), ("d0",))


def _platform_sizes(s: Settings, platform: str) -> Settings:
    cpu = platform == "cpu"
    return replace(s, matmul_size=s.matmul_size or (512 if cpu else 8192),
                   matmul_dtype=s.matmul_dtype or ("float32" if cpu else "bfloat16"),
                   copy_bytes=s.copy_bytes or ((8 if cpu else 1024) << 20))


# ---- timing ----------------------------------------------------------------------------------

def _extra(fn: Callable, base: tuple, args: tuple, trials: int) -> float:
    """How much longer fn(*args) runs than fn(*base): the fastest of `trials` runs of each,
    interleaved, so that a burst of load on a busy host spoils both alike or neither. Across
    processes the slowest process's figure, so that every process decides alike (loop counts
    must match for the collectives to pair up)."""
    fastest = [math.inf, math.inf]
    for _ in range(trials):
        for i, a in enumerate((base, args)):
            t = time.perf_counter()
            jax.block_until_ready(fn(*a))
            fastest[i] = min(fastest[i], time.perf_counter() - t)
    extra = fastest[1] - fastest[0]
    if jax.process_count() > 1:
        from jax.experimental.multihost_utils import process_allgather
        extra = float(np.max(process_allgather(np.float64(extra))))
    return extra


def _per_rep(fn: Callable, args: Callable[[int], tuple], s: Settings) -> float:
    """Seconds one repetition of fn's loop takes: (time of k repetitions - time of none) / k,
    k grown until the k repetitions last about `s.target_s`, far above the noise of the timer
    and the dispatch. A final figure that the noise still swamps is measured again, longer."""
    jax.block_until_ready(fn(*args(0)))  # compile and warm up
    k = 1
    while k < _MAX_REPS:
        t = _extra(fn, args(0), args(k), 1)
        if t >= s.target_s / 2:
            break
        k = min(_MAX_REPS, k * (64 if t <= 0 else max(2, math.ceil(s.target_s / t))))
    for _ in range(3):
        t = _extra(fn, args(0), args(k), s.trials)
        if t >= s.target_s / 4 or k >= _MAX_REPS:
            break
        k = min(_MAX_REPS, 2 * k)
    return max(t, 1e-9) / k


def _looped(op: Callable, x, k):
    """op(x) run k times (k traced) in one loop, and one element of its result (a small output
    to allocate). The optimization barrier keeps XLA from hoisting the loop-invariant op out
    of the loop."""
    y0 = jnp.zeros(jax.eval_shape(op, x).shape, x.dtype)

    def body(_, carry):
        x, _ = carry
        return lax.optimization_barrier((x, op(x)))
    return lax.fori_loop(0, k, body, (x, y0))[1].reshape(-1)[:1]


def _global(mesh: Mesh, shape: tuple[int, ...], dtype, spec: P, value: float = 1) -> jax.Array:
    """An array filled with `value`, laid out as `spec`; each process fills its own shards, so
    it works across processes."""
    def shard(index: tuple[slice, ...]) -> np.ndarray:
        local = tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))
        return np.full(local, value, dtype)
    return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), shard)


def _random(mesh: Mesh, shape: tuple[int, ...], dtype, spec: P) -> jax.Array:
    """Normal random numbers laid out as `spec` (a matmul of constants runs faster on GPUs)."""
    return jax.jit(lambda: jax.random.normal(jax.random.key(0), shape, dtype),
                   out_shardings=NamedSharding(mesh, spec))()


def _trips(mesh: Mesh) -> Callable[[int], jax.Array]:
    """k as a replicated int32[1] (a loop count), one array per k."""
    made: dict[int, jax.Array] = {}

    def trips(k: int) -> jax.Array:
        if k not in made:
            made[k] = _global(mesh, (1,), np.int32, P(), k)
        return made[k]
    return trips


# ---- collectives -----------------------------------------------------------------------------

def _collective(kind: str, axis: str, n: int) -> Callable:
    """The per-device body of one collective over `axis` on a flat f32 block."""
    if kind == "all-reduce":
        return lambda x: lax.psum(x, axis)
    if kind == "all-gather":
        return lambda x: lax.all_gather(x, axis, tiled=True)
    if kind == "reduce-scatter":
        return lambda x: lax.psum_scatter(x, axis, tiled=True)
    if kind == "all-to-all":
        return lambda x: lax.all_to_all(x.reshape(n, -1), axis, 0, 0, tiled=True).reshape(-1)
    ring = [(i, (i + 1) % n) for i in range(n)]
    return lambda x: lax.ppermute(x, axis, ring)


def _measure_axis(mesh: Mesh, axis: str, kind: str, s: Settings, trips: Callable) -> Measurement:
    """Time `kind` over `axis` with small and large messages and fit (bandwidth, latency)."""
    n, every = mesh.shape[axis], P(tuple(mesh.axis_names))
    op = _collective(kind, axis, n)

    def body(xs, xl, small_count, large_count):
        return _looped(op, xs, small_count[0]), _looped(op, xl, large_count[0])
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(every, every, P(), P()),
                               out_specs=(every, every), check_vma=False))
    full = [max(n, b // 4 // n * n) for b in (s.small_bytes, s.large_bytes)]
    operand = [m // n if kind == "all-gather" else m for m in full]
    xs, xl = (_global(mesh, (mesh.size * m,), np.float32, every) for m in operand)
    small = _per_rep(fn, lambda k: (xs, xl, trips(k), trips(0)), s)
    large = _per_rep(fn, lambda k: (xs, xl, trips(0), trips(k)), s)
    # comm.py's bytes: the larger of operand and result, f32 elements divisible by n.
    nbytes = [4 * m for m in full]
    bw, lat = fit_link(kind, n, _topology(mesh), nbytes[0], small, nbytes[1], large)
    return Measurement(axis, n, kind, nbytes[0], small, nbytes[1], large, bw, lat)


def _topology(mesh: Mesh) -> str:
    return "ring" if mesh.devices.flat[0].platform == "tpu" else "switch"


def fit_link(kind: str, n: int, topology: str, small_bytes: float, small_s: float,
             large_bytes: float, large_s: float) -> tuple[float, float]:
    """(bandwidth, latency) of comm.py's model through two timings of one collective.

    The model is t = factor * b / bandwidth + hops * latency (see the module docstring). A
    timing too noisy to give a positive slope or intercept falls back to the large message
    alone for the bandwidth and to a latency of zero.

    Example:
      >>> fit_link("all-gather", 4, "switch", 1024, 10e-6, 4 << 20, 1e-3)  # doctest: +ELLIPSIS
      (3.1...e+09, 4.8...e-06)
    """
    factor, hops = _factor_hops(kind, n, topology)
    dx = factor * (large_bytes - small_bytes)
    slope = (large_s - small_s) / dx if dx > 0 else 0.0
    bandwidth = 1.0 / slope if slope > 0 else factor * large_bytes / max(large_s, 1e-12)
    latency = max(small_s - factor * small_bytes / bandwidth, 0.0) / hops
    return bandwidth, latency


def _factor_hops(kind: str, n: int, topology: str) -> tuple[float, int]:
    ring = topology == "ring"
    hops = (n - 1) if ring else max(1, math.ceil(math.log2(n)))
    if kind == "collective-permute":
        return 1.0, 1
    if kind == "all-reduce":
        return 2 * (n - 1) / n, hops
    if kind == "all-to-all" and ring:
        return max((n - 1) / n, n / 4), hops
    return (n - 1) / n, hops


# ---- compute and memory ----------------------------------------------------------------------

def _peak_flops(mesh: Mesh, s: Settings, trips: Callable) -> float:
    """flop/s per device of a square matmul running on every device at once."""
    size, every = s.matmul_size, P(tuple(mesh.axis_names))
    dtype = jnp.dtype(s.matmul_dtype)

    def body(a, b, count):
        return _looped(lambda x: x @ b, a, count[0])
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(every, P(), P()), out_specs=every,
                               check_vma=False))
    a = _random(mesh, (mesh.size * size, size), dtype, every)
    b = _random(mesh, (size, size), dtype, P())
    seconds = _per_rep(fn, lambda k: (a, b, trips(k)), s)
    return 2.0 * size ** 3 / max(seconds, 1e-12)


def _memory_bandwidth(mesh: Mesh, s: Settings, trips: Callable) -> float:
    """bytes/s per device of x + 1 over a large array (one read, one write) on every device."""
    m, every = s.copy_bytes // 4, P(tuple(mesh.axis_names))

    def body(x, count):
        return _looped(lambda v: v + 1.0, x, count[0])
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(every, P()), out_specs=every,
                               check_vma=False))
    x = _global(mesh, (mesh.size * m,), np.float32, every)
    seconds = _per_rep(fn, lambda k: (x, trips(k)), s)
    return 2.0 * 4 * m / max(seconds, 1e-12)


def _memory_per_device(mesh: Mesh, given: float | None) -> tuple[float, list[str]]:
    mine = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    stats = mine.memory_stats() or {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), [
            "memory per device: what JAX's allocator may use (memory_stats bytes_limit)"]
    if given is not None:
        return float(given), ["memory per device: given (the device does not report it)"]
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    sharing = _devices_on_this_host()
    return float(ram / sharing), [
        f"memory per device: host RAM {ram / 1e9:.1f} GB shared among {sharing} devices (the "
        "device does not report it; --memory-gb sets it)"]


def _devices_on_this_host() -> int:
    """The devices of every process on this host (several processes of a `jaxpar launch`
    share its RAM): each process's local device count, summed over those whose host name is
    this one's (a small all-gather when there are several processes)."""
    if jax.process_count() == 1:
        return jax.local_device_count()
    import socket

    from jaxpar.distributed import digest, gather_rows

    every = gather_rows(np.concatenate([digest(socket.gethostname().encode()),
                                        [jax.local_device_count()]]))
    here = every[jax.process_index()]
    return int(sum(row[-1] for row in every if (row[:-1] == here[:-1]).all()))


# ---- the profile -----------------------------------------------------------------------------

def build_profile(mesh: Mesh, measured: Sequence[Measurement], *, name: str | None,
                  peak_flops: float, memory_bandwidth: float,
                  memory_bytes: float) -> HardwareProfile:
    """A HardwareProfile from measurements: one link per axis, intra/inter from the axes
    inside/across processes (see the module docstring)."""
    platform = mesh.devices.flat[0].platform
    links = {axis: _axis_link(f"{platform}-{axis}", [m for m in measured if m.axis == axis],
                              _topology(mesh)) for axis in dict.fromkeys(m.axis for m in measured)}
    crossing = _process_axes(mesh)
    inside = [links[a] for a in links if a not in crossing]
    across = [links[a] for a in links if a in crossing]
    # One device has no link: a copy in its own memory stands in (nothing is ever sent).
    intra = _slowest(inside or across) if links else Link(f"{platform}-memory",
                                                          memory_bandwidth, 0.0)
    multi = jax.process_count() > 1
    return HardwareProfile(
        name=name or f"calibrated-{platform}-{mesh.size}", peak_flops=peak_flops,
        memory_bytes=memory_bytes, memory_bandwidth=memory_bandwidth, intra=intra,
        inter=_slowest(across) if across else None, nodes=jax.process_count(),
        devices_per_node=jax.local_device_count() if multi else 0, axes=links)


def _axis_link(name: str, measured: list[Measurement], topology: str) -> Link:
    main = next(m for m in measured if m.kind == "all-reduce")
    others = {m.kind: {"bandwidth": m.bandwidth, "latency": m.latency} for m in measured
              if m.kind != "all-reduce"}
    return Link(name, main.bandwidth, main.latency, topology, others)


def _slowest(links: list[Link]) -> Link:
    return min(links, key=lambda lk: (lk.bandwidth, -lk.latency))


def _process_axes(mesh: Mesh) -> set[str]:
    """Axes with a device group that spans processes."""
    proc = np.vectorize(lambda d: d.process_index)(mesh.devices)
    return {a for i, a in enumerate(mesh.axis_names) if np.any(np.ptp(proc, axis=i) > 0)}


# ---- command line ----------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """`jaxpar calibrate [--devices N] [--mesh 2,4] [--names a,b] [--out PATH] [--quick]`.

    Returns:
      0 when the profile was written, 2 on bad arguments.

    Example:
      >>> main(["--devices", "8", "--mesh", "2,4", "--out", "cpu8.yaml", "--quick"])
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.memory_gb is not None and not (_positive(args.memory_gb * 1e9)
                                               and args.memory_gb * 1e9 >= 1):
            raise ValueError(f"--memory-gb {args.memory_gb}: give the memory per device in GB, "
                             "a finite number of a byte (1e-9) or more (e.g. --memory-gb 16).")
        shape, names = _parse_mesh(args.mesh, args.names, args.devices)
        check_writable(args.out, "--out")  # before measuring, which takes a while
        # --mesh alone: as many (simulated CPU) devices as it holds
        _start_backend(args.devices or (math.prod(shape) if shape else None), args.device)
        mesh = _cli_mesh(shape, names, args.devices, args.device)
    except (ValueError, TypeError, RuntimeError) as err:
        print(f"jaxpar calibrate: error: {err}", file=sys.stderr)
        return 2
    memory = args.memory_gb * 1e9 if args.memory_gb is not None else None
    cal = calibrate(mesh, name=args.name, quick=args.quick, memory_bytes=memory,
                    matmul_dtype=args.matmul_dtype)
    if jax.process_index() == 0:
        _report(cal, mesh)
        save_profile(cal.profile, args.out, _comment(cal, mesh))
        hint = _as_hardware(args.out)
        print(f"wrote {args.out}: use it with jaxpar.shard(..., hardware={hint!r})")
    return 0


def _as_hardware(out: Path) -> str:
    """`out` as `hardware=` reads it back: a bare name without a suffix reads as a profile
    name (hardware.load_profile), so it gets a "./" to make it a path."""
    return str(out) if is_path(str(out)) else f"./{out}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxpar calibrate", description=(
        "Measure collectives on each mesh axis, matmul flops and memory bandwidth of the "
        "devices at hand, and write a hardware profile YAML for jaxpar.shard(hardware=...)."))
    p.add_argument("--devices", type=int, default=None,
                   help="use this many devices (CPU: simulated ones if JAX has not started)")
    p.add_argument("--mesh", default=None, help="mesh shape, e.g. 2,4 (default: all devices "
                   "on one axis; processes x devices across processes)")
    p.add_argument("--names", default=None, help="axis names, e.g. node,gpu (default d0,d1,..)")
    p.add_argument("--device", choices=("CPU", "GPU", "TPU"), default=None,
                   help="platform (default: JAX's default backend)")
    p.add_argument("--out", type=Path, default=Path("calibrated.yaml"),
                   help="where to write the profile (default calibrated.yaml)")
    p.add_argument("--name", default=None, help="profile name (default calibrated-<platform>-N)")
    p.add_argument("--memory-gb", type=float, default=None,
                   help="memory per device in GB when the device does not report it")
    p.add_argument("--quick", action="store_true", help="fewer, smaller runs")
    p.add_argument("--matmul-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="dtype of the matmuls peak_flops is measured with: the one your "
                   "program computes in (default float32 on CPU, bfloat16 on GPU/TPU)")
    return p


def _parse_mesh(mesh: str | None, names: str | None,
                devices: int | None) -> tuple[tuple[int, ...] | None, tuple[str, ...] | None]:
    # Checked before JAX starts: _start_backend asks for that many simulated CPU devices, and
    # 100000 of them took 19 GB and never came back.
    if devices is not None and not 1 <= devices <= MAX_DEVICES:
        raise ValueError(f"--devices {devices}: must be a positive device count of at most "
                         f"{MAX_DEVICES} (jaxpar's limit, as for jaxpar plan and launch).")
    shape = None
    if mesh is not None:
        try:
            shape = tuple(int(x) for x in mesh.split(","))
        except ValueError:
            raise ValueError(f"--mesh {mesh!r}: use comma-separated axis sizes, e.g. 2,4.") \
                from None
        if min(shape) < 1:
            raise ValueError(f"--mesh {mesh}: axis sizes must be positive, e.g. 2,4.")
        if math.prod(shape) > MAX_DEVICES:
            raise ValueError(f"--mesh {mesh} has {math.prod(shape)} devices; at most "
                             f"{MAX_DEVICES} (jaxpar's limit, as for jaxpar plan and launch).")
        if devices is not None and math.prod(shape) != devices:
            raise ValueError(f"--mesh {mesh} has {math.prod(shape)} devices but --devices is "
                             f"{devices}; make them agree (e.g. --devices {math.prod(shape)}).")
    split = tuple(names.split(",")) if names is not None else None
    return shape, split


def _start_backend(devices: int | None, device: str | None) -> None:
    """Join a launch (jaxpar.init reads its environment; a no-op alone) and, for CPU, ask for
    `devices` simulated devices while JAX's backend has not started yet."""
    from jax._src import xla_bridge  # no public query for "backend started"

    from jaxpar.distributed import init

    init()
    alone = not jax.distributed.is_initialized()  # (jax.process_count() would start JAX)
    if devices is not None and device in (None, "CPU") and alone \
            and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_num_cpu_devices", devices)


def _cli_mesh(shape: tuple[int, ...] | None, names: tuple[str, ...] | None,
              devices: int | None, device: str | None) -> Mesh:
    if shape is None and devices is None and names is None and device is None:
        return default_mesh()
    if shape is None:
        count = devices or len(mesh_devices(device))  # a missing platform: a clear error
        shape = (count,) if names is None or len(names) == 1 else None
    if shape is None:
        raise ValueError(f"--names {','.join(names)}: give --mesh with one size per name.")
    return make_mesh(shape, names, device=device)


def _report(cal: Calibration, mesh: Mesh) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"jaxpar calibrate: {cal.profile.name}, mesh "
                    + " x ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names))
    first = cal.measurements[0] if cal.measurements else None
    sizes = (f"{first.small_bytes / 1e3:g} KB", f"{first.large_bytes / 1e6:.3g} MB") \
        if first else ("small", "large")
    for col in ("axis", "n", "collective", f"time {sizes[0]}", f"time {sizes[1]}",
                "bus bandwidth", "latency/hop"):
        t.add_column(col, justify="left" if col in ("axis", "collective") else "right")
    for m in cal.measurements:
        t.add_row(m.axis, str(m.devices), m.kind, f"{m.small_s * 1e6:.1f} us",
                  f"{m.large_s * 1e3:.3f} ms", f"{m.bandwidth / 1e9:.2f} GB/s",
                  f"{m.latency * 1e6:.1f} us")
    console = Console(width=max(Console().width, 100))
    console.print(t)
    p = cal.profile
    console.print(f"peak {p.peak_flops / 1e9:.1f} GFLOP/s, memory bandwidth "
                  f"{p.memory_bandwidth / 1e9:.1f} GB/s, memory {p.memory_bytes / 1e9:.1f} GB "
                  f"per device; measured in {cal.seconds:.1f} s", markup=False)
    for note in cal.notes:
        console.print(note, markup=False)


def _comment(cal: Calibration, mesh: Mesh) -> str:
    d = mesh.devices.flat[0]
    shape = " x ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    lines = [f"Measured by `jaxpar calibrate` on {mesh.size} {d.platform} device(s) "
             f"({d.device_kind}), {jax.process_count()} process(es), mesh {shape}, "
             f"in {cal.seconds:.1f} s.",
             "Bandwidths are bus bandwidths (jaxpar.cost.comm's ring formulas); latency is "
             "per hop.", *cal.notes]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
