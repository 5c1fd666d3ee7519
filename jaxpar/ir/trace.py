"""fn, args -> ClosedJaxpr plus the pytree structure and a readable path for every input leaf.

Arguments may be arrays or `jax.ShapeDtypeStruct`s (planning without data). Paths join pytree
keys with '/', prefixed by the Python parameter name where the signature gives one:
`params/blocks/0/wqkv`.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey


@dataclass(frozen=True)
class Traced:
    """A traced function: its jaxpr, pytree structure and input leaf paths."""

    closed_jaxpr: Any
    in_tree: Any
    out_tree: Any
    in_paths: tuple[str, ...]
    out_paths: tuple[str, ...]

    @functools.cached_property
    def fingerprint(self) -> str:
        """Stable hash of the program (structure, shapes, dtypes, params)."""
        return hashlib.sha256(str(self.closed_jaxpr).encode()).hexdigest()[:16]


_NOT_JAX = frozenset("OUSVMm")  # numpy dtype kinds: object, str, bytes, void, datetimes


def jax_cannot_hold(x) -> bool:
    """Whether `x` is a numpy array or scalar (or a ShapeDtypeStruct) of a dtype no JAX array
    has (object, str, bytes, datetimes): named to the user before anything is traced.
    ml_dtypes' (bfloat16, float8, ...) are kind 'V' but numbers, and JAX's extended dtypes (PRNG
    keys) are its own."""
    return isinstance(x, np.ndarray | np.generic | jax.ShapeDtypeStruct) and \
        not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) and \
        np.dtype(x.dtype).kind in _NOT_JAX and not jnp.issubdtype(x.dtype, jnp.number)


def _key_str(key) -> str:
    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, FlattenedIndexKey):  # a pytree registered without keys
        return str(key.key)
    if isinstance(key, GetAttrKey):
        return key.name
    return str(key).strip(".[]'\"")


def path_str(path) -> str:
    return "/".join(_key_str(k) for k in path)


def arg_names(fn, n_args: int) -> list[str]:
    """Python parameter names of fn's first n_args positional parameters (else arg0, arg1 ...)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(n_args):
        p = params[i] if i < len(params) else None
        ok = p is not None and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        names.append(p.name if ok else f"arg{i}")
    return names


def leaf_paths(tree, prefix: str = "") -> list[str]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return ["/".join(s for s in (prefix, path_str(p)) if s) for p, _ in leaves]


def arg_paths(fn, args: tuple) -> list[str]:
    """The path of every leaf of fn's positional `args`, each under its parameter's name
    (`params/blocks/0/wqkv`), in jax.tree_util order."""
    names = arg_names(fn, len(args))
    return [p for name, a in zip(names, args, strict=True) for p in leaf_paths(a, name)]


def trace(fn, args: tuple, mesh=None) -> Traced:
    """Trace fn(*args) to a ClosedJaxpr; args may hold ShapeDtypeStructs. mesh: the plan's
    (a Mesh or AbstractMesh), set for the trace where fn names its axes in a bare
    PartitionSpec (`with_sharding_constraint(x, P("d0"))`) and no mesh is set around it."""
    in_paths = arg_paths(fn, args)
    # Traced from shapes alone: an array placed on a mesh with Explicit axes would write its
    # sharding into the program's types, which the plan's own mesh cannot replay.
    shapes = jax.tree_util.tree_map(shape_only, args)
    try:
        try:
            closed, out_shape = _jaxpr(fn, shapes)
        except RuntimeError as err:
            # Only then: setting a mesh for every trace would refuse a shard_map over another
            # mesh inside fn ("The context mesh ... should match the mesh passed").
            if mesh is None or _NO_MESH not in str(err) or \
                    not jax.sharding.get_abstract_mesh().empty:
                raise
            own = getattr(mesh, "abstract_mesh", mesh)
            with jax.sharding.use_abstract_mesh(own):  # (axes it lacks: _mesh_mismatch)
                closed, out_shape = _jaxpr(fn, shapes)
    except Exception as err:  # noqa: BLE001 - re-raised unless a capture explains it
        _refuse_explicit(fn, (), err)
        worded = _mesh_mismatch(fn, err, mesh)
        if worded is not None:
            raise worded from None
        raise
    _refuse_explicit(fn, closed.consts)
    in_tree = jax.tree_util.tree_structure(args)
    out_tree = jax.tree_util.tree_structure(out_shape)
    out_paths = leaf_paths(out_shape, "out")
    return Traced(closed, in_tree, out_tree, tuple(in_paths), tuple(out_paths))


