"""Planning region ops (scan, while, cond): their bodies are planned once, not per iteration.

Before: a region op whose operand specs are partly known. After: one OpStrategy for the op, the
GraphPlan of each body, the modeled cost (a scan's body cost times its length; a while loop's
times its trip count where XLA can tell it (known_trips), else once; what a loop computes from
its constants alone, and their resharding, once, as XLA hoists it; a cond costs its most
expensive branch). A body's tail reductions pay one whole latency per kind and device group
each time it runs (plan.tail_latency): XLA combines them inside a body as it does at the end
of a step, and graph_cost alone gives each only a share of one (a GRU training step's scans
were modelled at 155 us where the compiled program's collectives cost 421 us).

Carried values keep one spec across iterations: the body is planned once with the unknown
carries free, then again with every carry fixed, in and out, to the spec the first pass gave it.

With `CostModel.search_bodies` (jaxpar.shard sets it in every mode), a loop's body (scan, while)
is also solved by dynamic_programming, exactly (within BODY_S seconds a solve), the carries tied
in and out and the known operand specs fixed: `region_candidates` then offers both plans and the
search around the loop picks by its own costs (a scan over a GPT's layers is otherwise planned
by propagation alone). So are a cond's branches: each leads in turn, solved for the known
operand specs with its free operands in the specs its readers read them in, and the other
branches are solved for the operand and result specs it gives; the lead whose dearest branch
costs least is offered (an optimizer update under optax.apply_if_finite or MultiSteps is a
branch: propagated from free operands it ran replicated). A cond is also offered with every
operand and result replicated (_and_replicated). In what follows "loop" means any of these
region ops.
"""

from __future__ import annotations

from jaxpar.cost.model import CostModel, OpCost
from jaxpar.ir.graph import Op, OpGraph, scan_counts, while_trips
from jaxpar.rules.registry import OpInfo
from jaxpar.search.propagation import (
    GraphPlan,
    graph_cost,
    hoisted_ops,
    out_spec,
    propagate,
    sliced_reductions,
)
from jaxpar.spec import OpStrategy, Spec

# Seconds for one exact solve of a loop body (_solved_body): a search may solve a body several
# times (for other operand specs, for the least memory), each outside the search's own time
# limit. A body the exact search cannot prove within it is planned as well as it found by then.
BODY_S = 10.0


def plan_region(op: Op, info: OpInfo, known: list[Spec | None], model: CostModel):
    """(strategy, body plans, cost, trips) for a region op given its known operand specs."""
    return _PLANNERS[op.name](op, info, known, model)


def region_candidates(op: Op, info: OpInfo, known: list[Spec | None],
                      model: CostModel, outs: tuple[Spec | None, ...] | None = None
                      ) -> list[tuple]:
    """plan_region's answer, then (with model.search_bodies, for a loop) the one whose body
    dynamic_programming solved, and (with model.lean_bodies) the one it solved for the least
    memory (model.lean()), then (a cond) its branches with every operand and result
    replicated (_and_replicated), each unless one before it is the same strategy, no costlier
    and (lean_bodies) its bodies hold no more memory.

    outs (a scan or while loop, with model.search_bodies): a spec or None per result; the
    bodies are then solved only, those results made in those specs (a loop's results are
    otherwise made where its body alone finds them cheapest: a scanned training step's
    stacked gradient reduce-scattered, where the parameters it updates are whole)."""
    if not model.search_bodies or op.name not in _SEARCHED:
        return _and_replicated(op, info, known, model, [plan_region(op, info, known, model)])
    if outs is not None and (op.name not in RESULT_SPECS or all(o is None for o in outs)):
        return []
    def solve() -> list[tuple]:
        kept = [] if outs is not None else [plan_region(op, info, known, model)]
        for m in (model, model.lean()) if model.lean_bodies else (model,):
            found = _SEARCHED[op.name](op, info, known, m, *(() if outs is None else (outs,)))
            if not any(covers(k, found, op, model) for k in kept):
                kept.append(found)
        return kept if outs is not None else _and_replicated(op, info, known, model, kept)

    # the searches ask again for the same operand specs
    return _cached(model, (id(op), tuple(known), outs), op, solve)


def _cached(model: CostModel, key: tuple, op: Op, make):
    """model.regions_cache[key], made by make() where it is missing or another op's (a key
    holds the op's id, which a later op may take)."""
    hit = model.regions_cache.get(key)
    if hit is None or hit[0] is not op:
        hit = model.regions_cache[key] = (op, make())
    return hit[1]


