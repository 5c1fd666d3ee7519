"""ClosedJaxpr -> OpGraph: one flat list of ops with def-use edges between numbered values.

Before: a ClosedJaxpr, possibly with nested `jit`, `custom_jvp_call`, `custom_vjp_call` and `remat`
calls. After: an OpGraph in which those calls are inlined (their bodies' ops appear in place, their
consts become graph constants; a `custom_linear_solve`, which jnp.linalg.solve and inv make, becomes
its `solve` jaxpr, which is all it evaluates: the others are for AD), while `scan`, `while` and
`cond` stay single *region* ops whose bodies are OpGraphs of their own (planned once, not per
iteration). Ops whose results reach no output and that have no effects are dropped, as XLA would
drop them (the loss value of a step that returns only gradients, say), so the search never pays for
them.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax._src import core as jax_core
from jax.extend import core as jcore

# Call primitives whose body is inlined, and the param holding the body.
_INLINE_PARAM = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
                 "core_call": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
                 "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
                 "remat2": "jaxpr", "checkpoint": "jaxpr"}

_HEAVY = frozenset({"dot_general", "conv_general_dilated"})

# Region primitives and the params holding their bodies, in order.
REGION_PARAMS = {"scan": ("jaxpr",), "while": ("cond_jaxpr", "body_jaxpr"), "cond": ("branches",)}


def scan_counts(params: dict) -> tuple[int, int]:
    """(constants, carries) leading a scan body's inputs. jax 0.10 names them num_consts and
    num_carry; jax 0.11 keeps a flat tree of the inputs, ft_in, that unpacks into (consts,
    carries, xs) groups whose len() counts their leaves."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def _loop_consts(op: Op) -> int:
    """How many of a loop op's operands lead it as loop-invariant constants (a scan's consts,
    a while's cond and body consts); 0 for any other op."""
    if op.name == "scan":
        return scan_counts(op.params)[0]
    if op.name == "while":
        return op.params["cond_nconsts"] + op.params["body_nconsts"]
    return 0


def body_operands(op: Op, r: int) -> list | None:
    """The operands of region op `op` that body `r`'s inputs are, in order (None: not known
    for this op): a scan's body takes them all; a while loop's condition its constants and
    the carry, its body its constants and the carry; a cond's branches all but the index."""
    body, ins = op.regions[r], list(op.inputs)
    if op.name == "scan":
        found = ins
    elif op.name == "while":
        cn, bn = op.params["cond_nconsts"], op.params["body_nconsts"]
        found = ins[:cn] + ins[cn + bn:] if r == 0 else ins[cn:]
    elif op.name == "cond":
        found = ins[1:]
    else:
        return None
    return found if len(found) == len(body.inputs) else None


def as_dtype(dtype) -> Any:
    """numpy dtype of an array, or JAX's own dtype object for extended types (PRNG keys)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype
    return np.dtype(dtype)


def itemsize(dtype) -> int:
    """Bytes per element; a PRNG key counts its key data (a threefry key: 2 x uint32)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        phys = jax_core.physical_element_aval(dtype)
        return int(np.prod(phys.shape, dtype=np.int64)) * np.dtype(phys.dtype).itemsize
    return np.dtype(dtype).itemsize


@dataclass(frozen=True)
class ValueInfo:
    """Shape, dtype and a readable name (parameter path for inputs) of one value."""

    shape: tuple[int, ...]
    dtype: np.dtype
    name: str

    @functools.cached_property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True, eq=False)
class Lit:
    """A literal operand (a scalar constant written into the jaxpr)."""

    value: Any
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass
class Op:
    """One primitive application. Region ops carry their bodies in `regions`."""

    index: int
    primitive: Any
    params: dict
    inputs: tuple[int | Lit, ...]
    outputs: tuple[int, ...]
    ctx: Any
    source: str
    regions: tuple[OpGraph, ...] = ()
    effectful: bool = False

    @property
    def name(self) -> str:
        return self.primitive.name


