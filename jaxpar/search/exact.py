"""dynamic_programming: the exact optimum of the cost model over every op's strategies.

Before: an OpGraph, fixed input/output specs, a CostModel, an optional per-device memory budget.
After: a GraphPlan (as sharding_propagation returns) and the solver's report (optimal or not, gap,
method, seconds). The graph becomes cost tables (tables.py), the tables a `Problem` for the exact
solver (dynamic.py: chain DP, else an ILP over HiGHS), and the answer a plan again. The memory
budget bounds the bytes live at every point of the program (Alpa's peak of live tensors).
"""

from __future__ import annotations

import numpy as np

from jaxpar.cost.model import CostModel
from jaxpar.ir.graph import OpGraph
from jaxpar.rules.registry import OpInfo, has_rule
from jaxpar.search.dynamic import Problem, Solution, solve
from jaxpar.search.propagation import Choice, GraphPlan
from jaxpar.search.tables import Tables, build_tables
from jaxpar.spec import Spec


def dynamic_programming(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
                        fixed_out: dict[int, Spec], memory_budget: float | None = None,
                        time_limit: float = 30.0, ties: tuple[tuple[int, int], ...] = ()
                        ) -> tuple[GraphPlan, Solution]:
    """The cheapest plan of `graph` under `model` (see the module docstring). ties: (input
    value, output position) pairs whose output must come back in the input's spec (the caller
    fixes those outputs to the planned input specs)."""
    t = build_tables(graph, model, fixed_in, fixed_out, tuple(ties))
    budget = _budget_left(graph, model, fixed_in, memory_budget)
    problem = Problem(tuple(t.node_cost),
                      tuple((e.u, e.v, e.cost, e.row, e.col) for e in t.edges),
                      tuple(t.node_mem), _live_sets(graph, t) if budget is not None else None,
                      budget)
    try:
        solution = solve(problem, time_limit)
    except ValueError as err:  # no assignment fits: say it in the user's terms
        raise ValueError(f"memory_budget={memory_budget:.0f} bytes per device cannot be met "
                         f"once the fixed inputs are placed: {err}") from None
    return _to_plan(graph, model, t, solution.choice, fixed_in), solution


def _budget_left(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
                 memory_budget: float | None) -> float | None:
    """Bytes per device left for the searched values once the fixed inputs are placed."""
    if memory_budget is None:
        return None
    fixed = sum(graph.values[v].nbytes / s.shards(model.mesh) for v, s in fixed_in.items())
    if fixed > memory_budget:
        raise ValueError(f"memory_budget={memory_budget:.0f} bytes per device: the inputs whose "
                         f"strategy is fixed already take {fixed:.0f} bytes per device. Cut "
                         "them further, use a larger mesh, or raise the budget.")
    return memory_budget - fixed


def _live_sets(graph: OpGraph, t: Tables) -> tuple[tuple[int, ...], ...]:
    """Nodes whose results are alive at each op, in program order (free inputs: always)."""
    last = {}
    for op in graph.ops:
        for v in op.inputs:
            if isinstance(v, int):
                last[v] = op.index
    outputs = {v for v in graph.outputs if isinstance(v, int)}
    ends = {op.index: max([last.get(v, op.index) for v in op.outputs] +
                          [len(graph.ops) if set(op.outputs) & outputs else op.index])
            for op in graph.ops}
    always = tuple(t.input_nodes.values())
    return tuple(always + tuple(t.op_nodes[q] for q in ends if q <= p <= ends[q])
                 for p in range(len(graph.ops)))


def _local_costs(t: Tables, choice: np.ndarray, node: int, touching: list) -> np.ndarray:
    """Cost of each candidate of `node` with every other node kept at its choice."""
    cost = t.node_cost[node].copy()
    for e in touching:
        if e.u == node:
            cost += e.cost[e.row, e.col[choice[e.v]]]
        elif e.v == node:
            cost += e.cost[e.row[choice[e.u]], e.col]
    return cost


def _to_plan(graph: OpGraph, model: CostModel, t: Tables, choice: np.ndarray,
             fixed_in: dict[int, Spec]) -> GraphPlan:
    plan = GraphPlan(specs=dict(fixed_in))
    for v, node in t.input_nodes.items():
        plan.specs[v] = t.cands[node][choice[node]]
    touching: dict[int, list] = {}
    for e in t.edges:
        touching.setdefault(e.u, []).append(e)
        touching.setdefault(e.v, []).append(e)
    for op in graph.ops:
        node = t.op_nodes[op.index]
        local = _local_costs(t, choice, node, touching.get(node, []))
        k = int(choice[node])
        s = t.cands[node][k]
        others = [j for j in np.argsort(local, kind="stable") if j != k]
        runner = int(others[0]) if others else None
        plans, trips, region_cost = t.regions.get(op.index, ((), 1, None))
        if region_cost is None:
            region_cost = model.op(OpInfo.of(op, graph), s, graph.op_latency_share(op))
        own = region_cost
        plan.choices[op.index] = Choice(
            s, own, float(local[k]), t.cands[node][runner] if runner is not None else None,
            float(local[runner]) if runner is not None else None, len(t.cands[node]),
            has_rule(op.primitive) or bool(op.regions), plans, trips)
        plan.specs.update(zip(op.outputs, s.outs, strict=True))
    for v in graph.inputs:
        plan.specs.setdefault(v, Spec.replicated(len(graph.values[v].shape)))
    return plan
