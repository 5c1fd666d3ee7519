"""Device meshes with Auto axis types: `make_mesh(8)` or `make_mesh((4, 2), ("dp", "tp"))`."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

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


def _devices(device: str | None, count: int) -> list:
    if device is not None and device not in _PLATFORMS:
        raise ValueError(f"device={device!r} is not a platform jaxpar knows; use one of "
                         f"{sorted(_PLATFORMS)} or None for JAX's default backend.")
    try:
        devices = jax.devices(_PLATFORMS[device]) if device else jax.devices()
    except RuntimeError as err:
        raise ValueError(f"device={device!r}: no {device} devices are visible to JAX ({err}). "
                         "Install the matching jaxlib plugin or pick another platform.") from None
    if count > len(devices):
        platform = devices[0].platform
        raise ValueError(
            f"make_mesh asked for {count} devices but only {len(devices)} {platform} device(s) "
            "exist. For simulated CPU devices set XLA_FLAGS=--xla_force_host_platform_device_count"
            f"={count} (or jax.config.update('jax_num_cpu_devices', {count})) before JAX starts.")
    return devices[:count]


def make_mesh(shape: int | Sequence[int], axis_names: Sequence[str] | None = None, *,
              device: str | None = None) -> Mesh:
    """Build a device mesh with Auto axis types.

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
    names = _axis_names(axis_names, len(dims))
    devices = _devices(device, math.prod(dims))
    grid = np.array(devices, dtype=object).reshape(dims)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(dims))


def _mesh_shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(shape, bool | str) or not isinstance(shape, int | Sequence):
        raise TypeError(f"make_mesh shape={shape!r} must be a device count (int) or a tuple of "
                        "axis sizes, e.g. 8 or (4, 2).")
    if isinstance(shape, int):
        if shape < 1:
            raise ValueError(f"make_mesh shape={shape} must be a positive device count.")
        return tuple(prime_factors(shape)) or (1,)
    dims = tuple(shape)
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims):
        raise ValueError(f"make_mesh shape={shape!r} must be a non-empty tuple of positive ints, "
                         "e.g. (4, 2).")
    return dims


def _axis_names(names: Sequence[str] | None, rank: int) -> tuple[str, ...]:
    if names is None:
        return tuple(f"d{i}" for i in range(rank))
    if isinstance(names, str) or len(names) != rank:
        raise ValueError(f"make_mesh axis_names={names!r} must name each of the {rank} mesh axes, "
                         f"e.g. {tuple(f'd{i}' for i in range(rank))}.")
    if len(set(names)) != rank or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"make_mesh axis_names={names!r} must be distinct non-empty strings.")
    return tuple(names)