@dataclass
class OpGraph:
    """A flat program: ops in execution order over values numbered 0..len(values)-1."""

    values: list[ValueInfo] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    inputs: tuple[int, ...] = ()
    outputs: tuple[int | Lit, ...] = ()
    consts: dict[int, Any] = field(default_factory=dict)
    # The program holds a custom_jvp or custom_vjp function or a custom_linear_solve (in a loop
    # body too): its ops are inlined as the primal computes, without the derivative rule
    # (lower.jit keeps it).
    custom_derivatives: bool = False
    # Some op (or a call it was inlined from) was made by JAX's transpose: the program
    # computes reverse-mode derivatives (jax.grad, jax.vjp), as a training step does.
    differentiates: bool = False
    # Input values whose buffers a call hands over (donate_argnums), set by whoever compiles
    # the program: the outputs JAX aliases to them are written in their buffers (aliases).
    donated: frozenset[int] = frozenset()
    _tail: frozenset[int] | None = field(default=None, repr=False, compare=False)
    _tail_ops: tuple[int, ...] | None = field(default=None, repr=False, compare=False)
    _sunk: frozenset[int] | None = field(default=None, repr=False, compare=False)
    _splats: dict[int, frozenset[int]] = field(default_factory=dict, repr=False,
                                               compare=False)

    def producers(self) -> dict[int, Op]:
        return {v: op for op in self.ops for v in op.outputs}

    def users(self) -> dict[int, list[tuple[Op, int]]]:
        uses: dict[int, list[tuple[Op, int]]] = {}
        for op in self.ops:
            for i, v in enumerate(op.inputs):
                if isinstance(v, int):
                    uses.setdefault(v, []).append((op, i))
        return uses

    def last_points(self) -> dict[int, int]:
        """The last program point (op index) at which each value an op reads or makes is
        alive: its last reader's; len(ops) for the program's outputs and for results nothing
        reads (never freed). The one liveness rule of plan.peak_memory and the exact search's
        live sets (exact.live_ranges), so the two count a plan's peak alike."""
        end = len(self.ops)
        last: dict[int, int] = {}
        for op in self.ops:
            for v in op.inputs:
                if isinstance(v, int):
                    last[v] = op.index
        for v in self.outputs:
            if isinstance(v, int):
                last[v] = end
        for op in self.ops:
            for v in op.outputs:
                last.setdefault(v, end)
        return last

    def aliases(self) -> dict[int, int]:
        """{output position: donated input value} as jax.jit pairs them (its
        mlir._set_up_aliases): each output in turn takes the first donated input not yet
        taken of its shape and dtype. The output is returned in that input's buffer where
        both have one layout (plan.in_place)."""
        free: dict[tuple, list[int]] = {}
        for v in self.inputs:
            if v in self.donated:
                info = self.values[v]
                free.setdefault((info.shape, as_dtype(info.dtype)), []).append(v)
        out: dict[int, int] = {}
        if not free:
            return out
        for pos, v in enumerate(self.outputs):  # (a PRNG key's dtype is no numpy dtype)
            key = (self.shape(v), as_dtype(self.dtype(v)))
            if free.get(key):
                out[pos] = free[key].pop(0)
        return out

    def in_place(self) -> dict[int, int]:
        """{value: donated input value} for each output an op makes that JAX aliases to a
        donated input (aliases) read by no op after the one making it: the op can write it
        in the input's buffer, so it holds no bytes of its own where both have one layout
        (plan.peak_memory; the exact search assumes they do)."""
        if not self.donated:
            return {}
        last, made = self.last_points(), {v: op.index for op in self.ops for v in op.outputs}
        out: dict[int, int] = {}
        for pos, v_in in self.aliases().items():
            v = self.outputs[pos]
            if isinstance(v, int) and v in made and last.get(v_in, -1) <= made[v]:
                out.setdefault(v, v_in)
        return out

    def splats(self, devices: int) -> frozenset[int]:
        """Values made by broadcasting a literal scalar (jnp.zeros, jnp.ones, jnp.full of a
        Python number), or such a value under the user's with_sharding_constraint (a layout
        of the same constant), of at least two elements per device of `devices`: XLA makes
        such a constant in whatever layout a reader needs, so resharding one moves nothing
        before an all-to-all (comm.of_splat). A piece of one element it makes a constant of
        its own and gathers as any array's (XLA:CPU, jax 0.10.2: f32[8] cut over 8 devices
        gathered 32 bytes, f32[16] nothing; f32[4] over 4, f32[2, 4] over 8 gathered too).
        A JAX step makes one for every gradient it accumulates by scatter-add (an
        embedding lookup's)."""
        hit = self._splats.get(devices)
        if hit is None:
            found: set[int] = set()
            for op in self.ops:
                if (op.name == "broadcast_in_dim" and isinstance(op.inputs[0], Lit) and
                        op.inputs[0].shape == ()) or \
                        (op.name == "sharding_constraint" and op.inputs[0] in found):
                    found.add(op.outputs[0])
            hit = self._splats[devices] = frozenset(
                v for v in found if math.prod(self.values[v].shape) >= 2 * devices)
        return hit

    def sunk(self) -> frozenset[int]:
        """Values XLA never allocates: a broadcast of a literal scalar read by loops alone, as
        a loop-invariant operand (a scan's consts, a while's cond and body consts). XLA sinks
        such a broadcast into the loop's body (its WhileLoopConstantSinking pass), where it
        fuses into the ops reading it. JAX puts them there when it differentiates a scan: a
        causal mask's fill value, or the zeros of its gradient, hoisted out of the layers
        as an array of the attention scores' shape. Measured on XLA:CPU (jax 0.10.2): a
        4 MB fill read by a scan held no bytes, where 4 MB broadcasts of a traced scalar
        and of an iota mask were allocated. plan.peak_memory and the exact search's live
        sets count them as holding nothing."""
        if self._sunk is None:
            invariant: dict[int, bool] = {}  # value -> read by loops, as a constant, alone
            for op in self.ops:
                consts = _loop_consts(op)
                for i, v in enumerate(op.inputs):
                    if isinstance(v, int):
                        invariant[v] = invariant.get(v, True) and i < consts
            outputs = {v for v in self.outputs if isinstance(v, int)}
            self._sunk = frozenset(
                op.outputs[0] for op in self.ops
                if op.name == "broadcast_in_dim" and isinstance(op.inputs[0], Lit) and
                op.inputs[0].shape == () and invariant.get(op.outputs[0], False) and
                op.outputs[0] not in outputs)
        return self._sunk

    def shape(self, v: int | Lit) -> tuple[int, ...]:
        return v.shape if isinstance(v, Lit) else self.values[v].shape

    def dtype(self, v: int | Lit) -> np.dtype:
        return v.dtype if isinstance(v, Lit) else self.values[v].dtype

    def tail_values(self) -> frozenset[int]:
        """Values from which no heavy op (dot_general, conv) can be reached, nor a region op
        (scan, while, cond) with one inside: what a training step computes after its last
        matmul (gradient reductions, the optimizer; under optax.apply_if_finite or MultiSteps
        a cond, a norm-driven while_loop). XLA's combiners merge the independent reductions
        there (all-reduce, reduce-scatter) into one, so they share one latency (see
        latency_share)."""
        if self._tail is None:
            reaches: set[int] = set()
            for op in reversed(self.ops):
                if op.name in _HEAVY or (op.regions and _heavy_inside(op)) or \
                        any(v in reaches for v in op.outputs):
                    reaches.update(v for v in op.inputs if isinstance(v, int))
            self._tail = frozenset(range(len(self.values))) - reaches
        return self._tail

    def tail_ops(self) -> tuple[int, ...]:
        """Indices of the ops (loops and conds aside) that make a value of the tail
        (tail_values): the step's last reductions are theirs."""
        if self._tail_ops is None:
            tail = self.tail_values()
            self._tail_ops = tuple(op.index for op in self.ops if not op.regions and
                                   any(v in tail for v in op.outputs))
        return self._tail_ops

    def latency_share(self, v: int) -> float:
        """The fraction of a latency a reduction of value v pays: 1, or in the tail 1/m where m
        is the number of outputs there (one reduction per returned gradient or parameter that
        XLA combines into one collective with one latency)."""
        tail = self.tail_values()
        if v not in tail:
            return 1.0
        return 1.0 / max(1, sum(1 for o in set(self.outputs) if isinstance(o, int) and o in tail))

    def op_latency_share(self, op: Op) -> float:
        """latency_share of an op's own reductions: the largest over its results."""
        return max((self.latency_share(v) for v in op.outputs), default=1.0)

    def walk(self, path: tuple[int, ...] = ()):
        """Yield (path, op) for every op, region bodies included; path indexes nested regions."""
        for op in self.ops:
            yield path + (op.index,), op
            for r, body in enumerate(op.regions):
                yield from body.walk(path + (op.index, r))


