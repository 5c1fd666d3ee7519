"""User strategies -> `Spec`s: in_strategy, out_strategy, parameter_plan and `Layout`, validated
against the argument shapes and the mesh before anything is traced.

Before: what the user wrote (MindSpore forms) plus shapes and a mesh. After: one `Spec | None`
per flattened leaf (None: jaxpar decides), or a `{leaf index: Spec}` for a parameter_plan.

Forms accepted for one array:
  - `None`: jaxpar decides.
  - a tuple of split counts, one positive int per dimension: `(4, 2)` (MindSpore's form).
  - a `jax.sharding.PartitionSpec` naming mesh axes: `P(("d0", "d1"), "d2")`.
  - a called `Layout`: `Layout((2, 4), ("dp", "mp"))("dp", "None")`.
For a pytree argument, a pytree *prefix* of these: a dict/list/tuple with the argument's structure
down to some level; a `None`, PartitionSpec or Layout there applies to every leaf below it. A tuple
facing an array is a strategy; a tuple facing a tuple/list argument is a prefix.

How split counts become mesh axes (one rule for every mesh; axes of size 1 are ignored):
  1. A count of 1 uses no axis. Every other count must be the product of the sizes of a set of
     mesh axes, the sets of different dimensions disjoint.
  2. Axes of equal size are interchangeable; the earlier dimension takes the outer ones. So on
     `make_mesh(8)` (axes d0, d1, d2 of size 2) `(4, 2)` -> `(("d0", "d1"), ("d2",))` and
     `(2, 4)` -> `(("d0",), ("d1", "d2"))`; on a prime-factor mesh every product of factors is
     expressible and the mapping is always unique.
  3. Among sets of different sizes the mapping must be unique: on `make_mesh((4, 2), ("dp",
     "tp"))` `(2, 4)` -> `(("tp",), ("dp",))` (the only way), while on a (2, 2, 4) mesh a count of
     4 could take two size-2 axes or the size-4 one: that is ambiguous, and an error that shows
     the candidate PartitionSpecs. No way at all is an error that suggests a PartitionSpec.
  Within one dimension axes are listed in mesh order (the `Spec` convention). A PartitionSpec or
  Layout whose axes within one dimension are not in mesh order is an error, not silently reordered.

A `Layout`'s aliases map onto the mesh positionally when `device_matrix` equals the mesh shape;
otherwise each alias size is matched to mesh axes by the rule above (aliases in order).

Every error is a ValueError or TypeError naming where the value sits (`in_strategy[1]['w']`,
`out_strategy[0]`, `parameter_plan['blocks/0/w']`), the value, the array shape, the mesh and what
would work.
"""

from __future__ import annotations

import difflib
import fnmatch
import itertools
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.spec import Axes, MeshInfo, Spec

Shape = tuple[int, ...]
MeshLike = Mesh | AbstractMesh  # an AbstractMesh plans for meshes larger than the machine
_HINT_FORMS = ("give a tuple with one positive int per dimension (e.g. {ex}), a PartitionSpec, "
               "a Layout(...)(...) mapping, or None to let jaxpar decide")


# ---------------------------------------------------------------------------------------------
# Layout (MindSpore's device matrix + alias names)