def _and_replicated(op: Op, info: OpInfo, known: list[Spec | None], model: CostModel,
                    found: list[tuple]) -> list[tuple]:
    """`found` and, for a cond, its branches planned with every operand and result replicated
    (_whole_cond), unless one of `found` covers it. Planned from the operand specs known (or
    free), a branch takes the cheapest layout for itself alone, its results cut where the step
    around it wants them whole: an optimizer update under optax.apply_if_finite or MultiSteps
    was cut over every device and the replicated parameters gathered back after it (6 to 18
    all-gathers where data parallel pays one all-reduce). A loop is not offered so (its
    carries whole): semi_auto's 1-layer GPT step accumulating 4 microbatches then planned
    1.61 ms, not 1.44, and with dynamic_programming's leanest-input choice off (a test's
    setting) its loop passes ended a scanned GPT step at 1.656 ms, not 0.991."""
    if op.name != "cond":
        return found
    whole = _cached(model, (id(op), "whole"), op, lambda: _whole_cond(op, info, model))
    if any(covers(k, whole, op, model) for k in found):
        return found
    return [*found, whole]


def _whole_cond(op: Op, info: OpInfo, model: CostModel):
    """plan_region's answer for a cond whose operands and results are all replicated."""
    ins = [Spec.replicated(len(shape)) for shape in info.in_shapes[1:]]
    outs = [Spec.replicated(len(shape)) for shape in info.out_shapes]
    plans = [propagate(b, model, _fixed(b.inputs, ins), dict(enumerate(outs)))
             for b in op.regions]
    return _branches(op, info, plans, ins, outs, model)


def held_candidate(choice) -> tuple:
    """A region op's choice in a plan (propagation.Choice) as region_candidates lists one:
    (strategy, body plans, cost, trips)."""
    return choice.strategy, choice.regions, choice.cost, choice.trips


def covers(a: tuple, b: tuple, op: Op, model: CostModel) -> bool:
    """Region candidate a makes b needless (see region_candidates)."""
    if a[0] != b[0] or model.score(a[2]) > model.score(b[2]):
        return False
    if not model.lean_bodies:
        return True
    from jaxpar.plan import body_memory

    return body_memory(op, a[1], model.mesh) <= body_memory(op, b[1], model.mesh)


def _fixed(inputs: tuple[int, ...], specs: list[Spec | None]) -> dict[int, Spec]:
    return {v: s.resolved() for v, s in zip(inputs, specs, strict=True) if s is not None}


def _loop_body(body: OpGraph, known: list[Spec | None], n_lead: int, n_carry: int,
               model: CostModel) -> tuple[GraphPlan, list[Spec]]:
    """Plan a loop body whose inputs are n_lead constants, n_carry carries, then the rest."""
    plan = propagate(body, model, _fixed(body.inputs, known))
    carry_vs = body.inputs[n_lead:n_lead + n_carry]
    carry = [plan.specs[v] for v in carry_vs]
    fixed = _fixed(body.inputs, known) | dict(zip(carry_vs, carry, strict=True))
    plan = propagate(body, model, fixed, dict(enumerate(carry)))
    return plan, carry


def _solved_body(body: OpGraph, known: list[Spec | None], n_lead: int, n_carry: int,
                 model: CostModel, outs: list[Spec | None] | None = None
                 ) -> tuple[GraphPlan, list[Spec]]:
    """_loop_body by dynamic_programming: the cheapest body plan whose new carries come back
    in the specs the carries went in (a known carry: in that spec). outs: a spec or None per
    body output (carries, then the rest): a carry's holds in and out where its spec is not
    known, the rest's are made so."""
    from jaxpar.search.exact import dynamic_programming

    carry_vs = body.inputs[n_lead:n_lead + n_carry]
    wanted = list(outs or ()) + [None] * (len(body.outputs) - len(outs or ()))
    known = [k if k is not None or not n_lead <= i < n_lead + n_carry
             else wanted[i - n_lead] for i, k in enumerate(known)]
    fixed = _fixed(body.inputs, known)
    fixed_out = {i: fixed[v] for i, v in enumerate(carry_vs) if v in fixed}
    fixed_out.update((i, s.resolved()) for i, s in enumerate(wanted)
                     if i >= n_carry and s is not None)
    ties = [(v, i) for i, v in enumerate(carry_vs) if v not in fixed]
    plan, _ = dynamic_programming(body, model, fixed, fixed_out, ties=ties, time_limit=BODY_S)
    return plan, [plan.specs[v].resolved() for v in carry_vs]


def _stacked(spec: Spec) -> Spec:
    return Spec(((),) + spec.dims)


