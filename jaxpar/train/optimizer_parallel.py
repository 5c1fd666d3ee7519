"""Optimizer parallel (MindSpore's `hsdp` / `enable_parallel_optimizer`): ZeRO over the mesh axes
a parameter's plan leaves unused.

Before: a plan's spec for every argument leaf, the leaves' paths and shapes. After: new specs
for some leaves, to be fixed in a second planning round:

  level1  each optimizer-state leaf that belongs to a parameter (Adam's moments, momentum,
          ...; `api.optimizer_followers` pairs them by path) is cut further over the mesh axes
          its parameter's spec does not use (the data-parallel replicas of that parameter):
          every replica keeps 1/n of the state and updates 1/n of the parameter (ZeRO-1).
  level2  the same state layout. The gradient feeding a cut state is then reduce-scattered
          rather than all-reduced: the search prices both and the scatter moves half the bytes,
          so in jaxpar's global-view programs level2 is what level1 compiles to (checked in
          tests/test_auto_parallel.py against the compiled HLO).
  level3  parameters are cut the same way too (FSDP / ZeRO-3): XLA all-gathers each one
          before use, and the step returns it cut, so the loop keeps it cut. Every leaf the
          step returns in place is cut so, whether optimizer state follows it or not (plain
          SGD keeps none).

Leaves smaller than `threshold` KB stay as planned, and so does a leaf the plan already cuts
into at least as many pieces (hsdp never adds bytes per device). `shard_size` (-1: every unused
axis) limits the group a leaf is cut over to unused axes whose sizes multiply to it. The axes
go on the leaf's largest dimension they divide; a leaf no dimension of which they divide stays
as it was.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Collection, Sequence

from jaxpar.spec import MeshInfo, Spec

LEVELS = ("level1", "level2", "level3")


def check_hsdp_args(shard_size, threshold, optimizer_level) -> None:
    """MindSpore's argument errors for hsdp()."""
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or (
            shard_size != -1 and shard_size <= 0):
        raise ValueError(f"hsdp(shard_size={shard_size!r}): must be a positive int (the size of "
                         "the group each optimizer-state leaf is cut over) or -1 (every "
                         "data-parallel axis).")
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ValueError(f"hsdp(threshold={threshold!r}): must be an int >= 0 (KB; smaller "
                         "tensors stay replicated).")
    if optimizer_level not in LEVELS:
        raise ValueError(f"hsdp(optimizer_level={optimizer_level!r}): must be one of "
                         f"{list(LEVELS)}.")


def check_shard_size(shard_size: int, mesh: MeshInfo, key: str | None = None) -> None:
    """shard_size must be -1 or the size of some group of the mesh's axes. key: the parallel
    context's key it came from (None: hsdp's argument)."""
    makeable = {math.prod(c) for k in range(1, len(mesh.sizes) + 1)
                for c in itertools.combinations(mesh.sizes, k)}
    if shard_size != -1 and shard_size not in makeable:
        where = f"hsdp(shard_size={shard_size})" if key is None else \
            f"set_auto_parallel_context: {key}={shard_size}"
        raise ValueError(f"{where}: no group of axes of mesh {mesh.describe()} has that size; "
                         f"use one of {sorted(makeable)} or -1.")


def optimizer_parallel_specs(specs: Sequence[Spec], shapes: Sequence[tuple[int, ...]],
                             nbytes: Sequence[int], followers: dict[int, int], mesh: MeshInfo,
                             level: str = "level1", threshold_kb: int = 64,
                             shard_size: int = -1, params: Collection[int] = ()
                             ) -> dict[int, Spec]:
    """New specs for the leaves optimizer parallel cuts (see the module docstring).

    Args:
      specs: the planned spec of every argument leaf.
      shapes, nbytes: every leaf's shape and size in bytes.
      followers: {optimizer-state leaf: parameter leaf} (`api.optimizer_followers`).
      mesh: the mesh.
      level: "level1", "level2" or "level3".
      threshold_kb: leaves under this many KB are left alone.
      shard_size: group size to cut over, or -1 for every axis the parameter leaves unused.
      params: more parameter leaves level3 cuts: those the step returns in place that no
        optimizer state follows (plain SGD keeps none, and a parameter that is one bare
        array pairs with none by path); level3 cut only parameters with followers before.

    Returns:
      {leaf index: Spec} for every leaf whose spec changes.

    Example:
      >>> optimizer_parallel_specs([Spec(((), ())), Spec(((), ()))], [(64, 64)] * 2,
      ...                          [16384] * 2, {1: 0}, MeshInfo(("d",), (8,)), "level1", 0)
      {1: Spec(dims=(('d',), ()))}
    """
    check_hsdp_args(shard_size, threshold_kb, level)
    check_shard_size(shard_size, mesh)
    _check_leaves(specs, shapes, nbytes, followers, params)
    leaves = set(followers) | (set(followers.values()) | set(params) if level == "level3"
                               else set())
    out = {}
    for i in sorted(leaves):
        if nbytes[i] < threshold_kb * 1024:
            continue
        base = specs[followers.get(i, i)]
        spec = _cut_further(base, shapes[i], mesh, shard_size)
        # Only further: a state leaf the plan already cuts into as many pieces (the search
        # may cut Adam's moments over every device) keeps its own spec.
        if spec is not None and spec.shards(mesh) > specs[i].shards(mesh):
            out[i] = spec
    return out


def _check_leaves(specs: Sequence[Spec], shapes: Sequence[tuple[int, ...]],
                  nbytes: Sequence[int], followers: dict[int, int],
                  params: Collection[int]) -> None:
    """optimizer_parallel_specs' leaves: one spec, shape and size each, and every index that
    `followers` and `params` name one of them (a ValueError naming the argument, not an
    IndexError from inside)."""
    n = len(specs)
    if len(shapes) != n or len(nbytes) != n:
        raise ValueError(f"optimizer_parallel_specs: specs, shapes and nbytes describe the same "
                         f"leaves, one entry each; got {n}, {len(shapes)} and {len(nbytes)}.")
    named = [("followers", i) for pair in followers.items() for i in pair] + \
        [("params", i) for i in params]
    for where, i in named:
        if not isinstance(i, numbers.Integral) or isinstance(i, bool) or not 0 <= i < n:
            raise ValueError(f"optimizer_parallel_specs: {where} names leaf {i!r}, but there "
                             f"are {n} leaves (indices 0..{n - 1}).")


def _cut_further(spec: Spec, shape: tuple[int, ...], mesh: MeshInfo,
                 shard_size: int) -> Spec | None:
    """spec with the group of unused axes added to the largest dim it divides, or None."""
    group = _group(spec, mesh, shard_size)
    if not group:
        return None
    n = mesh.group_size(group)
    local = spec.local_shape(shape, mesh)
    dims = [d for d in sorted(range(len(shape)), key=lambda d: -local[d]) if local[d] % n == 0]
    if not dims:
        return None
    d = dims[0]
    new = tuple(mesh.order(axes + group) if k == d else axes for k, axes in enumerate(spec.dims))
    return Spec(new)


def _group(spec: Spec, mesh: MeshInfo, shard_size: int) -> tuple[str, ...]:
    """The axes spec leaves unused, or the subset of them of size shard_size (the inner axes
    first, where replicas of one parameter sit closest)."""
    unused = tuple(a for a in mesh.names if a not in spec.axes())
    if shard_size == -1:
        return unused
    for k in range(len(unused), 0, -1):
        for combo in itertools.combinations(reversed(unused), k):
            if math.prod(mesh.axis_size(a) for a in combo) == shard_size:
                return mesh.order(combo)
    return ()
