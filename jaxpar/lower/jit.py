"""Plan -> jitted program: the graph is replayed op by op with sharding constraints.

Every operand whose spec differs from what the chosen strategy needs is constrained to the
needed spec first, and every result is constrained to its planned spec, so the SPMD partitioner
has no freedom left to pick other layouts. Ops the partitioner would gather whole although their
cut is local (registry.LOCAL: top_k, fft, igamma) are bound per shard in a shard_map. Region ops
are rebuilt with `lax.scan`, `lax.while_loop` and `lax.switch` around replays of their bodies,
each body's arguments and a loop's new carry constrained to the specs the body's plan gives them
(the loop state is laid out as planned: otherwise the partitioner picks its own layout and moves
it around the loop).

With `fp32` (MindSpore's fp32 communication), an op whose chosen strategy leaves a bf16/f16
result partial (a matmul or sum cut along its reduction) computes that result in float32, is
constrained (reduced) in float32, and only then cast back: the collective moves f32 bytes and
the sum of the partial results is not rounded to 16 bits on the way.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxpar.ir.graph import Lit, Op, OpGraph, scan_counts
from jaxpar.rules.registry import is_local
from jaxpar.search.propagation import GraphPlan
from jaxpar.spec import Spec


def _constrain(x, spec: Spec, mesh: Mesh):
    if spec.rank == 0:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec.to_pspec()))


_LOW = (jnp.bfloat16, jnp.float16)
_WIDE_REDUCTIONS = {"dot_general": "preferred_element_type", "reduce_sum": None}
_CHOOSERS = frozenset({"reduce_max", "reduce_min"})


def replay(graph: OpGraph, plan: GraphPlan, mesh: Mesh, args: list, fp32: bool = False,
           consts: dict[int, object] | None = None) -> list:
    """Evaluate graph on args (traced or concrete) following plan; `consts`: values for some
    of its constants (the lifted ones, see tracer_consts)."""
    env: dict[int, object] = dict(zip(graph.inputs, args, strict=True))
    for v, value in (graph.consts | (consts or {})).items():
        env[v] = _constrain(value, plan.specs[v], mesh) if v in plan.specs else value

    def read(v: int | Lit, need: Spec | None = None):
        if isinstance(v, Lit):
            return v.value
        x = env[v]
        if need is not None and need.resolved() != plan.specs[v].resolved():
            x = _constrain(x, need, mesh)
        return x

    for op in graph.ops:
        choice = plan.choices[op.index]
        ins = [read(v, need) for v, need in zip(op.inputs, choice.strategy.ins, strict=True)]
        if op.regions:
            outs = _region(op, choice.regions, ins, mesh, fp32, choice.strategy.outs)
        elif is_local(op.primitive) and any(s.axes() for s in choice.strategy.outs):
            outs = bind_local(op, ins, choice.strategy, mesh)
        elif _chooses_across(op, choice.strategy, graph):
            outs = [_bind_ordered(op, ins[0], choice.strategy.outs[0], mesh)]
        elif fp32 and _reduces_low(op, choice.strategy, graph):
            outs = [_bind_fp32(op, ins, graph.dtype(op.outputs[0]), choice.strategy.outs[0],
                               mesh)]
        else:
            outs = _bind(op, ins)
        for v, out, spec in zip(op.outputs, outs, choice.strategy.outs, strict=True):
            env[v] = _constrain(out, spec, mesh)
    return [read(v) for v in graph.outputs]


def _reduces_low(op: Op, strategy, graph: OpGraph) -> bool:
    """The op leaves a 16-bit float result partial (its reduction is a collective)."""
    return (op.name in _WIDE_REDUCTIONS and any(strategy.partial)
            and graph.dtype(op.outputs[0]) in _LOW)


def _bind_fp32(op: Op, ins: list, dtype, spec: Spec, mesh: Mesh):
    """The op computed and reduced in float32, cast back to `dtype`."""
    params = op.primitive.get_bind_params(op.params)
    key = _WIDE_REDUCTIONS[op.name]
    if key is None:  # a sum: widen the operand
        ins = [x.astype(jnp.float32) for x in ins]
    else:  # a matmul: accumulate and return float32
        params = {**params, key: jnp.float32}
    with op.ctx.manager:
        wide = op.primitive.bind(*ins, **params)
    return _constrain(wide, spec, mesh).astype(dtype)


def _chooses_across(op: Op, strategy, graph: OpGraph) -> bool:
    """A float max or min whose reduction is a collective: XLA's all-reduce max (min) drops
    NaNs on CPU, where jax.jit's reduction returns NaN (a NaN on one device, a number from
    another: the number)."""
    return (op.name in _CHOOSERS and any(strategy.partial)
            and jnp.issubdtype(graph.dtype(op.outputs[0]), jnp.floating))


def _bind_ordered(op: Op, x, spec: Spec, mesh: Mesh):
    """reduce_max / reduce_min of floats over dims cut across devices, NaN kept as jax.jit
    keeps it: reduced as unsigned integer keys in the floats' order (a float's bits, the
    sign bit set on positives, every bit flipped on negatives), NaN made the greatest key
    for a max (the least for a min), so the all-reduce is one of integers of the floats'
    width and moves the same bytes. Differentiated from outside, its derivative is
    reduce_max's (the tangents where the operand equals the result, averaged)."""
    params = op.primitive.get_bind_params(op.params)
    axes = tuple(params["axes"])
    largest = op.name == "reduce_max"

    def keyed(x):
        uint = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
        top = jnp.array(1 << (8 * x.dtype.itemsize - 1), uint)
        x = jnp.where(jnp.isnan(x), jnp.array(jnp.nan if largest else -jnp.nan, x.dtype), x)
        bits = jax.lax.bitcast_convert_type(x, uint)
        keys = jnp.where(bits & top, ~bits, bits | top)
        with op.ctx.manager:
            keys = _constrain(op.primitive.bind(keys, **params), spec, mesh)
        return jax.lax.bitcast_convert_type(jnp.where(keys & top, keys & ~top, ~keys), x.dtype)

    @jax.custom_jvp
    def chosen(x):
        return keyed(x)

    @chosen.defjvp
    def _tangent(primals, tangents):
        (x,), (t,) = primals, tangents
        out = chosen(x)
        at = x == jnp.expand_dims(out, axes)
        picked = jnp.sum(jnp.where(at, t, jnp.zeros_like(t)), axis=axes)
        return out, picked / jnp.sum(at, axis=axes).astype(t.dtype)

    return chosen(x)