def _heavy_inside(op: Op) -> bool:
    """Whether a region op (scan, while, cond) has a heavy op in its bodies, at any depth."""
    return any(inner.name in _HEAVY or (inner.regions and _heavy_inside(inner))
               for body in op.regions for inner in body.ops)


def build_graph(closed, in_names: tuple[str, ...] | None = None) -> OpGraph:
    """Flatten a ClosedJaxpr into an OpGraph (see the module docstring)."""
    b = _Builder()
    jaxpr = closed.jaxpr
    names = in_names or tuple(f"in{i}" for i in range(len(jaxpr.invars)))
    env: dict[Any, int | Lit] = {}
    for var, c in zip(jaxpr.constvars, closed.consts, strict=True):
        env[var] = b.const(var.aval, c)
    inputs = tuple(b.new(var.aval, name) for var, name in zip(jaxpr.invars, names, strict=True))
    env.update(zip(jaxpr.invars, inputs, strict=True))
    b.emit(jaxpr, env)
    b.graph.inputs = inputs
    b.graph.outputs = tuple(_read(env, v) for v in jaxpr.outvars)
    _drop_dead(b.graph)
    b.graph.custom_derivatives = _custom_derivatives(jaxpr)
    return b.graph


# custom_linear_solve counts: its solve jaxpr reads the matrix's factors under stop_gradient,
# so only its own derivative rule (implicit, through matvec) reaches the matrix.
_CUSTOM_RULES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
                           "custom_linear_solve"})


