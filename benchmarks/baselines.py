"""Hand-written sharding layouts in plain JAX (`jax.jit` with in/out shardings) for any mesh.

Before: a `BenchModel` (its leaves carry logical axis names) and a mesh with axes d0, d1, ...
After: `layout(name, model, mesh)` gives a PartitionSpec per argument leaf (or raises
`NotApplicable` with the reason), and `compile_baseline` the compiled program.

Each layout maps the model's logical axes onto mesh roles, and roles onto mesh axes:
- data_parallel: the batch over every axis; parameters and Adam moments replicated.
- fsdp (ZeRO-3): batch as above; every parameter and its moments split over every axis on its
  largest dimension that the mesh size divides (replicated when none does). This is
  `benchmarks/gpt_plans.py`'s fsdp for any mesh.
- megatron: tensor parallel over the last mesh axis (tp), data parallel over the others (dp).
  Megatron-LM's layout: "heads", "mlp" and "vocab" dimensions on tp (column-parallel qkv and
  w1, row-parallel wo and w2, vocab-parallel embedding), the rest replicated; the batch on dp.
  On a 1-D mesh tp is the whole mesh. Not applicable when tp does not divide the heads.
- maxtext_2d: MaxText's fsdp x tensor: tensor over the last axis, fsdp over the others;
  "embed" dimensions on fsdp, "heads"/"mlp"/"vocab" on tensor, the batch on fsdp. Needs a mesh
  of at least two axes.
- jax_default: only the batch inputs are sharded (batch dimension over every axis); parameters
  go in replicated and the output shardings are left to XLA's propagation (`out_shardings`
  None): what a JAX user gets by sharding the data alone.
- alpa_heuristic: Alpa's "shard the largest dimension" for every parameter over the whole
  mesh: each mesh axis in turn (outer first) cuts the dimension that is currently largest and
  that the axis divides, so a (1024, 4096) weight on (2, 2, 2) becomes P("d2", ("d0", "d1"));
  the batch inputs are cut the same way.
A dimension a role's axes do not divide stays whole (e.g. 10 classes on tp=2). Params and both
Adam moments share their leaf's spec (logical names come from the leaf path); Adam's count
and the loss are replicated; every layout but jax_default returns params and optimizer state
with their input shardings and donates them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from models import BenchModel

BASELINES = ("data_parallel", "fsdp", "megatron", "maxtext_2d", "jax_default", "alpa_heuristic")
Axes = tuple[str, ...]


class NotApplicable(Exception):
    """A layout that cannot be written for this model and mesh; the message says why."""


def _roles(name: str, model: BenchModel, mesh: Mesh) -> dict[str, Axes]:
    """{role: mesh axes}: "all", and "dp"/"tp"/"fsdp" where the layout has them."""
    axes = tuple(mesh.axis_names)
    roles = {"all": axes}
    if name == "megatron":
        roles |= {"dp": axes[:-1], "tp": axes[-1:]}
    elif name == "maxtext_2d":
        if len(axes) < 2:
            raise NotApplicable(f"needs a mesh of two or more axes (fsdp x tensor); got "
                                f"{dict(mesh.shape)}")
        roles |= {"fsdp": axes[:-1], "tp": axes[-1:]}
    tp = math.prod(mesh.shape[a] for a in roles.get("tp", ()))
    if model.heads is not None and model.heads % tp:
        raise NotApplicable(f"tensor parallel over {tp} devices does not divide the "
                            f"{model.heads} attention heads")
    return roles


# Where each layout puts the batch dimension of the batch inputs (the others: every axis).
_BATCH_ROLE = {"megatron": "dp", "maxtext_2d": "fsdp"}
# logical axis -> role for the parameters, per layout that maps logical names (MaxText's
# logical_axis_rules); a name a layout does not list stays whole.
_PARAM_RULES: dict[str, dict[str, str]] = {
    "data_parallel": {},
    "megatron": {"heads": "tp", "mlp": "tp", "vocab": "tp"},
    "maxtext_2d": {"embed": "fsdp", "heads": "tp", "mlp": "tp", "vocab": "tp"},
    "jax_default": {},
}


def _size(mesh: Mesh, axes: Axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _entry(axes: Axes):
    return axes[0] if len(axes) == 1 else axes


def _by_rules(rules: dict[str, str], roles: dict[str, Axes], mesh: Mesh,
              logical: tuple, shape: tuple[int, ...]) -> P:
    """Each dimension on the axes of its logical name's role, when they divide it."""
    out = []
    for name, n in zip(logical, shape, strict=True):
        axes = roles.get(rules.get(name, ""), ()) if name else ()
        out.append(_entry(axes) if axes and n % _size(mesh, axes) == 0 else None)
    return P(*out)