@dataclass(frozen=True)
class Layout:
    """MindSpore's `Layout(device_matrix, alias_names)`; call it to map an array's dimensions.

    Args:
      device_matrix: sizes of the logical device axes, e.g. `(2, 4)`.
      alias_names: one name per device axis, e.g. `("dp", "mp")`; "None" is reserved.

    Returns (when called with one entry per array dimension: an alias, a tuple of aliases, or
    "None"/None for not cut) a Layout carrying that `tensor_map`, usable wherever a strategy is.

    Example:
      >>> layout = Layout((2, 4), ("dp", "mp"))
      >>> jaxpar.shard(fn, in_strategy=(layout("dp", "mp"), layout(("dp", "mp"), "None")))
    """

    device_matrix: tuple[int, ...]
    alias_names: tuple[str, ...]
    tensor_map: tuple[Axes, ...] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        where = f"Layout(device_matrix={self.device_matrix!r}, alias_names={self.alias_names!r})"
        dm, names = self.device_matrix, self.alias_names
        if not isinstance(dm, tuple | list) or not dm or not all(_is_int(d) and d >= 1 for d in dm):
            raise ValueError(f"{where}: device_matrix must be a non-empty tuple of positive ints, "
                             "e.g. (2, 4).")
        if not isinstance(names, tuple | list) or not all(isinstance(n, str) and n for n in names):
            raise TypeError(f"{where}: alias_names must be a tuple of strings, e.g. ('dp', 'mp').")
        if len(names) != len(dm) or len(set(names)) != len(names) or "None" in names:
            raise ValueError(f"{where}: give one distinct alias per device_matrix entry "
                             f"({len(dm)}), none of them 'None', e.g. "
                             f"{tuple(f'a{i}' for i in range(len(dm)))}.")
        object.__setattr__(self, "device_matrix", tuple(int(d) for d in dm))
        object.__setattr__(self, "alias_names", tuple(names))
        tm = self.tensor_map
        if tm is not None:  # given directly, not by calling the layout
            if not isinstance(tm, tuple | list):
                raise TypeError(f"{where}: tensor_map={tm!r} must be a tuple with one entry per "
                                "array dimension (an alias, a tuple of aliases, or 'None'); "
                                "or call the layout: layout('dp', 'None').")
            object.__setattr__(self, "tensor_map", tuple(self._entry(e) for e in tm))

    def __call__(self, *tensor_map: str | tuple[str, ...] | None) -> Layout:
        return Layout(self.device_matrix, self.alias_names,
                      tensor_map=tuple(self._entry(e) for e in tensor_map))

    def _entry(self, entry) -> Axes:
        if entry is None or entry == "None":
            return ()
        if isinstance(entry, str):
            return (entry,)
        if isinstance(entry, tuple) and all(isinstance(a, str) and a != "None" for a in entry):
            return entry
        raise TypeError(f"Layout({self.device_matrix}, {self.alias_names})({entry!r}): each "
                        f"entry is an alias from {self.alias_names}, "
                        "a tuple of aliases, or 'None' for a dimension that is not cut.")

    def __repr__(self) -> str:
        head = f"Layout({self.device_matrix}, {self.alias_names})"
        if self.tensor_map is None:
            return head
        body = ", ".join(repr(d[0]) if len(d) == 1 else repr(d) if d else "'None'"
                         for d in self.tensor_map)
        return f"{head}({body})"


# ---------------------------------------------------------------------------------------------
# Public entry points


def parse_in_strategy(in_strategy, args: tuple, mesh: MeshLike) -> list[Spec | None]:
    """One `Spec | None` per flattened leaf of `args` (jax.tree_util order).

    Args:
      in_strategy: None, or a tuple with one entry per positional argument (see module doc).
      args: the positional arguments: arrays or `jax.ShapeDtypeStruct`s, or pytrees of them.
      mesh: the device mesh.

    Returns:
      A list with one entry per leaf: a `Spec`, or None where jaxpar decides.

    Example:
      >>> parse_in_strategy(((4, 2), None, None), (x, w, b), make_mesh(8))
      [Spec(dims=(('d0', 'd1'), ('d2',))), None, None]
    """
    return _parse_entries(in_strategy, tuple(args), "in_strategy", "positional argument", mesh)


