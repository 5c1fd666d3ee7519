"""Sharded checkpoints with orbax: save a training state, restore it onto any mesh.

Before: a training state (params, optax state, a step counter, ...) is a pytree of jax.Arrays
sharded on some mesh, numpy arrays and python scalars. After `save_checkpoint` it is on disk in
orbax's format, written completely: in one directory, or in `path/<step>` when a step is given,
where `latest_step` and `checkpoint_steps` find it. `restore_checkpoint` reads it back onto the
shardings you ask for (another mesh, fewer devices, other PartitionSpecs); each device reads only
its own shards. The saved metadata is checked against the restore target first, so a wrong
structure, shape, dtype or sharding is a `ValueError` that names the leaf, not an orbax traceback.
Each save also records the size and crc32 of every file it wrote (`_CHECKSUMS.json`, beside
orbax's files); a restore checks them before orbax reads anything, so a flipped byte, a truncated
or a missing file is a `ValueError` naming the file, not silently wrong values. With several
processes, each call's checks run in every process before orbax's collectives and one small
all-gather shares their outcome (_together): a call one process refuses is refused by all.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from jaxpar.distributed import gather_rows
from jaxpar.ir.trace import jax_cannot_hold

PathLike = str | os.PathLike[str]
KeyPath = tuple[Any, ...]
T = TypeVar("T")

# Step directories are named "<step>" (orbax's standard format, as CheckpointManager writes them).
_STEP_NAMES = ocp.step.standard_name_format()
_SCALARS = bool | int | float
_METADATA_FILE = "_CHECKPOINT_METADATA"  # orbax writes it as it finishes a checkpoint
# jaxpar's own, written once orbax is done: every other file's size and crc32 by relative path.
_CHECKSUM_FILE = "_CHECKSUMS.json"
_CHUNK_BYTES = 1 << 22  # files are checksummed in 4 MiB reads, never loaded whole
log = logging.getLogger("jaxpar.train.checkpoint")
# The attribute naming each kind of pytree key (DictKey and FlattenedIndexKey use "key").
_KEY_FIELDS = {jax.tree_util.SequenceKey: "idx", jax.tree_util.GetAttrKey: "name"}


def save_checkpoint(path: PathLike, state: Any, *, step: int | None = None,
                    overwrite: bool = False) -> Path:
    """Save a pytree of arrays and scalars, sharded or not, and wait until it is on disk.

    Every process of a multi-process run must call this with the same arguments; each writes
    only the shards it holds. When one process refuses its call (a leaf it cannot save, a
    checkpoint already there), every process raises before anything is written: that one its
    own error, the others a ValueError naming it. Once all have written, process 0 records
    the size and crc32 of every file of the checkpoint in `_CHECKSUMS.json` beside them,
    which `restore_checkpoint` checks.

    Args:
      path: checkpoint directory; a relative path is resolved against the working directory.
      state: a pytree of jax.Arrays (any sharding), numpy arrays and python scalars, e.g.
        `{"params": params, "opt_state": opt_state, "step": 3}`.
      step: when given, save into `path/<step>` so that `latest_step(path)` finds it.
      overwrite: replace a checkpoint already at that directory instead of raising.

    Returns:
      The absolute directory the checkpoint was written to.

    Example:
      >>> save_checkpoint("ckpt", {"params": params, "opt_state": opt_state}, step=100)
      PosixPath('/home/me/run/ckpt/100')
    """
    def checked() -> tuple[Path, bool]:
        directory = _absolute(path, "path")
        if step is not None:
            directory = directory / _STEP_NAMES.build_name(_check_step(step))
        _check_state(state)
        return directory, _check_destination(directory, overwrite)

    (directory, replace), _ = _together("save_checkpoint", checked)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory, state, force=replace)
        checkpointer.wait_until_finished()
    _write_checksums(directory)
    return directory


def restore_checkpoint(path: PathLike, target: Any, *, step: int | None = None,
                       mesh: Mesh | None = None, shardings: Any = None) -> Any:
    """Restore a checkpoint onto the requested shardings.

    Each array leaf lands on, by precedence: its entry in `shardings`; else the target leaf's own
    `.sharding` (jax.Array, or jax.ShapeDtypeStruct built with `sharding=`); else replicated on
    `mesh`; else the default device. Without any of these a numpy target leaf comes back as a
    numpy array. Python scalar leaves come back as python scalars.

    Before orbax reads anything, every file listed in the checkpoint's `_CHECKSUMS.json` (all
    that `save_checkpoint` wrote) must be there with its saved size and crc32. A checkpoint
    saved before jaxpar wrote checksums has no such file and restores unverified.

    Args:
      path: a checkpoint directory, or a directory of numbered steps (see `step`).
      target: a pytree with the saved structure whose leaves are jax.Arrays,
        jax.ShapeDtypeStructs, numpy arrays or python scalars of the saved shapes and dtypes.
      step: the step to restore from `path/<step>`; None restores `path` itself when it holds a
        checkpoint, else its latest step.
      mesh: replicate leaves that carry no sharding on this mesh; also turns PartitionSpec
        entries of `shardings` into NamedShardings.
      shardings: one `Sharding` (or PartitionSpec, with `mesh`) for every array leaf, or a pytree
        matching `target` of those or None (None: fall back to the rules above).

    Returns:
      A pytree with the structure of `target` holding the saved values.

    Raises:
      FileNotFoundError: `path` or the step does not exist or holds no checkpoint.
      ValueError: a file of the checkpoint is missing or was changed after it was saved (its
        size or crc32 differs; the error names it); the target's structure, shapes or dtypes
        differ from the checkpoint's; a sharding does not fit its leaf; or, with several
        processes, another process refused the call (it raises its own error; all raise
        before orbax reads anything).

    Example:
      >>> mesh4 = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
      >>> state = restore_checkpoint("ckpt", abstract_state, mesh=mesh4,
      ...                            shardings=NamedSharding(mesh4, P()))
    """
    def located() -> tuple[Path, bool, list[str]]:
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(f"restore_checkpoint: mesh={mesh!r} must be a jax.sharding.Mesh "
                            "or None.")
        directory = _checkpoint_directory(_absolute(path, "path"), step)
        return directory, *_checked_share(directory)

    (directory, verified, damaged), counts = _together("restore_checkpoint", located,
                                                       lambda found: len(found[2]))
    _refuse_damage(directory, damaged, counts)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(target)

    def placed() -> list:
        tree = _tree_metadata(directory)
        saved = _saved_leaves(tree, directory)
        _check_structure(leaves, saved, directory, target, tree)
        placements = _explicit_shardings(treedef, leaves, shardings, mesh)
        return [_restore_leaf(keypath, leaf, saved[_names(keypath)][1], placement, mesh)
                for (keypath, leaf), placement in zip(leaves, placements, strict=True)]

    restore_target, _ = _together("restore_checkpoint", placed)
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            restored = checkpointer.restore(directory, treedef.unflatten(restore_target))
        except Exception as err:  # tensorstore's: a data file missing or cut short
            if "tree structures do not match" in str(err):  # the leaves' names agreed
                raise ValueError(
                    f"restore_checkpoint: target's containers differ from the checkpoint's at "
                    f"{directory} (orbax: {_first_line(err)}): its leaves have the saved names "
                    "but a tuple or list was saved where target has a dict, or the reverse. "
                    "The target must have the saved structure.") from None
            why = ("its files match the checksums saved with them, so look at where the "
                   "target places them (shardings, mesh: devices this process can use)"
                   if verified else "its data files may be missing or damaged")
            raise ValueError(f"restore_checkpoint: the arrays of the checkpoint at "
                             f"{directory} cannot be read ({type(err).__name__}: "
                             f"{_first_line(err)}); {why}.") from None
    # A numpy scalar target (np.float32(0.1)) is restored through a 0-d array: back to one.
    scalars = [isinstance(leaf, np.generic) for _, leaf in leaves]
    if not any(scalars):
        return restored
    values = treedef.flatten_up_to(restored)
    return treedef.unflatten([np.asarray(v)[()] if scalar else v
                              for v, scalar in zip(values, scalars, strict=True)])


def checkpoint_steps(path: PathLike) -> list[int]:
    """Steps saved under `path` by `save_checkpoint(path, ..., step=...)`, ascending.

    Args:
      path: the directory holding numbered step directories.

    Returns:
      The saved steps; empty when `path` does not exist or holds none. A step directory that
      holds no checkpoint (empty) is left out; a damaged one is listed, and restoring it
      raises a ValueError naming it.

    Example:
      >>> checkpoint_steps("ckpt")
      [100, 200, 300]
    """
    root = _absolute(path, "path")
    if not root.is_dir():
        return []
    # Only steps that hold a checkpoint (orbax's metadata file, or the checksums written after
    # it): a step directory made by hand, or left empty, is no step to resume from.
    return sorted(m.step for m in _STEP_NAMES.find_all(root)
                  if any((root / _STEP_NAMES.build_name(m.step) / name).is_file()
                         for name in (_METADATA_FILE, _CHECKSUM_FILE)))


def latest_step(path: PathLike) -> int | None:
    """The newest step saved under `path`, or None when there is none.

    Args:
      path: the directory holding numbered step directories.

    Returns:
      The largest saved step, or None.

    Example:
      >>> start = (latest_step("ckpt") or 0) + 1
    """
    steps = checkpoint_steps(path)
    return steps[-1] if steps else None


def _absolute(path: PathLike, name: str) -> Path:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{name}={path!r} must be a str or os.PathLike directory path.")
    return Path(path).expanduser().resolve()


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int | np.integer):
        raise TypeError(f"step={step!r} must be a non-negative int, e.g. step=100.")
    if step < 0:
        raise ValueError(f"step={step} must be a non-negative int, e.g. step=100.")
    return int(step)


def _check_state(state: Any) -> None:
    leaves = jax.tree_util.tree_leaves_with_path(state)
    if not leaves:
        raise ValueError(f"save_checkpoint: state={state!r} holds no arrays or scalars to save.")
    for keypath, leaf in leaves:
        _check_saveable(keypath, leaf)


def _check_saveable(keypath: KeyPath, leaf: Any) -> None:
    where = f"state{jax.tree_util.keystr(keypath)}"
    if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        raise TypeError(f"save_checkpoint: {where} is a typed PRNG key array; save "
                        "jax.random.key_data(key) and rebuild it with jax.random.wrap_key_data.")
    if not isinstance(leaf, jax.Array | np.ndarray | np.generic | _SCALARS):
        raise TypeError(f"save_checkpoint: {where} is a {type(leaf).__name__} ({leaf!r}); "
                        "checkpoints hold jax.Arrays, numpy arrays and python bool/int/float.")
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
        raise ValueError(f"save_checkpoint: {where} was deleted (a donated buffer: the step "
                         "that took it returned its replacement); save the arrays the step "
                         "returned.")
    if isinstance(leaf, jax.Array) and jax.process_count() > 1 and leaf.is_fully_addressable:
        raise ValueError(f"save_checkpoint: {where} lives on this process's devices only "
                         f"({leaf.sharding}), so each process holds its own copy and the "
                         "checkpoint, written by all processes together, cannot hold it "
                         "(optax's step count right after init, say). Place it over the mesh "
                         "first: jax.device_put(x, NamedSharding(mesh, PartitionSpec())).")
    if isinstance(leaf, np.ndarray | np.generic) and (jax_cannot_hold(leaf) or
                                                      _too_wide(leaf.dtype)):
        raise TypeError(f"save_checkpoint: {where} is a numpy {type(leaf).__name__} of dtype "
                        f"{leaf.dtype}, which the checkpoint format cannot hold; convert it to "
                        "a numeric or bool dtype JAX has, or leave it out of the state.")
    if type(leaf) is int and not -2 ** 63 <= leaf < 2 ** 64:
        raise ValueError(f"save_checkpoint: {where} is the int {leaf}, outside 64 bits, which "
                         "the checkpoint format cannot hold; save it as a str elsewhere, or "
                         "split it.")
    if isinstance(leaf, jax.Array | np.ndarray) and leaf.size == 0:
        raise ValueError(f"save_checkpoint: {where} has no elements (shape {leaf.shape}), "
                         "which the checkpoint format cannot hold; leave it out of the state.")


def _too_wide(dtype) -> bool:
    """Whether a numpy float or complex dtype is wider than any JAX has (long double): JAX
    cannot hold it either, and tensorstore refused it mid-save, naming no leaf (as it did
    strings, objects, datetimes and structured dtypes: ir.trace.jax_cannot_hold)."""
    d = np.dtype(dtype)
    return d.kind in "fc" and d.itemsize > (16 if d.kind == "c" else 8)


def _check_destination(directory: Path, overwrite: bool) -> bool:
    """Whether orbax must replace `directory`; raises when that is not allowed, or where it
    cannot be made (orbax raised about its own temporary directory, and its threads then held
    the process for five minutes at exit)."""
    if not directory.exists():
        above = next(p for p in directory.parents if p.exists())
        if not above.is_dir() or not os.access(above, os.W_OK | os.X_OK):
            what = "is a file" if not above.is_dir() else "is not writable"
            raise ValueError(f"save_checkpoint: cannot make {directory}: {above} {what}. Pass "
                             "a path under a directory you can write to.")
        return False
    if not directory.is_dir():
        raise ValueError(f"save_checkpoint: {directory} is a file, not a checkpoint directory.")
    if not any(directory.iterdir()):
        return True
    try:
        found = _tree_metadata(directory) is not None
    except ValueError:  # a damaged checkpoint: replaced like any other with overwrite=True
        found = True
    if not found:
        raise ValueError(f"save_checkpoint: {directory} is a non-empty directory that holds no "
                         "checkpoint; refusing to write over it even with overwrite=True. "
                         "Pick another path or step.")
    if not overwrite:
        raise ValueError(f"save_checkpoint: a checkpoint already exists at {directory}; pass "
                         "overwrite=True to replace it, or save under another path or step.")
    return True


def _checkpoint_directory(root: Path, step: int | None) -> Path:
    if not root.exists():
        raise FileNotFoundError(f"restore_checkpoint: no checkpoint at {root}: it does not exist.")
    steps = checkpoint_steps(root)
    if step is not None:
        if _check_step(step) not in steps:
            raise FileNotFoundError(f"restore_checkpoint: no step {step} under {root}; saved "
                                    f"steps: {steps or 'none'}.")
        return root / _STEP_NAMES.build_name(step)
    # A checksum file marks a checkpoint too, and is verified before its metadata is read.
    if (root / _CHECKSUM_FILE).is_file() or _tree_metadata(root) is not None:
        return root
    if not steps:
        raise FileNotFoundError(f"restore_checkpoint: {root} holds no checkpoint: neither a "
                                "saved state nor numbered step directories.")
    return root / _STEP_NAMES.build_name(steps[-1])


def _tree_metadata(directory: Path) -> Any:
    """Orbax's metadata tree of the checkpoint in `directory`, or None when there is none; a
    ValueError naming the directory when its metadata cannot be read."""
    handler = ocp.StandardCheckpointHandler()
    try:
        return handler.metadata(directory).tree
    except FileNotFoundError:
        return None
    except Exception as err:  # orbax's JSON and tensorstore errors: a damaged checkpoint
        raise ValueError(f"the checkpoint at {directory} is damaged: its metadata cannot be "
                         f"read ({type(err).__name__}: {_first_line(err)}).") from None
    finally:
        handler.close()


def _write_checksums(directory: Path) -> None:
    """Process 0 records the size and crc32 of every file in `directory`. Orbax's wait returned
    past its commit barrier, so all processes' files are there; the others wait for the record."""
    if jax.process_index() == 0:
        files = _checksums(directory, _saved_files(directory))
        partial = directory / f"{_CHECKSUM_FILE}.partial"
        partial.write_text(json.dumps({"files": files, "crc32": _record_crc(files)}, indent=1))
        partial.replace(directory / _CHECKSUM_FILE)  # never half a record under the final name
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"jaxpar checkpoint checksums {directory.name}")