def _scan(op: Op, info: OpInfo, known, model: CostModel, plan_body=_loop_body, outs=None):
    (nc, ncar), length = scan_counts(op.params), op.params["length"]
    body = op.regions[0]
    per_iter = [k if (k is None or i < nc + ncar) else Spec(k.dims[1:])
                for i, k in enumerate(known)]
    # a stacked result is made in a spec that keeps its leading (iteration) dim whole
    per_out = () if outs is None else ([
        s if s is None or j < ncar else
        Spec(s.dims[1:]) if not s.dims[0] and not s.partial else None
        for j, s in enumerate(outs)],)
    plan, carry = plan_body(body, per_iter, nc, ncar, model, *per_out)
    ins = [plan.specs[v] for v in body.inputs]
    ins = ins[:nc + ncar] + [_stacked(s) for s in ins[nc + ncar:]]
    ys = [_stacked(out_spec(body, plan, v)) for v in body.outputs[ncar:]]
    cost = body_cost(body, plan, model, dict(enumerate(carry)), trips=length,
                     invariant=frozenset(body.inputs[:nc]))
    return _strategy(ins, carry + ys), (plan,), cost, length


def _while(op: Op, info: OpInfo, known, model: CostModel, plan_body=_loop_body, outs=None):
    cn, bn = op.params["cond_nconsts"], op.params["body_nconsts"]
    cond, body = op.regions
    carry_known = known[cn + bn:]
    plan, carry = plan_body(body, known[cn:cn + bn] + carry_known, bn, len(carry_known), model,
                            *(() if outs is None else (list(outs),)))
    cond_plan = propagate(cond, model, _fixed(cond.inputs, known[:cn] + carry))
    ins = [cond_plan.specs[v] for v in cond.inputs[:cn]] + \
        [plan.specs[v] for v in body.inputs[:bn]] + carry
    known_count = known_trips(op)
    trips = 1 if known_count is None else known_count  # unknown: priced as one trip
    # The condition runs once more than the body (the test that ends the loop), as the
    # compiled program's collectives count it (analysis: trip + 1) for an unknown count too.
    # A loop XLA knows never runs is deleted, its condition too.
    cost = OpCost() if trips == 0 else \
        body_cost(body, plan, model, dict(enumerate(carry)), trips=trips,
                  invariant=frozenset(body.inputs[:bn])) + \
        body_cost(cond, cond_plan, model, trips=trips + 1, invariant=frozenset(cond.inputs[:cn]))
    if trips and len(cond.shape(cond.outputs[0])):
        cost = cost + _lanes_cost(cond, cond_plan, carry, model, trips, cn)
    return _strategy(ins, carry), (cond_plan, plan), cost, trips


def _lanes_cost(cond: OpGraph, cond_plan: GraphPlan, carry: list[Spec], model: CostModel,
                trips: int, cn: int) -> OpCost:
    """What a loop testing each lane (jax.vmap of a while_loop whose test reads the mapped
    value) runs beyond its body and condition, as lower.jit._while runs it: each test's
    lanes reduced to one predicate (`any`: an all-reduce of one byte where the test is cut),
    and each turn the test again, its lanes laid out as each carry's leading dims (one
    resharding per distinct layout) to keep a finished lane's carry."""
    test = out_spec(cond, cond_plan, cond.outputs[0])
    shape, lanes = cond.shape(cond.outputs[0]), test.rank
    cost = OpCost()
    if test.axes():
        cost = model.reshard(Spec((), test.axes()), Spec(()), (), "bool").scaled(trips + 1)
    again = body_cost(cond, cond_plan, model, trips=trips, invariant=frozenset(cond.inputs[:cn]))
    for lead in {Spec(s.dims[:lanes]) for s in carry}:
        again = again + model.reshard(test, lead, shape, "bool").scaled(trips)
    return cost + again


def body_cost(body: OpGraph, plan: GraphPlan, model: CostModel,
              fixed_out: dict[int, Spec] | None = None, trips: float = 1,
              invariant: frozenset[int] = frozenset()) -> OpCost:
    """A body's modelled cost over `trips` runs (graph_cost, what the compiled program moves),
    its tail reductions paying one latency per kind and device group each run; those XLA moves
    out of the loop (computed from `invariant` alone) once. (All of them paid it each run: a
    while loop's condition, run twice, reducing three loop constants came out of it at minus
    one latency, and dynamic_programming refused the negative cost.)"""
    from jaxpar.plan import tail_latency

    if trips == 0:  # XLA deletes a loop that never runs: nothing is hoisted out of it either
        return OpCost()
    sliced = sliced_reductions(body, plan, model, fixed_out)
    cost = graph_cost(body, plan, model, fixed_out, shared=True, trips=trips,
                      invariant=invariant, sliced=sliced)
    once = hoisted_ops(body, invariant)[0] if trips != 1 else set()
    every = {op.index for op in body.ops} - once
    extra = tail_latency(body, plan, model, every, sliced) * trips + \
        (tail_latency(body, plan, model, once, sliced) if once else 0.0)
    return cost + OpCost(comm_s=extra) if extra else cost