def parse_out_strategy(out_strategy, out_shapes_tree, mesh: MeshLike) -> list[Spec | None]:
    """One `Spec | None` per flattened leaf of the function's output.

    Args:
      out_strategy: None, or a tuple with one entry per output (the elements of a returned
        tuple, or of a returned list when it has one entry per element, as for lax.top_k's;
        else the single returned value), each in any in_strategy form.
      out_shapes_tree: the output pytree of `jax.ShapeDtypeStruct`s from tracing.
      mesh: the device mesh.

    Returns:
      A list with one entry per output leaf: a `Spec`, or None where jaxpar decides.

    Example:
      >>> parse_out_strategy(((8, 1),), jax.ShapeDtypeStruct((32, 10), "float32"), mesh)
      [Spec(dims=(('d0', 'd1', 'd2'), ()))]
    """
    kind = type(out_shapes_tree)
    elements = kind is tuple or (kind is list and isinstance(out_strategy, tuple | list)
                                 and len(out_strategy) == len(out_shapes_tree))
    outs = tuple(out_shapes_tree) if elements else (out_shapes_tree,)
    return _parse_entries(out_strategy, outs, "out_strategy", "output", mesh)


def parse_parameter_plan(parameter_plan, paths: Sequence[str], shapes: Sequence[tuple],
                         mesh: MeshLike) -> dict[int, Spec]:
    """Strategies for named leaves: `{path or suffix or glob: strategy}` -> `{leaf index: Spec}`.

    A key matches a leaf whose path equals it or ends with "/" + key (an exact match wins). A
    key matching several leaves must be a glob (`*`, `?`, `[...]`, fnmatch rules, also tried
    against "*/" + key). A value of None leaves the match to jaxpar.

    Args:
      parameter_plan: None or a dict mapping parameter paths to strategies (any in_strategy
        form for one array).
      paths: the leaf paths, e.g. "params/blocks/0/wqkv" (see `jaxpar.ir.trace.leaf_paths`).
      shapes: the leaf shapes, aligned with `paths`.
      mesh: the device mesh.

    Returns:
      `{leaf index: Spec}` for every leaf a key sets.

    Example:
      >>> parse_parameter_plan({"*/w": (1, 8)}, ["params/a/w", "params/b/w"],
      ...                      [(16, 32), (32, 64)], make_mesh(8))
      {0: Spec(dims=((), ('d0', 'd1', 'd2'))), 1: Spec(dims=((), ('d0', 'd1', 'd2')))}
    """
    if parameter_plan is None:
        return {}
    if not isinstance(parameter_plan, Mapping):
        raise TypeError(f"parameter_plan={parameter_plan!r} must be a dict mapping parameter "
                        "paths to strategies, e.g. {'params/w': (1, 8)}.")
    info, result, owner = MeshInfo.of(mesh), {}, {}
    for key, value in parameter_plan.items():
        hits = _matching_leaves(key, list(paths))
        for i in hits:
            where = f"parameter_plan[{key!r}]" + (f" (leaf {paths[i]!r})" if len(hits) > 1 else "")
            spec = _leaf_spec(value, tuple(shapes[i]), where, info)
            if spec is None:
                continue
            if i in result and result[i] != spec:
                raise ValueError(f"{where}={value!r} sets {paths[i]!r} to {spec}, but "
                                 f"parameter_plan[{owner[i]!r}] already set it to {result[i]}; "
                                 "give each leaf one strategy (narrow one of the keys).")
            result[i], owner[i] = spec, key
    return result


# ---------------------------------------------------------------------------------------------
# Entries and pytree prefixes


def _parse_entries(strategy, items: tuple, name: str, what: str,
                   mesh: MeshLike) -> list[Spec | None]:
    n_leaves, info = len(jax.tree_util.tree_leaves(items)), MeshInfo.of(mesh)
    if strategy is None:
        return [None] * n_leaves
    shapes, example = _shape_tree(items), _entries_example(items, info)
    if not isinstance(strategy, tuple):
        raise TypeError(f"{name}={strategy!r} must be None or a tuple with one entry per "
                        f"{what} ({len(items)}: shapes {shapes}) on mesh {info.describe()}, "
                        f"e.g. {example}.")
    if len(strategy) != len(items):
        entries = "1 entry" if len(strategy) == 1 else f"{len(strategy)} entries"
        raise ValueError(f"{name}={strategy!r} has {entries} but there "
                         f"{'is' if len(items) == 1 else 'are'} {len(items)} {what}(s) "
                         f"(shapes {shapes}) on mesh {info.describe()}; give one entry per "
                         f"{what}, None to let jaxpar decide, e.g. {example}"
                         f"{_nesting_hint(strategy, what)}.")
    out = [s for i, (e, x) in enumerate(zip(strategy, items, strict=True))
           for s in _expand(e, x, f"{name}[{i}]", info)]
    assert len(out) == n_leaves, f"{name}: {len(out)} specs for {n_leaves} leaves"
    return out