def _bind(op: Op, ins: list) -> list:
    with op.ctx.manager:
        out = op.primitive.bind(*ins, **op.primitive.get_bind_params(op.params))
    return list(out) if op.primitive.multiple_results else [out]


def bind_local(op: Op, ins: list, strategy, mesh: Mesh) -> list:
    """The op bound per shard, each device on its own block of the strategy's operand specs:
    for ops the partitioner would run whole (registry.LOCAL). Their rules cut only dims the op
    maps, so a block's results are the results' block, with no communication."""
    def local(*xs):
        # An operand whole on every device (a literal, a replicated one) does not vary over
        # the axes the others are cut on; the op's binary rules (igamma's) refuse the mix.
        have = [_varying(x) for x in xs]
        varying = frozenset().union(*have)
        xs = [jax.lax.pcast(x, tuple(sorted(varying - h)), to="varying") if varying - h else x
              for x, h in zip(xs, have, strict=True)]
        # Not under the op's eqn context: its abstract mesh (the traced program's, no axes)
        # would hide the shard_map's manual axes from the op's transpose under jax.grad.
        out = op.primitive.bind(*xs, **op.primitive.get_bind_params(op.params))
        return tuple(out) if op.primitive.multiple_results else (out,)

    run = jax.shard_map(local, mesh=mesh, in_specs=tuple(s.to_pspec() for s in strategy.ins),
                        out_specs=tuple(s.to_pspec() for s in strategy.outs))
    return list(run(*ins))


