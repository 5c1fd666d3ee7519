"""Input batches onto the mesh, MindSpore's `dataset_strategy` (and `full_batch`).

Before: a batch (a pytree of host or device arrays) and a dataset strategy. After: the same
pytree of `jax.Array`s with a `NamedSharding` on the mesh, placed as the strategy says:
  - "data_parallel" (default): the leading (batch) dim of every input is split over all devices
    of the mesh (every mesh axis); other dims are whole. With several processes each passes its
    own slice of the batch (its local batch) and the global batch is their concatenation.
  - "full_batch": every input replicated; every process passes the whole global batch.
  - a tuple with one entry per input (one per leaf of the batch, in jax.tree_util order), each a
    tuple of split counts per dim (MindSpore's form, e.g. ((8, 1), (8,))), a `Layout` mapping
    or a `PartitionSpec`; counts map onto mesh axes as `jaxpar.shard`'s in_strategy does. With
    several processes each passes the part of every input its own devices hold.

Errors are MindSpore's: TypeError for a config of the wrong type, ValueError for an unknown
string, an empty config, a wrong number of entries or counts, a non-positive count, a count that
does not divide its dim, or counts whose product exceeds the device count; each names
`dataset_strategy`, the input index and shape.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import numbers
import os
import sys
import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.context import current_context
from jaxpar.distributed import digest, gather_rows
from jaxpar.ir.trace import jax_cannot_hold
from jaxpar.mesh import make_mesh
from jaxpar.strategy import Layout, parse_in_strategy

DATASET_STRATEGIES = ("data_parallel", "full_batch")
Shape = tuple[int, ...]


def parse_dataset_strategy(config: str | tuple, batch: Any,
                           mesh: Mesh | None = None) -> Any:
    """The PartitionSpec of every input under a MindSpore dataset strategy.

    Args:
      config: "data_parallel", "full_batch", or a tuple (or list) with one entry per input (per
        leaf of `batch`, in jax.tree_util order): a tuple (or list) of split counts per dim, a
        `Layout` mapping or a `PartitionSpec`.
      batch: the global batch: a pytree of arrays or `jax.ShapeDtypeStruct`s.
      mesh: the device mesh; default `make_mesh(len(jax.devices()))`.

    Returns:
      A pytree like `batch` with a `PartitionSpec` per leaf: the specs `shard_batch` puts
      it on the mesh in. In one process a "data_parallel" batch the device count does not
      divide is cut over the axes that divide it (batch_spec, with its warning), as
      shard_batch and AutoParallel cut it; with several processes it is a ValueError.

    Example:
      >>> parse_dataset_strategy(((8, 1), (8,)), (x, y), make_mesh(8))
      (PartitionSpec(('d0', 'd1', 'd2'),), PartitionSpec(('d0', 'd1', 'd2'),))
    """
    mesh = _default_mesh(mesh)
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    return jax.tree_util.tree_unflatten(treedef, _batch_specs(
        config, leaves, mesh, uneven=jax.process_count() == 1))


def shard_batch(batch: Any, mesh: Mesh | None = None,
                dataset_strategy: str | tuple | None = None) -> Any:
    """Put a batch on the mesh as `dataset_strategy` says (by default, as the parallel
    context's does).

    One process: `batch` is the global batch and goes to the devices with `jax.device_put`.
    Several processes (`jax.process_count() > 1`): each passes its process-local data (its
    slice of the batch under "data_parallel", the whole batch under "full_batch", the part its
    devices hold under a tuple strategy) and the global arrays are assembled with
    `jax.make_array_from_process_local_data`, after one small all-gather checks that every
    process passed local parts of the same shapes and dtypes (each holds an equal part under
    every strategy); a ValueError in every process names the shapes that differ.

    Args:
      batch: a pytree of arrays (numpy or jax; with several processes, arrays on this
        process's devices: a global jax.Array is a TypeError).
      mesh: the device mesh; default `make_mesh(len(jax.devices()))`.
      dataset_strategy: "data_parallel", "full_batch" or a tuple of per-input strategies (see
        `parse_dataset_strategy`); None (default): the context's
        (`set_auto_parallel_context(dataset_strategy=...)`, "data_parallel" unless set), as
        AutoParallel reads it.

    Returns:
      The same pytree of `jax.Array`s with `NamedSharding`s on `mesh`.

    Example:
      >>> x, y = shard_batch((x, y), jaxpar.make_mesh(8))     # rows split over 8 devices
      >>> x.sharding.spec
      PartitionSpec(('d0', 'd1', 'd2'),)
    """
    mesh = _default_mesh(mesh)
    if dataset_strategy is None:
        dataset_strategy = current_context().dataset_strategy
    if jax.process_count() == 1:
        leaves, treedef = jax.tree_util.tree_flatten(batch)
        specs = _batch_specs(dataset_strategy, leaves, mesh, uneven=True)
        return jax.tree_util.tree_unflatten(treedef, [
            jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(leaves, specs, strict=True)])
    return _from_process_local(batch, mesh, dataset_strategy)


def _batch_specs(config, leaves: list, mesh: Mesh, uneven: bool = False) -> list[P]:
    """The PartitionSpec of each batch leaf (_leaf_specs of their shapes)."""
    return _leaf_specs(config, [_shape(x, i) for i, x in enumerate(leaves)], mesh, uneven)


def process_slabs(process_grid: np.ndarray, axis_names: tuple[str, ...], spec: P,
                  process: int) -> tuple[int, ...]:
    """How many process-local slabs each dim of a global array with `spec` is cut into.

    A dim cut by mesh axes A into n = prod(|A|) pieces, of which `process`'s devices hold m
    distinct ones, has a global size n / m times the process-local size.

    Args:
      process_grid: the process index of every mesh device, shaped like the mesh.
      axis_names: the mesh axis names, in order.
      spec: the array's PartitionSpec.
      process: the process whose local data is considered.

    Returns:
      One int per spec entry: global size / local size of that dim.

    Example:
      >>> grid = np.array([0, 0, 0, 0, 1, 1, 1, 1]).reshape(2, 2, 2)
      >>> process_slabs(grid, ("d0", "d1", "d2"), P(("d0", "d1", "d2")), 0)
      (2,)
    """
    return tuple(_slabs(process_grid, axis_names, entry, process) for entry in spec)


def global_shape(local_shape: Shape, slabs: tuple[int, ...]) -> Shape:
    """The global shape of an array from a process-local shape and `process_slabs`.

    Args:
      local_shape: the shape of the data one process passes.
      slabs: `process_slabs(...)` for its spec (shorter than the rank: the rest are 1).

    Returns:
      The global shape.

    Example:
      >>> global_shape((4, 16), (2,))
      (8, 16)
    """
    return tuple(n * s for n, s in zip(local_shape, slabs + (1,) * len(local_shape), strict=False))


# ---------------------------------------------------------------------------------------------
# Strategies per leaf


def _leaf_specs(config, shapes: list[Shape], mesh: Mesh, uneven: bool = False) -> list[P]:
    if isinstance(config, str):
        if config not in DATASET_STRATEGIES:
            raise ValueError(f"dataset_strategy={config!r} must be one of {DATASET_STRATEGIES} "
                             "or a tuple with one strategy per input, e.g. ((8, 1), (8,)).")
        if config == "full_batch":
            return [P() for _ in shapes]
        warned: set[int] = set()  # batch sizes warned about: once each per call
        return [_data_parallel_spec(shape, i, mesh, uneven, warned)
                for i, shape in enumerate(shapes)]
    if isinstance(config, tuple | list):  # lists as the context and AutoParallel take them
        config = tuple(tuple(e) if isinstance(e, list) else e for e in config)  # (YAML's)
    else:
        raise TypeError(f"dataset_strategy={config!r} must be a str ('data_parallel' or "
                        "'full_batch') or a tuple with one strategy per input, e.g. "
                        "((8, 1), (8,)).")
    if not config:
        raise ValueError("dataset_strategy=() is empty; give one strategy per input, e.g. "
                         f"{tuple(_example(s, mesh) for s in shapes)}.")
    if len(config) != len(shapes):
        raise ValueError(f"dataset_strategy={config!r} has {len(config)} entries but the batch "
                         f"has {len(shapes)} inputs (shapes {shapes}); give one per input, e.g. "
                         f"{tuple(_example(s, mesh) for s in shapes)}.")
    return [_entry_spec(e, s, i, mesh) for i, (e, s) in enumerate(zip(config, shapes,
                                                                       strict=True))]


def _data_parallel_spec(shape: Shape, i: int, mesh: Mesh, uneven: bool = False,
                        warned: set[int] | None = None) -> P:
    """uneven: a batch the device count does not divide is cut as batch_spec says (one
    process); else it is an error (several processes: each holds its equal slice). warned:
    the batch sizes batch_spec has warned about already (this one is added)."""
    axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
    if not shape:
        raise ValueError(f"dataset_strategy='data_parallel': input {i} is a scalar, with no "
                         "batch dim to split; give it a leading batch dim, or use 'full_batch' "
                         "or a tuple strategy with () for it.")
    if shape[0] % mesh.size and uneven:
        first = warned is None or shape[0] not in warned
        if warned is not None:
            warned.add(shape[0])
        return batch_spec(shape, mesh, warn=first) or P()
    if shape[0] % mesh.size:
        raise ValueError(f"dataset_strategy='data_parallel': input {i} of shape {shape} has a "
                         f"batch dim of {shape[0]}, which does not divide over the {mesh.size} "
                         f"devices of the mesh; use a global batch that is a multiple of "
                         f"{mesh.size}, or 'full_batch'.")
    return P(axes) if axes else P()  # trailing dims whole (jaxpar writes no trailing None)


def batch_spec(shape: tuple, mesh: Mesh | AbstractMesh, warn: bool = True) -> P | None:
    """The batch dim cut over every mesh axis; where the device count does not divide the
    batch, over the axes whose sizes multiply to the most that does (the outer first among
    equals), with a warning (unless `warn` is False): the rest of the devices hold copies
    (None: no axis divides it).
    AutoParallel's and shard_batch's 'data_parallel' (one process: the last, partial batch of
    an epoch)."""
    axes, sizes, batch = tuple(mesh.axis_names), dict(mesh.shape), shape[0]
    if batch % mesh.size == 0:
        return P(axes)
    cutting = [a for a in axes if sizes[a] > 1]  # an axis of size 1 cuts nothing
    fits = [c for k in range(len(cutting) - 1, 0, -1) for c in itertools.combinations(cutting, k)
            if batch % math.prod(sizes[a] for a in c) == 0]
    best = max(fits, key=lambda c: math.prod(sizes[a] for a in c), default=())
    ways = math.prod(sizes[a] for a in best)
    if not warn:
        return P(best) if best else None
    warnings.warn(
        f"dataset_strategy 'data_parallel': the batch of {batch} does not divide into "
        f"{mesh.size} devices; " + (f"it is cut {ways} ways, over {' x '.join(best)}, and "
                                    f"each piece is computed on {mesh.size // ways} devices"
                                    if best else "no mesh axis divides it, so every device "
                                    "computes the whole batch") +
        f". Use a batch divisible by {mesh.size}, or give dataset_strategy split counts.",
        stacklevel=_caller_level())
    return P(best) if best else None


def _caller_level() -> int:
    """warnings.warn's stacklevel, for its caller, that names the first frame outside jaxpar
    (the user's call)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # jaxpar/


def _entry_spec(entry, shape: Shape, i: int, mesh: Mesh) -> P:
    where = f"dataset_strategy[{i}]={entry!r} for input {i} of shape {shape}"
    if isinstance(entry, tuple):
        _check_counts(entry, shape, where, mesh)
    elif not isinstance(entry, Layout | P):
        raise TypeError(f"{where}: each entry must be a tuple of split counts (one int per dim, "
                        f"e.g. {_example(shape, mesh)}), a Layout mapping or a PartitionSpec.")
    try:
        [spec] = parse_in_strategy((entry,), (jax.ShapeDtypeStruct(shape, np.float32),), mesh)
    except (TypeError, ValueError) as err:  # the mapping onto mesh axes; reworded for this key
        raise type(err)(f"{where}: {str(err).replace('in_strategy[0]', 'the entry')}") from None
    return spec.to_pspec()


def _check_counts(counts: tuple, shape: Shape, where: str, mesh: Mesh) -> None:
    """MindSpore's checks on one tuple of split counts."""
    example = _example(shape, mesh)
    for c in counts:
        if isinstance(c, bool) or not isinstance(c, numbers.Integral):
            raise TypeError(f"{where}: count {c!r} is a {type(c).__name__}, not an int; give "
                            f"one positive int per dim, e.g. {example}.")
    if len(counts) != len(shape):
        raise ValueError(f"{where}: an input of rank {len(shape)} needs {len(shape)} counts, "
                         f"got {len(counts)}; e.g. {example}.")
    for d, (c, n) in enumerate(zip(counts, shape, strict=True)):
        if c < 1:
            raise ValueError(f"{where}: count {c} for dim {d} is not positive; use 1 for a dim "
                             f"that is not split, e.g. {example}.")
        if n % c:
            raise ValueError(f"{where}: count {c} does not divide dim {d} of size {n}; e.g. "
                             f"{example}.")
    if math.prod(counts) > mesh.size:
        raise ValueError(f"{where}: the counts multiply to {math.prod(counts)}, more than the "
                         f"{mesh.size} devices of the mesh; e.g. {example}.")


def _example(shape: Shape, mesh: Mesh) -> tuple[int, ...]:
    """Counts splitting the first dim as far as the device count allows."""
    if not shape:
        return ()
    first = max(c for c in range(1, mesh.size + 1) if shape[0] % c == 0 and mesh.size % c == 0)
    return (first,) + (1,) * (len(shape) - 1)


def _shape(x, i: int) -> Shape:
    if not hasattr(x, "shape") and not isinstance(x, numbers.Number):
        raise TypeError(f"shard_batch: input {i} is a {type(x).__name__}, not an array; a batch "
                        "is a pytree of arrays.")
    if jax_cannot_hold(x):
        raise TypeError(f"shard_batch: input {i} is a numpy array of dtype {x.dtype}, which JAX "
                        "cannot hold; convert it to a numeric or bool dtype "
                        "(np.asarray(x, dtype=np.float32), say).")
    return tuple(int(n) for n in np.shape(x))


def _default_mesh(mesh: Mesh | None) -> Mesh:
    if mesh is None:
        return make_mesh(len(jax.devices()))
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh={mesh!r} must be a jax.sharding.Mesh, e.g. jaxpar.make_mesh(8), "
                        "or None for all devices.")
    return mesh


# ---------------------------------------------------------------------------------------------
# Several processes


def _from_process_local(batch: Any, mesh: Mesh, config) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    try:
        for i, x in enumerate(leaves):  # (its data cannot be fetched here: it died inside JAX)
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                raise TypeError(
                    f"shard_batch: input {i} is a global jax.Array of shape {tuple(x.shape)} "
                    "over other processes' devices too; with several processes shard_batch "
                    "takes each process's own part of the batch (numpy, or arrays on this "
                    "process's devices). Pass the global array to the sharded function as it "
                    "is, or pass this process's part here.")
        local_shapes = [_shape(x, i) for i, x in enumerate(leaves)]
        dtypes = [np.result_type(x) for x in leaves]
    except (TypeError, ValueError):  # told to the others in the all-gather they wait in
        _check_local_shapes_agree([], [], refused=True)
        raise
    _check_local_shapes_agree(local_shapes, dtypes)
    # First pass: the specs alone. Each dim is inflated by the device count so that only the
    # shape-independent checks can fail here; the second pass checks the real global shapes.
    inflated = [tuple(n * mesh.size for n in s) for s in local_shapes]
    specs = _leaf_specs(config, inflated, mesh)
    grid = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    shapes = [global_shape(s, process_slabs(grid, mesh.axis_names, p, jax.process_index()))
              for s, p in zip(local_shapes, specs, strict=True)]
    try:
        specs = _leaf_specs(config, shapes, mesh)
    except ValueError as err:
        raise ValueError(f"{err} (global shapes {shapes}, assembled from this process's local "
                         f"shapes {local_shapes} over {jax.process_count()} processes)") from None
    arrays = [jax.make_array_from_process_local_data(NamedSharding(mesh, p), np.asarray(x), g)
              for x, p, g in zip(leaves, specs, shapes, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, arrays)


_JAX_DTYPES = (jax.numpy.bfloat16, jax.numpy.float8_e4m3fn, jax.numpy.float8_e5m2)


def _check_local_shapes_agree(shapes: list[Shape], dtypes: list[np.dtype],
                              refused: bool = False) -> None:
    """A ValueError, in every process at once, unless every process passes leaves of the same
    shapes and dtypes: under every strategy the processes' devices hold equal parts, so their
    local parts match (a last batch of an epoch split unevenly does not, and the step compiled
    for it would otherwise fail inside its first collective, or hang). One small all-gather per
    call (a digest); a second only when they differ, to name the shapes. refused: this
    process refused its batch before (it raises its own error when this returns); the others
    raise a ValueError naming it rather than wait for it in their next collective."""
    code = _shape_code(shapes, dtypes)
    every = gather_rows(np.concatenate([digest(code.tobytes()), [int(refused), code.size]]))
    if every[:, -2].any():
        if refused:
            return
        raise ValueError(
            f"shard_batch: process(es) {np.flatnonzero(every[:, -2]).tolist()} refused their "
            "batch (their errors say why), so this process stops too rather than wait for "
            "them. Every process must pass a batch of arrays of the same structure.")
    if (every == every[0]).all():
        return
    width = int(every[:, -1].max())
    padded = np.full(width, -1, np.int32)
    padded[:code.size] = code
    codes = gather_rows(padded)
    mine = jax.process_index()
    other = next(p for p in range(len(every)) if (every[p] != every[mine]).any())
    theirs = _described(codes[other][:every[other, -1]])
    raise ValueError(
        f"shard_batch: this process (process {mine}) passes local inputs {_described(code)}, "
        f"process {other} passes {theirs}. Every process must pass local parts of the same "
        "shapes and dtypes (with data_parallel, the same local batch size): drop or pad an "
        "uneven last batch in every process alike.")


def _shape_code(shapes: list[Shape], dtypes: list[np.dtype]) -> np.ndarray:
    """Shapes and dtypes as int32s: per leaf its rank, dims and dtype (_dtype_code)."""
    out: list[int] = []
    for shape, dtype in zip(shapes, dtypes, strict=True):
        out += [len(shape), *shape, _dtype_code(dtype)]
    return np.array(out, np.int32)


def _dtype_code(dtype: np.dtype) -> int:
    # By name: the extension types (bfloat16, the float8s) share their size's void code.
    return int.from_bytes(hashlib.sha256(np.dtype(dtype).name.encode()).digest()[:3], "little")


def _described(code: np.ndarray) -> str:
    """_shape_code's leaves as '(shape) dtype' strings (numpy's and JAX's dtypes by name)."""
    names = {_dtype_code(np.dtype(t)): np.dtype(t).name
             for t in (*np.sctypeDict.values(), *_JAX_DTYPES)}
    leaves, i = [], 0
    while i < len(code):
        rank = int(code[i])
        shape = tuple(int(n) for n in code[i + 1:i + 1 + rank])
        leaves.append(f"{shape} {names.get(int(code[i + 1 + rank]), 'other dtype')}")
        i += rank + 2
    return "[" + ", ".join(leaves) + "]"


def _slabs(grid: np.ndarray, axis_names: tuple[str, ...], entry, process: int) -> int:
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    picked = [axis_names.index(a) for a in axes]
    pieces = math.prod(grid.shape[j] for j in picked)
    # Rows: one per piece of this dim (its axes flattened); columns: the other mesh axes.
    rows = np.moveaxis(grid, picked, range(len(picked))).reshape(pieces, -1)
    held = int(np.any(rows == process, axis=1).sum())
    if held == 0 or pieces % held:
        raise ValueError(f"process {process} holds {held} of the {pieces} pieces that mesh axes "
                         f"{axes} cut a dim into; a process's devices must hold an equal share of "
                         "every split dim (build the mesh with each process's devices together).")
    return pieces // held