def _entries_example(items: tuple, mesh: MeshInfo) -> tuple:
    return tuple(_example(_shape(x), mesh) if _is_leaf(x) else None for x in items)


def _expand(entry, node, path: str, mesh: MeshInfo) -> list[Spec | None]:
    """Specs for every leaf of `node` from `entry`, a strategy or a prefix of `node`."""
    if _is_leaf(node):
        return [_leaf_spec(entry, _shape(node), path, mesh)]
    if entry is None:
        return [None] * len(jax.tree_util.tree_leaves(node))
    if isinstance(entry, P | Layout):  # one strategy for every leaf below
        return [_leaf_spec(entry, _shape(leaf), f"{path} (for leaf {jax.tree_util.keystr(kp)})",
                           mesh)
                for kp, leaf in jax.tree_util.tree_flatten_with_path(node)[0]]
    kids = _children(node)
    subs = _sub_entries(entry, node, kids, path)
    return [s for (key, kid), sub in zip(kids, subs, strict=True)
            for s in _expand(sub, kid, path + jax.tree_util.keystr((key,)), mesh)]


def _children(node) -> list[tuple[Any, Any]]:
    """(key, child) pairs one level down, None children included."""
    flat = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
    return [(kp[0], kid) for kp, kid in flat]


def _sub_entries(entry, node, kids: list, path: str) -> list:
    """`entry`'s children aligned with `kids`, or a ValueError when the structures differ."""
    if isinstance(node, Mapping) and isinstance(entry, Mapping):
        keys = [k.key for k, _ in kids]
        if set(entry) == set(keys):
            return [entry[k] for k in keys]
    elif isinstance(node, tuple | list) and isinstance(entry, tuple | list):
        if len(entry) == len(kids):
            return list(entry)
    elif type(entry) is type(node) and not isinstance(node, Mapping | tuple | list):
        sub = _children(entry)
        if len(sub) == len(kids):
            return [kid for _, kid in sub]
    raise ValueError(f"{path}={entry!r} does not match the structure of the value it describes, "
                     f"{_structure(node)} (leaf shapes {_shape_tree(node)}); give None, one "
                     "PartitionSpec or Layout for all of its leaves, or a prefix with the same "
                     f"structure, e.g. {_prefix_example(node)}.")


def _structure(node) -> str:
    if isinstance(node, Mapping):
        return f"a {type(node).__name__} with keys {sorted(node, key=str)}"
    if isinstance(node, tuple | list):
        return f"a {type(node).__name__} of {len(node)} items"
    return "None (no arrays)" if node is None else f"a {type(node).__name__}"


def _prefix_example(node) -> Any:
    """The all-None prefix of `node`, as an example of the expected structure."""
    if isinstance(node, Mapping):
        return {k: None for k in node}
    if isinstance(node, tuple | list) and type(node) in (tuple, list):
        return type(node)(None for _ in node)
    return None


def _nesting_hint(strategy: tuple, what: str) -> str:
    if strategy and all(_is_int(c) for c in strategy):
        return f" (for a single array {what} write ({strategy!r},))"
    return ""


def _is_leaf(node) -> bool:
    """An array-like leaf (an empty pytree node such as optax's EmptyState() is no leaf)."""
    if node is None:
        return False
    treedef = jax.tree_util.tree_structure(node)
    return treedef.num_leaves == 1 and jax.tree_util.treedef_is_leaf(treedef)


