"""Shardings as jaxpar reasons about them: which mesh axes cut which tensor dimension.

A `Spec` is the normalised form of a `PartitionSpec`: one tuple of mesh axis names per tensor
dimension (listed in mesh order), plus the axes over which the value is still a partial result
that needs a reduction. An `OpStrategy` is one way to run one op: the spec each input must have,
and the spec each output comes out with. `MeshInfo` is the part of a mesh the planner needs
(axis names and sizes), so plans can be made for meshes larger than the machine.

The searches ask these objects the same questions millions of times, so answers are kept:
equal Specs are one object (interned, compared and hashed by identity), a Spec remembers its
axes, shards and fits per mesh, and a MeshInfo its group sizes (and what rules list on it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from jax.sharding import PartitionSpec as P

Axes = tuple[str, ...]


@dataclass(frozen=True)
class MeshInfo:
    """Axis names and sizes of a device mesh, outermost axis first."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    # Group sizes by axes, and whatever else callers price per mesh (filled as asked).
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def of(mesh) -> MeshInfo:
        """The MeshInfo of a jax Mesh: one object per (names, sizes) in the process, so what
        its cache holds (the rules' candidate lists, each spec pair's collectives, what the cost
        model reads of each strategy: cost.model) is worked out once for every plan on that
        mesh shape. The caches depend on the names and sizes alone (not on the devices or the
        hardware profile); past _CACHE_ENTRIES entries in one of them, all are dropped (the
        next plan fills them again)."""
        key = (tuple(mesh.axis_names), tuple(int(mesh.shape[n]) for n in mesh.axis_names))
        hit = _MESHES.get(key)
        if hit is None:
            hit = _MESHES.setdefault(key, MeshInfo(*key))
        elif len(hit.cache) > _CACHE_ENTRIES or any(
                len(v) > _CACHE_ENTRIES for v in hit.cache.values() if isinstance(v, dict)):
            hit.cache.clear()
        return hit

    @property
    def size(self) -> int:
        return math.prod(self.sizes)

    def axis_size(self, name: str) -> int:
        return self.sizes[self.names.index(name)]

    def group_size(self, axes: Axes) -> int:
        """Devices in a group spanning `axes` (the product of their sizes)."""
        hit = self.cache.get(axes)
        if hit is None:
            axes = tuple(axes)
            hit = self.cache[axes] = math.prod(self.sizes[self.names.index(a)] for a in axes)
        return hit

    def derived(self, tag, source: list, extra, make):
        """derived() in this mesh's cache: the rules' candidate lists are shared objects
        (loop_strategies), so what is made from one is made once."""
        return derived(self.cache, tag, source, extra, make)

    def order(self, axes) -> Axes:
        """`axes` sorted into mesh order (the canonical order within one dimension)."""
        return tuple(sorted(axes, key=self.names.index))

    def describe(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes, strict=True))


def derived(cache: dict, tag, source: list, extra, make):
    """make(), remembered in `cache` for this `source` list (by identity) and `extra`
    (hashable). The entry keeps `source` alive, so no other list takes its id."""
    key = (tag, id(source), extra)
    hit = cache.get(key)
    if hit is None or hit[0] is not source:
        hit = cache[key] = (source, make())
    return hit[1]


def spec_classes(specs: Iterable[Spec]) -> tuple[tuple[Spec, ...], np.ndarray]:
    """(the distinct specs of `specs`, partial axes dropped, in order first met; the index
    into them of each spec): a list of thousands of candidates' specs priced or checked per
    distinct spec (the exact search's edge matrices, CostModel's shape checks)."""
    distinct: dict[Spec, int] = {}
    idx = [distinct.setdefault(s.resolved(), len(distinct)) for s in specs]
    return tuple(distinct), np.asarray(idx, dtype=np.int64)


# MeshInfo.of's meshes, by (names, sizes), and the most entries one of their caches (or a
# dict in one) keeps. A small GPT step planned in the three modes on 2 x 2 x 2 left 22,569
# spec pairs' collectives and 11,056 strategies' facts, about 36 MB in all (tracemalloc).
_MESHES: dict[tuple, MeshInfo] = {}
_CACHE_ENTRIES = 100_000

# Every Spec made, by (dims, partial): equal specs are one object. The searches hash and
# compare specs in their inner loops; interned, that is by identity, at C speed. The table
# only grows by distinct shardings (a few hundred for a model), like Python's string interning.
_INTERNED: dict[tuple, Spec] = {}