def _custom_derivatives(jaxpr) -> bool:
    """Whether `jaxpr` or a jaxpr nested in it calls a custom_jvp or custom_vjp function (or
    a custom_linear_solve)."""
    return any(eqn.primitive.name in _CUSTOM_RULES for eqn in jaxpr.eqns) or any(
        _custom_derivatives(sub) for sub in jax_core.subjaxprs(jaxpr))


def _drop_dead(graph: OpGraph) -> None:
    """Remove ops that feed no output and have no effects; renumber the rest in order."""
    live = {v for v in graph.outputs if isinstance(v, int)}
    kept = []
    for op in reversed(graph.ops):
        if op.effectful or any(v in live for v in op.outputs):
            kept.append(op)
            live.update(v for v in op.inputs if isinstance(v, int))
    graph.ops = list(reversed(kept))
    for i, op in enumerate(graph.ops):
        op.index = i


def _read(env, atom) -> int | Lit:
    lit = literal(atom)
    return env[atom] if lit is None else lit


def literal(atom) -> Lit | None:
    """A jaxpr operand as a Lit where it is a literal (None where it is a variable)."""
    if not isinstance(atom, jcore.Literal):
        return None
    return Lit(atom.val, tuple(atom.aval.shape), as_dtype(atom.aval.dtype))