def _varying(x) -> frozenset:
    """The manual axes a value inside a shard_map varies over (its type says)."""
    return getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", frozenset())


def _region(op: Op, plans: tuple[GraphPlan, ...], ins: list, mesh: Mesh, fp32: bool,
            outs: tuple[Spec, ...]) -> list:
    """A region op's results, its bodies replayed with their plans; `outs`: the specs its
    strategy gives its results."""
    if op.name == "cond":
        return _cond(op, plans, ins, mesh, fp32, outs)
    return _REGIONS[op.name](op, plans, ins, mesh, fp32)


def _as_planned(values, xs: list, plan: GraphPlan, mesh: Mesh) -> list:
    """xs, the arrays of a body's `values`, constrained to the specs the body's plan gives
    them. For a body's arguments and a loop's new carry (the carry's input values): a loop's
    state (carry, the slices of a scan's xs) is otherwise laid out as the partitioner likes,
    which may gather it where the plan does not (a backward scan reading its residuals) and
    move a carry the plan moves each turn after the loop once more."""
    return [_constrain(x, plan.specs[v], mesh) if v in plan.specs else x
            for v, x in zip(values, xs, strict=True)]


def _scan(op: Op, plans, ins, mesh, fp32) -> list:
    nc, ncar = scan_counts(op.params)
    consts, init, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
    body, plan = op.regions[0], plans[0]

    def step(carry, x):
        outs = replay(body, plan, mesh,
                      _as_planned(body.inputs, [*consts, *carry, *x], plan, mesh), fp32)
        return _as_planned(body.inputs[nc:nc + ncar], outs[:ncar], plan, mesh), outs[ncar:]

    carry, ys = jax.lax.scan(step, init, xs, length=op.params["length"],
                             reverse=op.params["reverse"], unroll=op.params["unroll"])
    return [*carry, *ys]


def _while(op: Op, plans, ins, mesh, fp32) -> list:
    """The loop, each body and condition replayed as planned. Under jax.vmap a condition
    that reads the mapped value tests each lane (a predicate of shape (B,), every carry
    mapped on its leading dims): the loop runs while any lane's test holds, and a lane whose
    test failed keeps its carry (what XLA's lowering of such a while does; lax.while_loop
    takes a scalar test only)."""
    cn, bn = op.params["cond_nconsts"], op.params["body_nconsts"]
    cconsts, bconsts, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
    (cond, body), (cond_plan, body_plan) = op.regions, plans
    lanes = len(cond.shape(cond.outputs[0]))  # 0: one test for the whole loop

    def test(c):
        return replay(cond, cond_plan, mesh,
                      _as_planned(cond.inputs, [*cconsts, *c], cond_plan, mesh), fp32)[0]

    def turn(c):
        outs = replay(body, body_plan, mesh,
                      _as_planned(body.inputs, [*bconsts, *c], body_plan, mesh), fp32)
        outs = _as_planned(body.inputs[bn:], outs, body_plan, mesh)
        if lanes:  # the test's lanes laid out as each carry's leading dims, which it keeps
            going = test(c)
            outs = [jnp.where(jax.lax.broadcast_in_dim(
                _constrain(going, Spec(body_plan.specs[v].dims[:lanes]), mesh), jnp.shape(new),
                range(lanes)), new, old) for v, new, old in zip(body.inputs[bn:], outs, c,
                                                                strict=True)]
        return outs

    out = jax.lax.while_loop(lambda c: jnp.any(test(c)) if lanes else test(c), turn, list(init))
    return list(out)


def _cond(op: Op, plans, ins, mesh, fp32, outs: tuple[Spec, ...]) -> list:
    """Each branch's results constrained to the cond's result specs: the branches are planned
    into them (regions._cond), and XLA refuses branches whose results it lays out apart."""
    def branch(b: OpGraph, p: GraphPlan):
        def run(*a):
            got = replay(b, p, mesh, _as_planned(b.inputs, list(a), p, mesh), fp32)
            return [_constrain(x, s, mesh) for x, s in zip(got, outs, strict=True)]
        return run
    return list(jax.lax.switch(ins[0], [branch(b, p) for b, p in zip(op.regions, plans,
                                                                     strict=True)],
                               *ins[1:]))