def _saved_files(directory: Path) -> list[str]:
    return sorted(path.relative_to(directory).as_posix() for path in directory.rglob("*")
                  if path.is_file() and not path.name.startswith(_CHECKSUM_FILE))


def _checksums(directory: Path, names: list[str]) -> dict[str, dict[str, int] | None]:
    """Size and crc32 of each named file (None: missing); files are read on a few threads, as
    zlib releases the GIL."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        return dict(zip(names, pool.map(lambda name: _checksum(directory / name), names),
                        strict=True))


def _checksum(path: Path) -> dict[str, int] | None:
    size, crc = 0, 0
    try:
        with path.open("rb") as file:
            while chunk := file.read(_CHUNK_BYTES):
                size, crc = size + len(chunk), zlib.crc32(chunk, crc)
    except FileNotFoundError:
        return None
    return {"size": size, "crc32": crc}


def _record_crc(files: Any) -> int:
    # The record's own checksum: a damaged record is named as such, not blamed on a data file.
    return zlib.crc32(json.dumps(files, sort_keys=True).encode())


def _checked_share(directory: Path) -> tuple[bool, list[str]]:
    """This process's share of `directory`'s files (_share) checked against their saved size
    and crc32: (whether the checkpoint has checksums, what differs, one line per file). With
    several processes each reads a share of the bytes, so the checkpoint is read once more in
    all, not once per process; _refuse_damage then raises in every process if any share was
    damaged. A checkpoint saved without checksums has nothing to check: (False, [])."""
    saved = _read_checksums(directory)
    if saved is None:
        log.debug("%s has no %s (saved before jaxpar recorded checksums): restored unverified.",
                  directory, _CHECKSUM_FILE)
        return False, []
    mine = _share(saved, jax.process_index(), jax.process_count())
    found = _checksums(directory, mine)
    return True, [_damage(name, saved[name], found[name]) for name in mine
                  if found[name] != saved[name]]


def _refuse_damage(directory: Path, damaged: list[str], counts: list[int]) -> None:
    """A ValueError in every process when any process's share of the files was damaged
    (`counts`: how many each found; `damaged`: this process's lines): the files found here
    are named, or the processes that found them."""
    if not any(counts):
        return
    again = ("restore an earlier step, or copy the checkpoint again from where it was "
             "written.")
    if not damaged:
        others = [p for p, n in enumerate(counts) if n]
        raise ValueError(f"restore_checkpoint: the checkpoint at {directory} is damaged: "
                         f"{sum(counts)} of its files, checked by process(es) {others}, were "
                         f"changed after it was saved (their errors name them); {again}")
    shown = "; ".join(damaged[:5]) + (f"; and {len(damaged) - 5} more" if damaged[5:] else "")
    which = "The file was" if len(damaged) == 1 else f"These {len(damaged)} files were"
    raise ValueError(f"restore_checkpoint: the checkpoint at {directory} is damaged: {shown}. "
                     f"{which} changed after the checkpoint was saved (a disk, copy or sync "
                     f"error, or an edit), so the restored values would be wrong; {again}")


def _together(what: str, checks: Callable[[], T],
              count: Callable[[T], int] = lambda _: 0) -> tuple[T, list[int]]:
    """checks()'s result in every process, and count(result) of each process (in process
    order), before any goes on into orbax's collectives. With several processes one small
    all-gather tells each whether another's checks raised: that process raises its own error,
    and every other a ValueError naming it. Without it a process refused its call (a
    state it cannot save, a step its disk lacks) while the others went on into orbax's
    barriers, and waited there forever, or met the refused process's next call and mixed the
    two. One process: checks() and its count, no collective."""
    several = jax.process_count() > 1
    try:
        result = checks()
    except Exception:
        if several:
            gather_rows(np.array([1, 0]))
        raise
    mine = count(result)
    if not several:
        return result, [mine]
    rows = gather_rows(np.array([0, mine]))
    refused = [p for p, row in enumerate(rows.tolist()) if row[0]]
    if refused:
        raise ValueError(f"{what}: process(es) {refused} refused this call (their errors say "
                         "why) before anything was written or read, so this process stops too "
                         "rather than wait for them. Every process must call it with the same "
                         "path, step and structure, on the same files.")
    return result, [int(n) for n in rows[:, 1]]


def _share(saved: dict[str, dict[str, int]], process: int, count: int) -> list[str]:
    """The files `process` of `count` checks: the largest first, each to the process with the
    fewest bytes so far (every process computes the same split from the same record)."""
    if count == 1:
        return list(saved)
    load, owner = [0] * count, {}
    for name in sorted(saved, key=lambda n: (-saved[n]["size"], n)):
        least = min(range(count), key=lambda p: (load[p], p))
        owner[name], load[least] = least, load[least] + saved[name]["size"]
    return [name for name in saved if owner[name] == process]


def _read_checksums(directory: Path) -> dict[str, dict[str, int]] | None:
    try:
        record = json.loads((directory / _CHECKSUM_FILE).read_text())
        intact = record["crc32"] == _record_crc(record["files"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):  # not JSON, or not the record jaxpar writes
        intact = False
    if not intact:
        raise ValueError(f"restore_checkpoint: the checkpoint at {directory} is damaged: its "
                         f"checksum record {_CHECKSUM_FILE} was changed after it was saved, so "
                         "its files cannot be verified; restore an earlier step, or copy the "
                         "checkpoint again from where it was written.")
    return record["files"]


def _damage(name: str, saved: dict[str, int], found: dict[str, int] | None) -> str:
    if found is None:
        return f"{name} is missing"
    if found["size"] != saved["size"]:
        return f"{name} has {found['size']} bytes, {saved['size']} when saved"
    return f"{name} has crc32 {found['crc32']:#010x}, {saved['crc32']:#010x} when saved"


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [""])[0][:300]


def _saved_leaves(tree: Any, directory: Path) -> dict[tuple[str, ...], tuple[KeyPath, Any]]:
    """Saved leaves of the checkpoint in `directory` (its metadata `tree`) by normalized
    path: their orbax key path and value metadata."""
    if tree is None:
        raise FileNotFoundError(f"restore_checkpoint: {directory} holds no checkpoint.")
    return {_names(keypath): (keypath, metadata)
            for keypath, metadata in jax.tree_util.tree_leaves_with_path(tree)}


def _names(keypath: KeyPath) -> tuple[str, ...]:
    # Orbax stores tuples as lists and namedtuples/dataclasses as dicts: compare keys by name.
    return tuple(str(getattr(key, _KEY_FIELDS.get(type(key), "key"), key)) for key in keypath)


def _check_structure(leaves: list[tuple[KeyPath, Any]],
                     saved: dict[tuple[str, ...], tuple[KeyPath, Any]], directory: Path,
                     target: Any, tree: Any) -> None:
    """target's leaves (`leaves`) and empty entries against the checkpoint's (`saved`, its
    metadata `tree`): a ValueError naming the first that differs."""
    target_names = {_names(keypath) for keypath, _ in leaves}
    for keypath, leaf in leaves:
        if _names(keypath) not in saved:
            raise ValueError(
                f"restore_checkpoint: target{jax.tree_util.keystr(keypath)} (shape "
                f"{_shape(leaf)}) is not in the checkpoint at {directory}, which holds "
                f"{_describe(saved)}. The target must have the saved structure.")
    for names, (keypath, metadata) in saved.items():
        if names not in target_names:
            raise ValueError(
                f"restore_checkpoint: the checkpoint at {directory} holds "
                f"{jax.tree_util.keystr(keypath)} (shape {tuple(metadata.shape)}) but target has "
                "no such leaf. The target must have the saved structure.")
    # Empty entries last: a target missing a whole saved subtree (optax state with an
    # EmptyState in it) is named by its arrays, not by the empty entry inside it.
    empty = [_empty(target), _empty(tree)]
    for mine, theirs, how in ((empty[0], empty[1], "target has an empty entry at "),
                              (empty[1], empty[0], "the checkpoint holds an empty entry at ")):
        for names in sorted(mine - theirs):
            raise ValueError(f"restore_checkpoint: {how}{'/'.join(names)} (None, or a "
                             "container of no arrays) where the other has none (the "
                             f"checkpoint at {directory} holds "
                             f"{_describe(saved)}). The target must have the saved structure.")


def _empty(tree: Any) -> set[tuple[str, ...]]:
    """The names of a tree's empty entries (None, or a container of no leaves: optax's
    EmptyState, saved as None), which hold no leaf but are structure."""
    def empty(x: Any) -> bool:
        return not jax.tree_util.tree_leaves(x)

    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=empty)[0]
    return {_names(keypath) for keypath, x in found if empty(x)}


def _describe(saved: dict[tuple[str, ...], tuple[KeyPath, Any]]) -> str:
    shown = [jax.tree_util.keystr(keypath) for keypath, _ in list(saved.values())[:6]]
    more = f", ... ({len(saved)} leaves)" if len(saved) > len(shown) else ""
    return ", ".join(shown) + more


def _shape(leaf: Any) -> tuple[int, ...]:
    return tuple(leaf.shape) if hasattr(leaf, "shape") else ()


def _explicit_shardings(treedef: Any, leaves: list[tuple[KeyPath, Any]], shardings: Any,
                        mesh: Mesh | None) -> list[Sharding | None]:
    """One explicit sharding (or None) per target leaf, from the `shardings` argument."""
    if shardings is None or isinstance(shardings, Sharding | PartitionSpec):
        return [_as_sharding((), shardings, mesh)] * len(leaves)
    try:
        flat = treedef.flatten_up_to(shardings)
    except (ValueError, TypeError) as err:
        raise ValueError("restore_checkpoint: shardings must be one Sharding or a pytree with "
                         f"target's structure ({treedef}); it does not match: {err}") from None
    return [_as_sharding(keypath, entry, mesh)
            for (keypath, _), entry in zip(leaves, flat, strict=True)]


def _as_sharding(keypath: KeyPath, entry: Any, mesh: Mesh | None) -> Sharding | None:
    where = f"shardings{jax.tree_util.keystr(keypath)}"
    if entry is None or isinstance(entry, Sharding):
        return entry
    if isinstance(entry, PartitionSpec):
        if mesh is None:
            raise TypeError(f"restore_checkpoint: {where}={entry} is a PartitionSpec but no "
                            "mesh= was given; pass mesh= or a NamedSharding(mesh, spec).")
        unknown = [a for part in entry if part is not None
                   for a in (part if isinstance(part, tuple) else (part,))
                   if a not in mesh.axis_names]
        if unknown:
            raise ValueError(f"restore_checkpoint: {where}={entry} names axes {unknown} that "
                             f"mesh= lacks (its axes: {mesh.axis_names}); use those.")
        return NamedSharding(mesh, entry)
    raise TypeError(f"restore_checkpoint: {where}={entry!r} must be a jax.sharding.Sharding, "
                    "a PartitionSpec (with mesh=) or None.")


def _restore_leaf(keypath: KeyPath, leaf: Any, saved: Any, explicit: Sharding | None,
                  mesh: Mesh | None) -> Any:
    """What orbax restores this leaf into: the python scalar, a numpy array or a placed struct."""
    where = f"target{jax.tree_util.keystr(keypath)}"
    if isinstance(leaf, _SCALARS):
        _check_shape(where, (), saved)
        kinds = {"b": "bool", "i": "int", "u": "int", "f": "float", "c": "complex"}
        held = kinds.get(np.dtype(saved.dtype).kind, str(saved.dtype))
        mine = "bool" if isinstance(leaf, bool) else "int" if isinstance(leaf, int) else "float"
        if held != mine:  # orbax casts to the target's type: 0.25 came back 0
            raise ValueError(f"restore_checkpoint: {where} is a Python {mine} "
                             f"but the checkpoint holds a {held} ({saved.dtype}) there; give a "
                             f"{held} target (its value is not used) and cast after restoring.")
        return leaf
    if not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct | np.ndarray | np.generic):
        raise TypeError(f"restore_checkpoint: {where} is a {type(leaf).__name__}; target leaves "
                        "must be jax.Arrays, jax.ShapeDtypeStructs, numpy arrays or scalars.")
    shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
    _check_shape(where, shape, saved)
    _check_dtype(where, shape, dtype, saved)
    sharding = _placement(leaf, explicit, mesh)
    if sharding is None:  # orbax restores numpy arrays, not numpy scalars
        return np.asarray(leaf) if isinstance(leaf, np.generic) else leaf
    _check_sharding(where, shape, sharding)
    if jax.dtypes.canonicalize_dtype(dtype) != dtype:  # restored as float32/int32, silently
        raise ValueError(f"restore_checkpoint: {where} is {dtype} (shape {shape}), which a "
                         f"jax.Array holds as {jax.dtypes.canonicalize_dtype(dtype)} unless "
                         "64-bit mode is on: the values would be rounded or wrapped. Enable it "
                         "(jax.config.update('jax_enable_x64', True)), or restore into a numpy "
                         "target with mesh=None and place it yourself.")
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _placement(leaf: Any, explicit: Sharding | None, mesh: Mesh | None) -> Sharding | None:
    if explicit is not None:
        return explicit
    if getattr(leaf, "sharding", None) is not None:
        return leaf.sharding
    if mesh is not None:
        return NamedSharding(mesh, PartitionSpec())
    if isinstance(leaf, np.ndarray | np.generic):
        return None
    return SingleDeviceSharding(jax.local_devices()[0])  # (jax.devices()[0]: process 0's)


def _check_shape(where: str, shape: tuple[int, ...], saved: Any) -> None:
    if tuple(saved.shape) != shape:
        raise ValueError(f"restore_checkpoint: {where} has shape {shape} but the checkpoint "
                         f"holds shape {tuple(saved.shape)} ({saved.dtype}) there.")


def _check_dtype(where: str, shape: tuple[int, ...], dtype: np.dtype, saved: Any) -> None:
    saved_dtype = np.dtype(saved.dtype)
    if isinstance(saved, ocp.metadata.ScalarMetadata):
        # A saved python scalar has no dtype of its own: int may restore as int32 or int64.
        saved_dtype = jax.dtypes.canonicalize_dtype(saved_dtype)
        dtype = jax.dtypes.canonicalize_dtype(dtype)
    if saved_dtype != dtype:
        raise ValueError(f"restore_checkpoint: {where} has dtype {dtype} (shape {shape}) but the "
                         f"checkpoint holds {saved_dtype} (shape {tuple(saved.shape)}); make "
                         "the target's dtype match and cast after restoring.")


def _check_sharding(where: str, shape: tuple[int, ...], sharding: Sharding) -> None:
    if isinstance(sharding, NamedSharding) and len(sharding.spec) > len(shape):
        raise ValueError(f"restore_checkpoint: the sharding for {where} has spec {sharding.spec}, "
                         f"too long for its shape {shape} (rank {len(shape)}); use a spec of at "
                         f"most {len(shape)} entries (P() replicates), or pass shardings as a "
                         "pytree with one entry per leaf.")
    try:
        sharding.shard_shape(shape)
    except ValueError as err:
        raise ValueError(f"restore_checkpoint: the sharding for {where} (shape {shape}) does not "
                         f"divide it evenly: {err}. Pick mesh axes whose sizes divide the "
                         "dimensions, or replicate that dimension.") from None