# JAX's words (0.10.2) where fn passes with_sharding_constraint a bare PartitionSpec with no
# mesh set. (reshard and out_sharding= take Explicit axes only, which the plan's mesh lacks.)
_NO_MESH = "requires a non-empty mesh in context"


def _mesh_mismatch(fn, err: Exception, mesh) -> ValueError | None:
    """JAX's refusal of a mesh axis or axis type in fn, in jaxpar's words: fn is traced on
    the plan's mesh (Auto axes), whatever mesh a jax.set_mesh around the call holds, so a bare
    PartitionSpec (with_sharding_constraint, a shard_map without mesh=) naming that mesh's
    axes names none of the plan's, and jax.sharding.reshard (Explicit axes only) has none to
    take (one naming axes the plan lacks is told of those first: JAX's filtered traceback
    does not say which call refused them). None where `err` is none of those."""
    text = str(err)
    if not isinstance(err, ValueError) or mesh is None:
        return None
    name = getattr(fn, "__name__", "fn")
    axes = tuple(getattr(getattr(mesh, "abstract_mesh", mesh), "axis_names", ()))
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    explicit = (f"jax.sharding.reshard (or an out_sharding= argument) takes a mesh with "
                f"Explicit axes, and the plan's axes {axes} are Auto: use "
                "jax.lax.with_sharding_constraint there, which lays a value out on Auto axes, "
                "or leave the layout to jaxpar's plan.")
    if "of type Auto" in text or "not under a mesh context" in text:
        return ValueError(f"{name}: {explicit} (JAX: {first})")
    if "is not found in mesh" in text or "must refer to an axis marked as manual" in text:
        return ValueError(
            f"{name}: a bare PartitionSpec in the function (with_sharding_constraint, or a "
            f"shard_map given no mesh=) names mesh axes the plan's mesh lacks: jaxpar traces "
            f"and runs the function on its own mesh, whose axes are {axes}, whatever mesh a "
            f"jax.set_mesh around the call holds (JAX: {first}). Name the plan's axes in it, "
            "or give jaxpar.shard(mesh=...) the mesh the function names (jaxpar.make_mesh("
            "shape, names); under jax.set_mesh(m): mesh=m).")
    return None


def _jaxpr(fn, shapes: tuple):
    """jax.make_jaxpr(fn)(*shapes) and its output shapes; a TypeError in jaxpar's words where
    fn uses an argument's value in Python."""
    try:
        return jax.make_jaxpr(fn, return_shape=True)(*shapes)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
            jax.errors.TracerBoolConversionError) as err:
        raise TypeError(_needs_a_value(fn, err)) from None
    except TypeError as err:
        if "static_argnums" not in str(err):  # JAX's advice for a traced value used as one
            raise
        raise TypeError(_needs_a_value(fn, err)) from None
    except ValueError as err:  # a jax.jit(..., static_argnums=...) given a traced argument
        if "Non-hashable static arguments" not in str(err):
            raise
        raise TypeError(_needs_a_value(fn, err)) from None