def while_trips(params: dict, operands: Sequence) -> int | None:
    """How many times a while loop runs, where XLA can tell (it then runs each collective in
    the body that many times): a carried integer counter that starts at a literal, goes up or
    down by a literal step each trip (`i + s`, `s + i`, `i - s`), and is compared with a
    literal bound (`<`, `<=`, `>`, `>=`, `!=`, the counter on either side). None where it
    cannot be told (a bound known only when the program runs), the loop would not end, or XLA
    does not count it (a form other than a counter going up to a `<` or `<=` bound, over
    _BRUTE_FORCE trips: XLA then runs and counts its body once).

    Args:
      params: the while eqn's params (its cond_jaxpr, body_jaxpr and their const counts).
      operands: its operands, each a Lit where it is a literal (`literal(atom)`).
    """
    cn, bn = params["cond_nconsts"], params["body_nconsts"]
    cond, body = params["cond_jaxpr"].jaxpr, params["body_jaxpr"].jaxpr
    test = _made_by(cond, cond.outvars[0])
    if test is None or test.primitive.name not in _FLIPPED or len(test.invars) != 2:
        return None
    carried = cond.invars[cn:]
    sides = [next((k for k, v in enumerate(carried) if v is x), None) for x in test.invars]
    if (sides[0] is None) == (sides[1] is None):  # one side the counter, the other a literal
        return None
    k, bound = (sides[0], test.invars[1]) if sides[0] is not None else (sides[1], test.invars[0])
    compare = test.primitive.name if sides[0] is not None else _FLIPPED[test.primitive.name]
    bound, start = literal(bound), operands[cn + bn + k]
    step = _step(body, body.invars[bn + k], body.outvars[k])
    if bound is None or bound.shape != () or not isinstance(start, Lit) or \
            not np.issubdtype(start.dtype, np.integer) or step is None:
        return None
    trips = _trips(compare, int(start.value), int(bound.value), step)
    if trips is not None and trips > _BRUTE_FORCE and not (compare in ("lt", "le") and step > 0):
        return None  # XLA matches only a counter going up to a bound; others it runs through
    return trips     # (up to _BRUTE_FORCE trips), and past that it counts one trip


_BRUTE_FORCE = 128  # the trips XLA's trip-count analysis simulates a loop for (jax 0.10.2)


# A comparison with its operands swapped: `n > i` is `i < n`.
_FLIPPED = {"lt": "gt", "gt": "lt", "le": "ge", "ge": "le", "ne": "ne"}
_COMPARE = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge}


def _step(body, counter, new) -> int | None:
    """What the body adds to `counter` each trip (`new` its next value), where a literal: a
    nonzero int; else None."""
    eqn = _made_by(body, new)
    if eqn is None or eqn.primitive.name not in ("add", "sub") or \
            not any(v is counter for v in eqn.invars):
        return None
    if eqn.primitive.name == "sub" and eqn.invars[0] is not counter:
        return None  # s - i: not a step
    by = literal(eqn.invars[1] if eqn.invars[0] is counter else eqn.invars[0])
    if by is None or by.shape != () or not np.issubdtype(np.asarray(by.value).dtype, np.integer):
        return None
    step = int(by.value) * (-1 if eqn.primitive.name == "sub" else 1)
    return step or None