def _largest_divisible(mesh: Mesh, shape: tuple[int, ...]) -> P:
    """fsdp: the largest dimension the whole mesh divides (the first of equals) on every axis."""
    dims = [d for d, n in enumerate(shape) if n % mesh.size == 0]
    if not dims:
        return P()
    best = max(dims, key=lambda d: (shape[d], -d))
    return P(*(_entry(tuple(mesh.axis_names)) if d == best else None for d in range(len(shape))))


def _greedy_largest(mesh: Mesh, shape: tuple[int, ...]) -> P:
    """alpa_heuristic: each axis in turn cuts the currently largest dimension it divides."""
    local, cuts = list(shape), [[] for _ in shape]
    for axis in mesh.axis_names:
        k = mesh.shape[axis]
        dims = [d for d in range(len(shape)) if local[d] % k == 0]
        if dims:
            best = max(dims, key=lambda d: (local[d], -d))
            local[best] //= k
            cuts[best].append(axis)
    return P(*(_entry(tuple(c)) if c else None for c in cuts))


def layout(name: str, model: BenchModel, mesh: Mesh) -> list[P]:
    """The layout `name` as one PartitionSpec per argument leaf, in flattening order.

    Args:
      name: one of `BASELINES`.
      model: the benchmark model (its leaves' logical axis names).
      mesh: the mesh (any shape; axes named as `jaxpar.make_mesh` names them).

    Returns:
      A list of PartitionSpecs, one per leaf of `model.args`.

    Raises:
      NotApplicable: the layout does not fit this model on this mesh (the message says why).

    Example:
      >>> layout("megatron", build("gpt", "tiny"), jaxpar.make_mesh((4, 2)))[0]
      PartitionSpec()
    """
    if name not in BASELINES:
        raise ValueError(f"layout(name={name!r}): use one of {list(BASELINES)}.")
    roles = _roles(name, model, mesh)
    specs = [_leaf_spec(name, roles, mesh, model.logical(path, shape), shape)
             for path, shape in model.leaves()]
    _check_batch(model, mesh, roles[_BATCH_ROLE.get(name, "all")], specs)
    return specs


def _leaf_spec(name: str, roles: dict[str, Axes], mesh: Mesh, logical: tuple,
               shape: tuple[int, ...]) -> P:
    if logical[:1] == ("batch",):
        return _by_rules({"batch": _BATCH_ROLE.get(name, "all")}, roles, mesh, logical, shape)
    if name == "fsdp":
        return _largest_divisible(mesh, shape)
    if name == "alpa_heuristic":
        return _greedy_largest(mesh, shape)
    return _by_rules(_PARAM_RULES[name], roles, mesh, logical, shape)


def _check_batch(model: BenchModel, mesh: Mesh, data: Axes, specs: list[P]) -> None:
    """A layout splits the batch over its data axes (if any: Megatron on a 1-D mesh has none);
    one whose data axes do not divide the batch does not apply."""
    for (path, shape), spec in zip(model.leaves(), specs, strict=True):
        if data and model.logical(path, shape)[:1] == ("batch",) and (
                not spec or spec[0] is None):
            raise NotApplicable(f"the batch of {path} {shape} does not split over the data "
                                f"axes of {dict(mesh.shape)}")


def jitted(name: str, model: BenchModel, mesh: Mesh) -> Callable:
    """The step under `jax.jit` with the layout as in (and out) shardings; see `layout`.

    Example:
      >>> compiled = jitted("fsdp", model, mesh).lower(*model.args).compile()
    """
    specs = layout(name, model, mesh)
    tree = jax.tree_util.tree_structure(model.args)
    ins = jax.tree_util.tree_unflatten(tree, [NamedSharding(mesh, s) for s in specs])
    if name == "jax_default":  # parameters replicated in; XLA chooses the output shardings
        return jax.jit(model.step, in_shardings=ins)
    outs = (ins[0], ins[1], NamedSharding(mesh, P()))
    return jax.jit(model.step, in_shardings=ins, out_shardings=outs, donate_argnums=(0, 1))


def compile_baseline(name: str, model: BenchModel, mesh: Mesh) -> jax.stages.Compiled:
    """The compiled program of layout `name` for `model` on `mesh` (abstract arguments).

    Raises:
      NotApplicable: as `layout`.

    Example:
      >>> compiled = compile_baseline("megatron", build("gpt", "tiny"), jaxpar.make_mesh((4, 2)))
    """
    return jitted(name, model, mesh).lower(*model.args).compile()