def _check_spec(dims, partial) -> None:
    """A TypeError unless dims is a tuple of tuples of axis names and partial a tuple of
    them, a ValueError when an axis is used twice (a str is no tuple of names: ("d0", ())
    read "d0" as the axes "d" and "0")."""
    def names(x) -> bool:
        return isinstance(x, tuple) and all(isinstance(a, str) and a for a in x)
    if not isinstance(dims, tuple) or not all(names(d) for d in dims) or not names(partial):
        raise TypeError(f"Spec(dims={dims!r}, partial={partial!r}): dims must be a tuple with a "
                        "tuple of mesh axis names per dimension (() for one not cut) and "
                        "partial a tuple of axis names, e.g. Spec((('d0',), ())).")
    used = [a for d in dims for a in d] + list(partial)
    if len(set(used)) != len(used):
        raise ValueError(f"Spec(dims={dims!r}, partial={partial!r}) uses a mesh axis twice; a "
                         "mesh axis cuts at most one dimension, once, and is not also partial.")


@dataclass(frozen=True)
class Spec:
    """Sharding of one array: `dims[i]` are the mesh axes that cut dimension i.

    Specs are interned (equal specs are the same object, see _INTERNED) and remember what
    `axes()`, `resolved()`, `shards()` and `fits()` gave (in their __dict__, outside the
    dataclass fields), since the searches ask for them in their inner loops.
    """

    dims: tuple[Axes, ...]
    partial: Axes = ()

    def __new__(cls, dims: tuple[Axes, ...], partial: Axes = ()):
        try:
            hit = _INTERNED.get((dims, partial))
        except TypeError:  # a list somewhere: unhashable, and no spec
            hit = None
        if hit is None:  # a spec not made before: checked once; setdefault: two threads
            _check_spec(dims, partial)  # making one spec get one object
            hit = _INTERNED.setdefault((dims, partial), object.__new__(cls))
        return hit

    __hash__ = object.__hash__
    __eq__ = object.__eq__

    def __reduce__(self):
        return (Spec, (self.dims, self.partial))  # without the remembered hash

    @staticmethod
    def replicated(rank: int) -> Spec:
        return Spec(((),) * rank)

    @staticmethod
    def from_pspec(pspec: P, rank: int) -> Spec:
        if len(pspec) > rank:
            raise ValueError(f"Spec.from_pspec: {pspec} has {len(pspec)} entries, more than "
                             f"rank {rank}; give at most one entry per dimension.")
        entries = tuple(pspec) + (None,) * (rank - len(pspec))
        return Spec(tuple(_as_axes(e) for e in entries))

    @property
    def rank(self) -> int:
        return len(self.dims)

    def axes(self) -> Axes:
        """Every mesh axis this spec uses, sharding or partial."""
        hit = self.__dict__.get("_axes")
        if hit is None:
            hit = self.__dict__["_axes"] = tuple(a for d in self.dims for a in d) + self.partial
        return hit

    def dim_of(self, axis: str) -> int | None:
        """The dimension `axis` cuts, or None."""
        where = self.__dict__.get("_dim_of")
        if where is None:
            where = self.__dict__["_dim_of"] = {a: i for i, d in enumerate(self.dims)
                                                for a in d}
        return where.get(axis)

    def shards(self, mesh: MeshInfo) -> int:
        """Number of distinct pieces the array is cut into."""
        hit = self.__dict__.get("_shards")
        if hit is None or hit[0] is not mesh:
            hit = self.__dict__["_shards"] = (mesh, math.prod(mesh.group_size(d)
                                                              for d in self.dims))
        return hit[1]

    def local_shape(self, shape: tuple[int, ...], mesh: MeshInfo) -> tuple[int, ...]:
        return tuple(n // mesh.group_size(d) for n, d in zip(shape, self.dims, strict=True))

    def fits(self, shape: tuple[int, ...], mesh: MeshInfo) -> bool:
        """True when every dimension divides evenly by the axes that cut it."""
        memo = self.__dict__.get("_fits")
        if memo is None or memo[0] is not mesh:
            memo = self.__dict__["_fits"] = (mesh, {})
        hit = memo[1].get(shape)
        if hit is None:
            hit = memo[1][shape] = all(n % mesh.group_size(d) == 0
                                       for n, d in zip(shape, self.dims, strict=True))
        return hit

    def placed_as(self, other: Spec) -> bool:
        """True when a value in this spec is already in `other`: nothing waits on a
        reduction and every dimension is cut alike, so resharding moves nothing."""
        return not self.partial and self.dims == other.dims

    def resolved(self) -> Spec:
        """This spec without its partial axes (itself when it has none)."""
        if not self.partial:
            return self
        hit = self.__dict__.get("_resolved")
        if hit is None:
            hit = self.__dict__["_resolved"] = Spec(self.dims)
        return hit

    def to_pspec(self) -> P:
        entries = [None if not d else d[0] if len(d) == 1 else d for d in self.dims]
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    def __str__(self) -> str:
        hit = self.__dict__.get("_text")  # plans print the same interned specs many times
        if hit is None:
            body = ", ".join("+".join(d) if d else "-" for d in self.dims)
            tail = f" partial({'+'.join(self.partial)})" if self.partial else ""
            hit = self.__dict__["_text"] = f"[{body}]{tail}"
        return hit

    def to_json(self) -> list:
        tail = [{"partial": list(self.partial)}] if self.partial else []
        return [list(d) for d in self.dims] + tail

    @staticmethod
    def from_json(data: list) -> Spec:
        """The Spec to_json wrote: a list of dims, each a list of mesh axis names, then
        {"partial": [axes]} when it has partial axes. A ValueError says what is malformed
        (an axis named twice, a dim that is not a list of names)."""
        if not isinstance(data, list):
            raise ValueError(f"a spec is a list of dims, not {data!r}")
        partial: Axes = ()
        if data and isinstance(data[-1], dict):
            partial = axes_from_json(data[-1].get("partial"), data)
            data = data[:-1]
        return Spec(tuple(axes_from_json(d, data) for d in data), partial)


def axes_from_json(entry, spec) -> Axes:
    """A spec's dim (or partial axes) read from JSON: a list of axis names (a ValueError
    naming `spec`, the JSON it is part of, when it is not)."""
    if not isinstance(entry, list) or not all(isinstance(a, str) for a in entry):
        raise ValueError(f"spec {spec!r}: each dim is a list of mesh axis names, not {entry!r}")
    return tuple(entry)


def _as_axes(entry) -> Axes:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


@dataclass(frozen=True)
class OpStrategy:
    """One way to run an op: input specs it needs and output specs it produces.

    `partial[j]` lists the axes over which output j was a partial result before the op's own
    reduction (an all-reduce when the axis is absent from `outs[j]`, a reduce-scatter when
    `outs[j]` shards a dimension on it).
    """

    ins: tuple[Spec, ...]
    outs: tuple[Spec, ...]
    partial: tuple[Axes, ...] = field(default=())
    name: str = ""
    # Result dims a partial result may be reduce-scattered onto (None: any); rules only.
    scatter_dims: tuple[int, ...] | None = field(default=None, compare=False)

    def scatter_bytes(self, result_bytes: Sequence[float], mesh: MeshInfo) -> float:
        """Per-device bytes the op holds beyond its results while it runs under this strategy:
        a result it reduce-scatters (partial over axes that also cut one of its dimensions)
        is first made whole over those axes, the reduction's group size less one times its
        own shard more (XLA's partial sum, then the reduce-scatter into the result). An
        all-reduced result is summed in a buffer of its own size: nothing more.

        Args:
          result_bytes: each result's bytes, unsharded (the op's `outs` order).
          mesh: the mesh the specs name.

        Example:
          >>> s = OpStrategy((Spec(((), ("d",))), Spec((("d",), ()))),
          ...                (Spec((("d",), ())),), (("d",),))
          >>> s.scatter_bytes([1024.0], MeshInfo(("d",), (4,)))  # 4 x 256 made, 256 kept
          768.0
        """
        extra = 0.0
        for j, axes in enumerate(self.partial):
            scattered = tuple(a for a in axes if self.outs[j].dim_of(a) is not None)
            if scattered:
                extra += (result_bytes[j] / self.outs[j].shards(mesh)
                          * (mesh.group_size(scattered) - 1))
        return extra

    def usage(self, axis: str) -> tuple:
        """How this strategy uses one mesh axis: (the dim it cuts in each operand, in each
        result, whether the op reduces over it); remembered on the strategy."""
        memo = self.__dict__.setdefault("_usage", {})
        hit = memo.get(axis)
        if hit is None:
            hit = memo[axis] = (tuple(sp.dim_of(axis) for sp in self.ins),
                                tuple(sp.dim_of(axis) for sp in self.outs),
                                any(axis in p for p in self.partial))
        return hit

    def label(self) -> str:
        if self.name:
            return self.name
        hit = self.__dict__.get("_label")  # ops of one signature share their strategies
        if hit is None:
            outs = " ".join(str(s) for s in self.outs)
            hit = self.__dict__["_label"] = f"{' '.join(str(s) for s in self.ins)} -> {outs}"
        return hit