def known_trips(op: Op) -> int | None:
    """How many times a while loop runs, where XLA can tell (ir.graph.while_trips), remembered
    on the op: the searches plan a loop for several operand specs."""
    if "_trips" not in op.__dict__:
        op.__dict__["_trips"] = while_trips(op.params, op.inputs)
    return op.__dict__["_trips"]


def _cond(op: Op, info: OpInfo, known, model: CostModel):
    branches = op.regions
    first = propagate(branches[0], model, _fixed(branches[0].inputs, known[1:]))
    ins = [first.specs[v] for v in branches[0].inputs]
    outs = [out_spec(branches[0], first, v) for v in branches[0].outputs]
    plans = [first] + [propagate(b, model, _fixed(b.inputs, ins), dict(enumerate(outs)))
                       for b in branches[1:]]
    return _branches(op, info, plans, ins, outs, model)


def _solved_cond(op: Op, info: OpInfo, known, model: CostModel):
    """_cond by dynamic_programming. Each branch in turn leads: it takes the cheapest plan for
    the known operand specs (the others free), and every other branch the cheapest that reads
    the operands and gives the results in the specs the leader does. Kept: the lead whose
    dearest branch costs least (an optimizer update under optax.apply_if_finite leads; led
    by the branch that hands the state back unchanged, it would run replicated)."""
    from jaxpar.search.exact import dynamic_programming

    def solved(b: OpGraph, fixed_in: dict, fixed_out: dict) -> GraphPlan:
        return dynamic_programming(b, model, fixed_in, fixed_out)[0]

    best = None
    for lead, branch in enumerate(op.regions):
        first = solved(branch, _fixed(branch.inputs, known[1:]), {})
        ins = _as_read(branch, first, known[1:])
        if ins != [first.specs[v].resolved() for v in branch.inputs]:
            first = solved(branch, _fixed(branch.inputs, ins), {})
        outs = [out_spec(branch, first, v).resolved() for v in branch.outputs]
        plans = [first if k == lead else solved(b, _fixed(b.inputs, ins), dict(enumerate(outs)))
                 for k, b in enumerate(op.regions)]
        found = _branches(op, info, plans, ins, outs, model)
        if best is None or model.score(found[2]) < model.score(best[2]):
            best = found
    return best


def _as_read(body: OpGraph, plan: GraphPlan, known: list[Spec | None]) -> list[Spec]:
    """Each input's spec: the known one, else the one its first reader reads it in under
    `plan` (else the plan's). A free input costs nothing to slice, so a plan may leave it
    replicated where every reader cuts it; the cond's neighbours would then gather it for
    nothing (optimizer state, whose update comes back in the spec it went in)."""
    first: dict[int, Spec] = {}
    for op in body.ops:
        for v, spec in zip(op.inputs, plan.choices[op.index].strategy.ins, strict=True):
            if isinstance(v, int):
                first.setdefault(v, spec.resolved())
    return [k.resolved() if k is not None else first.get(v, plan.specs[v].resolved())
            for v, k in zip(body.inputs, known, strict=True)]


def _branches(op: Op, info: OpInfo, plans: list[GraphPlan], ins: list[Spec], outs: list[Spec],
              model: CostModel):
    """plan_region's answer for a cond whose branches are planned: it costs its dearest
    branch, results resharded into `outs` included."""
    costs = [body_cost(b, p, model, dict(enumerate(outs)))
             for b, p in zip(op.regions, plans, strict=True)]
    cost = max(costs, key=model.score) if costs else OpCost()
    return _strategy([Spec.replicated(len(info.in_shapes[0]))] + ins, outs), tuple(plans), cost, 1


def _strategy(ins: list[Spec], outs: list[Spec]) -> OpStrategy:
    return OpStrategy(tuple(ins), tuple(outs), tuple(() for _ in outs), "region")


_PLANNERS = {"scan": _scan, "while": _while, "cond": _cond}
_SEARCHED = {"scan": lambda op, info, known, m, outs=None: _scan(op, info, known, m,
                                                                 _solved_body, outs),
             "while": lambda op, info, known, m, outs=None: _while(op, info, known, m,
                                                                   _solved_body, outs),
             "cond": _solved_cond}
RESULT_SPECS = frozenset({"scan", "while"})  # loops region_candidates solves for result specs
LOOPS = frozenset(_SEARCHED)  # the region ops whose bodies the automatic searches solve