def _refuse_explicit(fn, consts, err: Exception | None = None) -> None:
    """A ValueError where fn captures an array laid out on a mesh with Explicit axes (among
    `consts`, the traced program's constants; or, when tracing failed with `err`, among what fn
    reads from outside its arguments): its sharding is part of its type, which neither the
    trace under the plan's mesh nor the program replayed there can take. Arguments so placed
    are moved (only the value is traced); a captured array keeps its type."""
    found = [c for c in consts if _on_explicit_axes(c)]
    if not found and err is None:
        return  # the common case: nothing more to look at
    try:
        named = [(name, x) for name, x in _captures(fn) if _on_explicit_axes(x)]
    except Exception:  # noqa: BLE001 - naming them is a courtesy; JAX's error stands
        named = []
    if err is not None:
        found = [x for _, x in named]
    if not found:
        return
    names = {id(x): name for name, x in named}
    shown = "; ".join(f"{names.get(id(x), 'an array')} ({x.dtype}{list(x.shape)} on a mesh "
                      f"with Explicit axes: {_axes(x)})" for x in found[:3])
    said = f" JAX said: {str(err).splitlines()[0]}" if err is not None and str(err) else ""
    raise ValueError(
        f"jaxpar could not trace {getattr(fn, '__name__', 'fn')}: it captures {shown}"
        f"{' ...' if len(found) > 3 else ''}. There an array's sharding is part of its type, "
        "which the plan's mesh cannot take. Pass it as an argument (jaxpar moves an argument "
        "placed so onto the plan's mesh), or jax.device_put it onto one device or an Auto "
        f"mesh (jaxpar.make_mesh) before sharding the function.{said}") from err


def _on_explicit_axes(x) -> bool:
    mesh = getattr(getattr(x, "sharding", None), "mesh", None)
    return isinstance(x, jax.Array) and any(
        t != AxisType.Auto for t in getattr(mesh, "axis_types", ()))


def _axes(x) -> str:
    mesh = x.sharding.mesh
    return ", ".join(f"{n}={s}" + ("" if t == AxisType.Explicit else f" {t.name}") for n, s, t
                     in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types, strict=True))


def _captures(fn, depth: int = 0) -> list[tuple[str, Any]]:
    """(name, leaf) for every pytree leaf fn reads from outside its arguments, as far as Python
    shows it: a function's closure cells and the globals it names, a functools.partial's bound
    arguments, a bound method's instance (nested partials and methods, a few levels)."""
    if depth > 4:
        return []
    if isinstance(fn, functools.partial):
        bound = [(f"the partial's argument {i}", a) for i, a in enumerate(fn.args)]
        bound += [(f"the partial's argument {k}=", a) for k, a in fn.keywords.items()]
        return _leaves(bound) + _captures(fn.func, depth + 1)
    if inspect.ismethod(fn):
        return _leaves([("self", fn.__self__)]) + _captures(fn.__func__, depth + 1)
    fn = inspect.unwrap(fn) if callable(fn) else fn
    if not inspect.isfunction(fn):
        return []
    try:
        found = inspect.getclosurevars(fn)
    except (TypeError, ValueError):
        return []
    return _leaves([*found.nonlocals.items(), *found.globals.items()])


def _leaves(named: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    out = []
    for name, value in named:
        leaves = jax.tree_util.tree_leaves_with_path(value)
        out += [(f"{name}/{path_str(p)}" if p else name, x) for p, x in leaves
                if isinstance(x, jax.Array)]
    return out


def shape_only(x):
    """A jax.Array or ShapeDtypeStruct as a ShapeDtypeStruct with no sharding (weak type
    kept); anything else as it is."""
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False))
    return x


def _needs_a_value(fn, err: Exception) -> str:
    """jaxpar's advice where JAX's names static_argnums (jaxpar.shard has no such option)."""
    said = str(err).split("\n")
    said = "\n".join(line for line in said if "static_argnums" not in line).strip()
    name = getattr(fn, "__name__", "fn")
    found = re.search(r"value of the argument (\w+)", str(err))
    arg = found.group(1) if found else "<argument>"
    return (f"jaxpar could not trace {name}: it uses an argument's value in Python (as a shape, "
            "a loop bound or in an `if`), and jaxpar traces every argument, as jax.jit does "
            "without static_argnums. Bind such arguments before sharding: "
            f"jaxpar.shard(functools.partial({name}, {arg}=...), ...), and call it without them. "
            f"JAX said: {said}")