def _trips(compare: str, start: int, bound: int, step: int) -> int | None:
    """How many times `i = start; while i <compare> bound: i += step` runs (None: forever)."""
    if compare == "ne":
        gap = bound - start
        return gap // step if gap % step == 0 and gap // step >= 0 else None
    if not _COMPARE[compare](start, bound):
        return 0
    if (step > 0) != (compare in ("lt", "le")):
        return None  # moving away from the bound
    reach = abs(bound - start) + (1 if compare in ("le", "ge") else 0)
    return -(-reach // abs(step))


def _made_by(jaxpr, var):
    """The eqn of `jaxpr` whose result `var` is (None: an input or a literal)."""
    return next((e for e in jaxpr.eqns if any(v is var for v in e.outvars)), None)


def _source(eqn) -> str:
    try:
        from jax._src import source_info_util
        return source_info_util.summarize(eqn.source_info)
    except (ImportError, AttributeError, TypeError):  # cosmetic: never fail planning over it
        return ""


class _Builder:
    def __init__(self):
        self.graph = OpGraph()

    def new(self, aval, name: str = "") -> int:
        vid = len(self.graph.values)
        shape = tuple(int(d) for d in getattr(aval, "shape", ()))
        dtype = as_dtype(getattr(aval, "dtype", np.float32))
        self.graph.values.append(ValueInfo(shape, dtype, name or f"%{vid}"))
        return vid

    def const(self, aval, value) -> int:
        vid = self.new(aval, f"const{len(self.graph.consts)}")
        self.graph.consts[vid] = value
        return vid

    def emit(self, jaxpr, env: dict) -> None:
        for eqn in jaxpr.eqns:
            if not self.graph.differentiates and _transposed(eqn):
                self.graph.differentiates = True
            ins = tuple(_read(env, v) for v in eqn.invars)
            name = eqn.primitive.name
            body = _inline_body(eqn)
            if body is not None:
                self._inline(body, ins, eqn.outvars, env)
                continue
            if name == "custom_linear_solve":
                self._inline(*_linear_solve(eqn, ins), eqn.outvars, env)
                continue
            outs = tuple(self.new(v.aval) for v in eqn.outvars)
            env.update((v, o) for v, o in zip(eqn.outvars, outs, strict=True))
            regions = tuple(build_graph(j) for j in _region_bodies(eqn)) if name in REGION_PARAMS \
                else ()
            if any(r.differentiates for r in regions):  # (gradients accumulated in a scan)
                self.graph.differentiates = True
            self.graph.ops.append(Op(len(self.graph.ops), eqn.primitive, dict(eqn.params), ins,
                                     outs, eqn.ctx, _source(eqn), regions, bool(eqn.effects)))

    def _inline(self, closed, ins, outvars, env) -> None:
        inner = closed.jaxpr
        sub: dict[Any, int | Lit] = {}
        for var, c in zip(inner.constvars, closed.consts, strict=True):
            sub[var] = self.const(var.aval, c)
        sub.update(zip(inner.invars, ins, strict=True))
        self.emit(inner, sub)
        for outer, inner_out in zip(outvars, inner.outvars, strict=True):
            env[outer] = _read(sub, inner_out)


def _transposed(eqn) -> bool:
    """Whether JAX's transpose (reverse-mode differentiation) made the eqn: its name stack
    holds that transform (printed as "transpose(jvp(...))")."""
    stack = getattr(getattr(eqn.source_info, "name_stack", None), "stack", ())
    return any(type(s).__name__ == "Transform" and getattr(s, "name", None) == "transpose"
               for s in stack)


def _inline_body(eqn):
    """The ClosedJaxpr to inline for call-like eqns, else None."""
    key = _INLINE_PARAM.get(eqn.primitive.name)
    body = eqn.params.get(key) if key else None
    return None if body is None else _closed(body)


def _closed(body):
    """A body as a ClosedJaxpr. jax 0.10 keeps loop bodies (and some call bodies) as plain
    Jaxprs, with no constants of their own; jax 0.11 merged the two classes (ClosedJaxpr is
    Jaxpr) and a body carries its constants, which wrapping it again would drop: an inner
    jax.jit closing over an array then read its constant as a missing operand."""
    return body if isinstance(body, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(body, ())


def _linear_solve(eqn, ins: tuple) -> tuple[Any, tuple]:
    """(body, its operands) of a custom_linear_solve: the `solve` jaxpr applied to its own
    constants and the right-hand sides, as jax evaluates the primitive."""
    lengths = eqn.params["const_lengths"]
    start = lengths.matvec + lengths.vecmat
    rhs = ins[sum(lengths):]
    return eqn.params["jaxprs"].solve, ins[start:start + lengths.solve] + rhs


def _region_bodies(eqn) -> list:
    bodies = []
    for key in REGION_PARAMS[eqn.primitive.name]:
        val = eqn.params[key]
        bodies.extend(val if isinstance(val, tuple | list) else [val])
    return [_closed(b) for b in bodies]