def _shape(x) -> Shape:
    return tuple(int(n) for n in (x.shape if hasattr(x, "shape") else np.shape(x)))


def _shape_tree(node) -> Any:
    return jax.tree_util.tree_map(_shape, node)


# ---------------------------------------------------------------------------------------------
# One array: counts, PartitionSpec, Layout


def _leaf_spec(entry, shape: Shape, path: str, mesh: MeshInfo) -> Spec | None:
    if entry is None:
        return None
    if isinstance(entry, P):
        return _pspec_spec(entry, shape, path, mesh)
    if isinstance(entry, Layout):
        return _layout_spec(entry, shape, path, mesh)
    if isinstance(entry, tuple | list):
        return _counts_spec(tuple(entry), shape, path, mesh)
    note = " (a tuple facing a tuple or list gives one entry per item)" if _is_int(entry) else ""
    raise _bad(path, entry, shape, mesh, f"{type(entry).__name__} {entry!r} is not a strategy"
               + note, _HINT_FORMS.format(ex=_example(shape, mesh)), TypeError)


def _bad(path: str, value, shape: Shape, mesh: MeshInfo, problem: str, hint: str,
         exc: type[Exception] = ValueError) -> Exception:
    return exc(f"{path}={value!r} for an array of shape {shape} on mesh {mesh.describe()}: "
               f"{problem}; {hint}.")


def _counts_spec(counts: tuple, shape: Shape, path: str, mesh: MeshInfo) -> Spec:
    def bad(problem: str, hint: str, exc: type[Exception] = ValueError) -> Exception:
        return _bad(path, counts, shape, mesh, problem, hint, exc)

    _check_count_types(counts, bad, _example(shape, mesh))
    if len(counts) != len(shape):
        raise bad(f"an array of rank {len(shape)} needs {len(shape)} counts, got {len(counts)}",
                  f"give one count per dimension, e.g. {_example(shape, mesh)}")
    for i, (c, n) in enumerate(zip(counts, shape, strict=True)):
        if n % c:
            raise bad(f"count {c} does not divide dim {i} of size {n}", _divisor_hint(i, n, mesh))
    if math.prod(counts) > mesh.size:
        raise bad(f"{' x '.join(map(str, counts))} = {math.prod(counts)} pieces, more than the "
                  f"mesh's {mesh.size} devices",
                  f"make the product of the counts at most {mesh.size}, e.g. "
                  f"{_example(shape, mesh)}")
    makeable = _makeable(mesh.sizes)
    for i, c in enumerate(counts):
        if c not in makeable:
            raise bad(f"count {c} for dim {i} is not a product of mesh axis sizes",
                      f"this mesh can make {_or_list(makeable)}; for another mapping write an "
                      f"explicit PartitionSpec naming the axes, e.g. {_pspec_example(shape, mesh)}")
    return _assign_counts(counts, mesh, bad)


def _check_count_types(counts: tuple, bad, example: tuple) -> None:
    for i, c in enumerate(counts):
        if isinstance(c, bool) or not isinstance(c, numbers.Integral):
            kind = "a bool" if isinstance(c, bool) else f"a {type(c).__name__}"
            named = all(x is None or isinstance(x, str) or
                        (isinstance(x, tuple) and all(isinstance(a, str) for a in x))
                        for x in counts) and any(isinstance(x, str) or (
                            isinstance(x, tuple) and x) for x in counts)  # an axis named
            hint = (f"to name mesh axes, write a PartitionSpec: P{tuple(counts)!r}" if named
                    else f"each count is a positive int, e.g. {example}")
            raise bad(f"count {c!r} at position {i} is {kind}, not an int", hint, TypeError)
        if c < 1:
            raise bad(f"count {c} at position {i} is not positive",
                      f"use 1 for a dimension that is not cut, e.g. {example}")