_REGIONS = {"scan": _scan, "while": _while}


def placeable(graph: OpGraph, out_specs: list[Spec]) -> list[Spec]:
    """out_specs, a result with no elements replicated: XLA returns such a result whole on
    every device whatever its out_sharding says, and a cut one then labels (0, 16) blocks as
    (0, 2) shards, which jax cannot read back. It holds no bytes, so no layout costs more."""
    def empty(v) -> bool:
        shape = v.shape if isinstance(v, Lit) else graph.values[v].shape
        return 0 in shape
    return [Spec.replicated(s.rank) if s.axes() and empty(v) else s
            for v, s in zip(graph.outputs, out_specs, strict=True)]


def tracer_consts(graph: OpGraph) -> tuple[int, ...]:
    """The graph's constants that are tracers: values fn closes over that a transformation
    around the call carries (`jax.grad(lambda w: shard(lambda x: f(x, w))(x))`). The call is
    then inside that transformation, whatever its arguments are: the program takes them as
    arguments after its inputs (build_callable's `lifted`), so that the transformation sees
    them pass through it, the program's custom derivative rule included."""
    return tuple(v for v, x in graph.consts.items() if isinstance(x, jax.core.Tracer))


def build_callable(graph: OpGraph, plan: GraphPlan, mesh: Mesh, in_specs: list[Spec],
                   out_specs: list[Spec], donate: tuple[int, ...] = (),
                   fp32_communication: bool = False, traced: bool = False,
                   source: Callable | None = None, lifted: tuple[int, ...] = ()) -> Callable:
    """A jitted function of the flat inputs returning the flat outputs, placed per the specs
    (fp32_communication: see the module docstring).

    traced: for inputs that are tracers of an enclosing transformation (jax.jit, grad,
    vmap): the inputs are constrained to their specs inside the program rather than by
    in_shardings, which jit checks against the concrete values a transformation carries (a
    committed array laid out otherwise would be refused), and nothing is donated.

    lifted: with traced, constants of the graph (tracer_consts) the program takes as
    arguments after the inputs, in this order, in place of the values the graph holds.

    source: the function of the flat inputs, then the lifted constants, that the graph was
    traced from. Where the graph holds custom derivative rules (graph.custom_derivatives: its
    ops are inlined as the primal computes), the traced program's derivative is the source's
    (a custom_jvp whose rule is jax.jvp of it, its inputs and outputs laid out as planned;
    reverse mode transposes it): differentiated from outside, the replay would give the
    primal's derivative instead (jax.nn.relu's at 0, a gradient clip's identity)."""
    assert traced or not lifted, "constants are lifted into traced programs only"
    out_specs = placeable(graph, out_specs)
    in_sh = tuple(NamedSharding(mesh, s.to_pspec()) for s in in_specs)
    out_sh = tuple(NamedSharding(mesh, s.to_pspec()) for s in out_specs)
    n = len(in_specs)

    def placed(xs, specs):
        return [_constrain(x, s, mesh) for x, s in zip(xs, specs, strict=True)]

    def run(*flat):
        if traced:
            outs = replay(graph, plan, mesh, placed(flat[:n], in_specs), fp32_communication,
                          dict(zip(lifted, flat[n:], strict=True)))
            return tuple(placed(outs, out_specs))
        return tuple(replay(graph, plan, mesh, list(flat), fp32_communication))

    # Traced, the results are laid out by constraints inside the program, not out_shardings:
    # under jax.grad in a jax.set_mesh context jit checks a cotangent's sharding against them.
    if traced and source is not None and graph.custom_derivatives:
        program = jax.custom_jvp(run)

        def exact(*xs):
            return tuple(placed(source(*placed(xs[:n], in_specs), *xs[n:]), out_specs))

        program.defjvp(lambda primals, tangents: jax.jvp(exact, primals, tangents))
        return jax.jit(program)
    if traced:
        return jax.jit(run)
    return jax.jit(run, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate)
