"""`jaxpar.init()`: join the processes of a launch with `jax.distributed`.

Before: JAX imported, its backend not started (no computation, no `jax.devices()` yet). The
environment may hold what `jaxpar launch` sets: JAXPAR_COORDINATOR (host:port of process 0),
JAXPAR_NUM_PROCESSES, JAXPAR_PROCESS_ID and JAXPAR_LOCAL_DEVICES (CPU devices per process).
After: in a launch of more than one process, `jax.distributed` is initialized with gloo CPU
collectives, so `jax.devices()` lists every process's devices and meshes built from it span them
all. Without that environment (and `auto=False`) nothing changes: one process, as before.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

import jax
import numpy as np

ENV_COORDINATOR = "JAXPAR_COORDINATOR"
ENV_NUM_PROCESSES = "JAXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXPAR_PROCESS_ID"
ENV_LOCAL_DEVICES = "JAXPAR_LOCAL_DEVICES"


@dataclass(frozen=True)
class ProcessInfo:
    """Where this process stands in the launch. The device counts start JAX's backend when
    read, so read them after init(), not before."""

    process_id: int
    num_processes: int
    coordinator_address: str | None = None

    @property
    def local_device_count(self) -> int:
        return jax.local_device_count()

    @property
    def device_count(self) -> int:
        return jax.device_count()


@dataclass(frozen=True)
class _Settings:
    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    local_devices: int | None


def init(coordinator_address: str | None = None, num_processes: int | None = None,
         process_id: int | None = None, local_device_count: int | None = None,
         auto: bool = False) -> ProcessInfo:
    """Join this process to its launch; call it first, before any other JAX call.

    Reads the environment `jaxpar launch` sets (explicit arguments win). With more than one
    process it selects gloo CPU collectives, sets the local CPU device count and calls
    `jax.distributed.initialize(coordinator_address, num_processes, process_id)`. With neither
    environment nor arguments it does nothing (one process), unless `auto=True`: then
    `jax.distributed.initialize()` finds the cluster itself (Cloud TPU, SLURM, Open MPI).
    Calling it again with the same settings returns the same answer.

    Args:
      coordinator_address: "host:port" of process 0's coordinator; default $JAXPAR_COORDINATOR.
      num_processes: processes in the launch; default $JAXPAR_NUM_PROCESSES, else 1.
      process_id: this process's rank, 0 <= process_id < num_processes; default
        $JAXPAR_PROCESS_ID.
      local_device_count: simulated CPU devices in this process; default $JAXPAR_LOCAL_DEVICES,
        else the platform's own count.
      auto: without a launch environment, let JAX discover the cluster.

    Returns:
      A ProcessInfo: process_id, num_processes, and (read lazily) local and global device counts.

    Example:
      >>> info = jaxpar.init()   # in a script started by `jaxpar launch -n 2 ...`
      >>> mesh = jaxpar.make_mesh(info.device_count)   # spans both processes
    """
    s = _settings(coordinator_address, num_processes, process_id, local_device_count, os.environ)
    if jax.distributed.is_initialized():
        return _already_initialized(s)
    if s.num_processes == 1 or (s.num_processes is None and not auto):
        _set_local_devices(s.local_devices)
        return ProcessInfo(0, 1)
    if s.num_processes is None:  # auto: the platform's cluster discovery
        _configure_before_backend(s.local_devices)
        _initialize_auto()
        return ProcessInfo(jax.process_index(), jax.process_count())  # starts the backend
    if s.coordinator is None or s.process_id is None:
        raise ValueError(f"jaxpar.init: num_processes={s.num_processes} also needs "
                         f"coordinator_address (got {s.coordinator!r}) and process_id (got "
                         f"{s.process_id!r}); start the script with `jaxpar launch -n N` or pass "
                         "all three.")
    _configure_before_backend(s.local_devices)
    jax.distributed.initialize(s.coordinator, s.num_processes, s.process_id)
    return ProcessInfo(s.process_id, s.num_processes, s.coordinator)


def check_joined(who: str) -> None:
    """A RuntimeError when this process was started by `jaxpar launch` as one of several but
    has not joined them (jax.distributed is not initialized): it would otherwise run alone on
    its own devices, as if no launch had happened, and every rank would train a model of its
    own. `who` names the call that found it (make_mesh, shard, ...)."""
    try:
        count = int(os.environ.get(ENV_NUM_PROCESSES, "1"))
    except ValueError:
        return  # init() names a malformed variable; this check only looks for a clear launch
    if count > 1 and not jax.distributed.is_initialized():
        rank = os.environ.get(ENV_PROCESS_ID, "?")
        raise RuntimeError(
            f"{who}: this process is rank {rank} of {count} started by `jaxpar launch`, but it "
            "has not joined the others, so it would run alone on its own devices. Call "
            "jaxpar.init() at the top of the script, before any other JAX call.")


def digest(payload: bytes) -> np.ndarray:
    """Two int32s from the sha256 of `payload`: what processes all-gather to compare a
    larger thing (a plan, a batch's shapes) without sending it."""
    return np.frombuffer(hashlib.sha256(payload).digest()[:8], np.int32)


def gather_rows(row: np.ndarray) -> np.ndarray:
    """Every process's int32 `row` (the same length in each), one row per process, in process
    order: a small all-gather, which every process must call."""
    from jax.experimental import multihost_utils

    row = np.asarray(row, np.int32)
    return np.asarray(_untraced(multihost_utils.process_allgather, row)).reshape(-1, row.size)


def broadcast_bytes(payload: bytes) -> bytes:
    """Process 0's `payload` in every process (each must call; the others' payloads are not
    read): its length first, then the bytes."""
    from jax.experimental import multihost_utils

    n = int(np.asarray(_untraced(multihost_utils.broadcast_one_to_all, np.int32(len(payload)))))
    buf = np.zeros(n, np.uint8)
    if jax.process_index() == 0:
        buf[:] = np.frombuffer(payload, np.uint8)
    return np.asarray(_untraced(multihost_utils.broadcast_one_to_all, buf), np.uint8).tobytes()


def _untraced(fn, *args):
    """fn(*args) on a thread of its own, outside any trace and mesh context of the caller's:
    JAX keeps those per thread, and multihost_utils' collectives refuse to run inside a trace
    (a jaxpar function called inside jax.jit, grad or vmap agrees on its plan there)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def launch_environment(coordinator_address: str, num_processes: int, process_id: int,
                       local_device_count: int | None = None) -> dict[str, str]:
    """The environment variables `init()` reads, for one process of a launch.

    Example:
      >>> launch_environment("127.0.0.1:1234", 2, 0, 4)["JAXPAR_PROCESS_ID"]
      '0'
    """
    env = {ENV_COORDINATOR: coordinator_address, ENV_NUM_PROCESSES: str(num_processes),
           ENV_PROCESS_ID: str(process_id)}
    if local_device_count is not None:
        env[ENV_LOCAL_DEVICES] = str(local_device_count)
    return env


def _settings(coordinator, num_processes, process_id, local_devices,
              environ: Mapping[str, str]) -> _Settings:
    s = _Settings(
        coordinator if coordinator is not None else environ.get(ENV_COORDINATOR) or None,
        _int_setting("num_processes", num_processes, environ, ENV_NUM_PROCESSES, 1),
        _int_setting("process_id", process_id, environ, ENV_PROCESS_ID, 0),
        _int_setting("local_device_count", local_devices, environ, ENV_LOCAL_DEVICES, 1))
    if s.coordinator is not None and (not isinstance(s.coordinator, str)
                                      or ":" not in s.coordinator):
        raise ValueError(f"jaxpar.init: coordinator_address={s.coordinator!r} must be "
                         "'host:port', e.g. '127.0.0.1:1234'.")
    if None not in (s.num_processes, s.process_id) and s.process_id >= s.num_processes:
        raise ValueError(f"jaxpar.init: process_id={s.process_id} must be below "
                         f"num_processes={s.num_processes}.")
    return s


def _int_setting(name: str, value, environ: Mapping[str, str], var: str,
                 least: int) -> int | None:
    """An explicit int argument, else the environment variable `var`, checked >= least."""
    source = f"{name}={value!r}"
    if value is None:
        if not environ.get(var):
            return None
        source = f"${var}={environ[var]!r}"
        try:
            value = int(environ[var])
        except ValueError:
            raise ValueError(f"jaxpar.init: {source} is not an integer.") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"jaxpar.init: {source} must be an int.")
    if value < least:
        raise ValueError(f"jaxpar.init: {source} must be >= {least}.")
    return value


def _already_initialized(s: _Settings) -> ProcessInfo:
    """A second init(): fine when it asks for what the first one set up."""
    have = (jax.process_index(), jax.process_count())
    want = (s.process_id, s.num_processes)
    if any(w is not None and w != h for w, h in zip(want, have, strict=True)):
        raise RuntimeError(f"jaxpar.init: jax.distributed is already initialized as process "
                           f"{have[0]} of {have[1]}, but this call asks for process "
                           f"{s.process_id} of {s.num_processes}.")
    _set_local_devices(s.local_devices)
    return ProcessInfo(*have, s.coordinator)


def _configure_before_backend(local_devices: int | None) -> None:
    if _backend_started():
        raise RuntimeError("jaxpar.init() must be called before JAX starts its backend (before "
                           "any computation, jax.devices(), jax.device_put, ...): JAX fixes the "
                           "process group and device count then. Call jaxpar.init() first, "
                           "right after the imports.")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _set_local_devices(local_devices)


def _set_local_devices(count: int | None) -> None:
    """Simulated CPU devices in this process; once the backend runs, only the count it has."""
    if count is None:
        return
    if not _backend_started():
        jax.config.update("jax_num_cpu_devices", count)
        return
    have = len(jax.local_devices(backend="cpu"))
    if have != count:
        raise RuntimeError(f"jaxpar.init: local_device_count={count} cannot be applied, JAX's "
                           f"backend already started with {have} CPU devices. Call "
                           "jaxpar.init() first, before any computation or jax.devices().")


def _initialize_auto() -> None:
    try:
        jax.distributed.initialize()
    except ValueError as err:
        raise ValueError(f"jaxpar.init(auto=True): JAX found no cluster to join ({err}). Start "
                         "the script with `jaxpar launch -n N`, or pass coordinator_address, "
                         "num_processes and process_id.") from None


def _backend_started() -> bool:
    # jax.distributed.initialize checks the same (private) flag; there is no public query.
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()