def _assign_counts(counts: tuple, mesh: MeshInfo, bad) -> Spec:
    found = _solve(tuple(int(c) for c in counts), mesh.sizes)
    if not found:
        raise bad("no set of distinct mesh axes gives every dimension its count (each axis can "
                  "cut one dimension only)",
                  f"write an explicit PartitionSpec over the axes {mesh.names}, or use a mesh "
                  "with prime-factor axes (jaxpar.make_mesh(n)), where every count fits")
    specs = [_to_spec(ways, mesh) for ways in found]
    if len(specs) > 1:
        alts = " or ".join(str(s.to_pspec()) for s in specs)
        raise bad("the counts map onto the mesh axes in more than one way",
                  f"write the PartitionSpec you mean: {alts}")
    return specs[0]


def _to_spec(ways: tuple[tuple[int, ...], ...], mesh: MeshInfo) -> Spec:
    return Spec(tuple(tuple(mesh.names[j] for j in way) for way in ways))


def _solve(counts: tuple[int, ...], sizes: tuple[int, ...],
           limit: int = 2) -> list[tuple[tuple[int, ...], ...]]:
    """Up to `limit` assignments of disjoint axis sets (indices) to `counts`, differing in the
    axis sizes some dimension gets (equal-sized axes are interchangeable: outer ones first)."""
    found: list[tuple[tuple[int, ...], ...]] = []

    def search(k: int, free: tuple[int, ...], acc: tuple) -> None:
        if len(found) >= limit:
            return
        if k == len(counts):
            found.append(acc)
            return
        for way in _ways(counts[k], free, sizes):
            search(k + 1, tuple(i for i in free if i not in way), acc + (way,))

    search(0, tuple(i for i, s in enumerate(sizes) if s > 1), ())
    return found


def _ways(count: int, free: tuple[int, ...], sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Sets of `free` axes whose sizes multiply to `count`: for each multiset of sizes, the
    lexicographically first set (the outermost axes of each size)."""
    if count == 1:
        return [()]
    ways: dict[tuple[int, ...], tuple[int, ...]] = {}
    for r in range(1, len(free) + 1):
        for combo in itertools.combinations(free, r):
            if math.prod(sizes[i] for i in combo) == count:
                ways.setdefault(tuple(sorted(sizes[i] for i in combo)), combo)
    return sorted(ways.values())


def _makeable(sizes: tuple[int, ...]) -> list[int]:
    """Every count a set of mesh axes can make."""
    return sorted({math.prod(c) for r in range(len(sizes) + 1)
                   for c in itertools.combinations(sizes, r)})


def _divisor_hint(dim: int, n: int, mesh: MeshInfo) -> str:
    divs = [d for d in range(1, min(n, mesh.size) + 1) if n % d == 0]
    ok = [d for d in divs if d in _makeable(mesh.sizes)]
    return (f"counts dividing dim {dim} of size {n} (up to the {mesh.size} devices) are "
            f"{', '.join(map(str, divs))}; of these this mesh can make {_or_list(ok)}")


def _example(shape: Shape, mesh: MeshInfo) -> tuple[int, ...]:
    """A valid count tuple for `shape`: the first dimension cut as far as the mesh allows."""
    if not shape:
        return ()
    first = max(c for c in _makeable(mesh.sizes) if shape[0] % c == 0)
    return (first,) + (1,) * (len(shape) - 1)


def _pspec_example(shape: Shape, mesh: MeshInfo) -> P:
    found = _solve(_example(shape, mesh), mesh.sizes, limit=1)
    return _to_spec(found[0], mesh).to_pspec() if found and shape else P()


def _or_list(values: Sequence) -> str:
    items = [str(v) for v in values]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _pspec_spec(pspec: P, shape: Shape, path: str, mesh: MeshInfo) -> Spec:
    def bad(problem: str, hint: str, exc: type[Exception] = ValueError) -> Exception:
        return _bad(path, pspec, shape, mesh, problem, hint, exc)

    entries = tuple(pspec)
    if len(entries) > len(shape):
        raise bad(f"{len(entries)} entries are more than the array's rank {len(shape)}",
                  f"give at most {len(shape)} (missing trailing entries are None), e.g. "
                  f"{_pspec_example(shape, mesh)}")
    dims = tuple(_pspec_axes(e, i, bad, mesh) for i, e in enumerate(entries))
    _check_axes(dims, mesh, bad, "PartitionSpec")
    spec = Spec.from_pspec(pspec, len(shape))
    _check_fits(spec, shape, mesh, bad)
    return spec


def _pspec_axes(entry, dim: int, bad, mesh: MeshInfo) -> Axes:
    if entry is P.UNCONSTRAINED:
        raise bad(f"dim {dim} is P.UNCONSTRAINED, which jaxpar does not take",
                  "use None for the whole array to let jaxpar decide, or name the axes")
    axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
    if not isinstance(axes, tuple) or not all(isinstance(a, str) for a in axes):
        raise bad(f"entry {dim} ({entry!r}) is not an axis name", "each entry is None, a mesh "
                  f"axis name or a tuple of them; the mesh axes are {mesh.names}", TypeError)
    for a in axes:
        if a not in mesh.names:
            close = difflib.get_close_matches(a, mesh.names, n=1, cutoff=0.5)
            guess = f"did you mean {close[0]!r}? " if close else ""
            raise bad(f"axis {a!r} is not in the mesh",
                      f"{guess}the mesh axes are {', '.join(mesh.names)}")
    return axes


def _check_axes(dims: tuple[Axes, ...], mesh: MeshInfo, bad, kind: str) -> None:
    """Each axis at most once, and in mesh order within a dimension."""
    seen: dict[str, int] = {}
    for i, axes in enumerate(dims):
        for a in axes:
            if a in seen and seen[a] == i:
                raise bad(f"mesh axis {a!r} is listed twice in dim {i}",
                          "list each mesh axis once")
            if a in seen:
                raise bad(f"mesh axis {a!r} cuts dims {seen[a]} and {i}",
                          "each mesh axis may cut one dimension only; drop it from one of them")
            seen[a] = i
        if tuple(axes) != mesh.order(axes):
            raise bad(f"dim {i} lists axes {tuple(axes)} out of mesh order",
                      f"jaxpar keeps the axes of one dimension in mesh order: write "
                      f"{mesh.order(axes)} in the {kind}, or build a mesh whose axes are in "
                      "the order you want")


def _check_fits(spec: Spec, shape: Shape, mesh: MeshInfo, bad) -> None:
    for i, (axes, n) in enumerate(zip(spec.dims, shape, strict=True)):
        k = mesh.group_size(axes)
        if n % k:
            raise bad(f"dim {i} of size {n} is cut into {k} pieces by {axes}, which does not "
                      "divide it", _divisor_hint(i, n, mesh))


def _layout_spec(layout: Layout, shape: Shape, path: str, mesh: MeshInfo) -> Spec:
    def bad(problem: str, hint: str, exc: type[Exception] = ValueError) -> Exception:
        return _bad(path, layout, shape, mesh, problem, hint, exc)

    if layout.tensor_map is None:
        raise bad("the Layout is not applied to the array's dimensions",
                  f"call it with one alias per dimension, e.g. layout({layout.alias_names[0]!r}"
                  + ", 'None'" * max(len(shape) - 1, 0) + ")", TypeError)
    if len(layout.tensor_map) != len(shape):
        raise bad(f"an array of rank {len(shape)} needs {len(shape)} tensor_map entries, got "
                  f"{len(layout.tensor_map)}", "give one alias (or 'None') per dimension")
    used = [a for d in layout.tensor_map for a in d]
    for alias in used:
        if alias not in layout.alias_names:
            raise bad(f"alias {alias!r} is not one of the layout's alias_names",
                      f"use one of {layout.alias_names} or 'None'")
        if used.count(alias) > 1:
            raise bad(f"alias {alias!r} is used {used.count(alias)} times",
                      "each alias may cut one dimension only; use 'None' for the others")
    alias_axes = _layout_axes(layout, mesh, bad)
    dims = tuple(tuple(ax for a in d for ax in alias_axes[a]) for d in layout.tensor_map)
    for i, (aliases, axes) in enumerate(zip(layout.tensor_map, dims, strict=True)):
        if axes != mesh.order(axes):  # the hint in the Layout's aliases, not in mesh axes
            order = tuple(sorted(aliases, key=lambda a: min(
                (mesh.names.index(ax) for ax in alias_axes[a]), default=-1)))
            hint = (f"write {order} for it" if tuple(ax for a in order for ax in alias_axes[a])
                    == mesh.order(axes) else "its aliases' mesh axes interleave; give them "
                    "device_matrix entries that map to consecutive mesh axes") + \
                ", or build a mesh whose axes are in the order you want"
            raise bad(f"dim {i} maps aliases {tuple(aliases)} to mesh axes {axes}, out of mesh "
                      "order (jaxpar keeps the axes of one dimension in mesh order)", hint)
    _check_axes(dims, mesh, bad, "Layout")
    spec = Spec(dims)
    _check_fits(spec, shape, mesh, bad)
    return spec


def _layout_axes(layout: Layout, mesh: MeshInfo, bad) -> dict[str, Axes]:
    """Mesh axes behind each alias: positional when the shapes agree, else by the count rule."""
    dm = layout.device_matrix
    if dm == mesh.sizes:
        return {a: (n,) for a, n in zip(layout.alias_names, mesh.names, strict=True)}
    hint = (f"use a device_matrix equal to the mesh shape {mesh.sizes}, or aliases whose sizes "
            "are products of distinct mesh axes")
    if math.prod(dm) != mesh.size:
        raise bad(f"device_matrix {dm} holds {math.prod(dm)} devices but the mesh has "
                  f"{mesh.size}", hint)
    found = _solve(dm, mesh.sizes)
    if len(found) != 1:
        how = "in more than one way" if found else "at all"
        raise bad(f"device_matrix {dm} does not map onto the mesh axes {how}", hint)
    return {a: tuple(mesh.names[j] for j in way)
            for a, way in zip(layout.alias_names, found[0], strict=True)}


# ---------------------------------------------------------------------------------------------
# parameter_plan keys


def _matching_leaves(key, paths: list[str]) -> list[int]:
    if not isinstance(key, str):
        raise TypeError(f"parameter_plan key {key!r} must be a parameter path (str), e.g. "
                        f"{paths[0] if paths else 'params/w'!r}.")
    if any(ch in key for ch in "*?["):
        hits = [i for i, p in enumerate(paths)
                if fnmatch.fnmatchcase(p, key) or fnmatch.fnmatchcase(p, "*/" + key)]
    else:
        hits = [i for i, p in enumerate(paths) if p == key]
        hits = hits or [i for i, p in enumerate(paths) if p.endswith("/" + key)]
    if not hits:
        raise ValueError(f"parameter_plan[{key!r}] matches no parameter; {_closest(key, paths)}")
    if len(hits) > 1 and not any(ch in key for ch in "*?["):
        many = ", ".join(repr(paths[i]) for i in hits[:4]) + (", ..." if len(hits) > 4 else "")
        raise ValueError(f"parameter_plan[{key!r}] matches {len(hits)} parameters ({many}); "
                         f"write a longer path, or a glob such as {'*/' + key!r} to set them all.")
    return hits


def _closest(key: str, paths: list[str]) -> str:
    """The known paths (or path suffixes, which are valid keys too) nearest to `key`."""
    suffixes = {"/".join(p.split("/")[i:]) for p in paths for i in range(p.count("/") + 1)}
    close = difflib.get_close_matches(key, sorted(suffixes), n=3, cutoff=0.5)
    if close:
        return f"closest known paths: {', '.join(map(repr, close))}."
    listed = ", ".join(map(repr, paths[:6])) + (", ..." if len(paths) > 6 else "")
    return f"known paths: {listed}." if paths else "this function has no array arguments."


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
