"""Carried state's second copies at a step's end, moved out of an exact plan over its budget.

Before: the exact search's tables built for a memory budget (every op a node: build_tables'
fold=False), their Problem, and a choice over them whose plan holds more than the budget at
its peak (plan.peak_memory's count). The solver prices memory per node's choice, and misses
what two choices make together: a carried output made in another spec than its free input
comes in is held twice at the step's end, as made and resharded into the input's spec (its
size depends on the producer's choice and the input's). After: a choice whose plan holds
less, or the same choice when no move lowers the peak.

A move gives one carried state one spec in and out: its input node takes the spec its update
makes it in, or the op making the update takes, of its candidates that make it in the input's
spec, the one of least local cost (the rest as chosen). Every move is priced exactly (the
tables' objective, the plan's peak) and the greedy step takes the fitting move of least
objective, else the one shedding most bytes per unit of objective it adds, until the plan
fits, no move lowers its peak or the time is up. The exact search's refits (exact._refit:
solved again for a budget lowered by the excess) come first; where they have no time left
or miss again (the memory_budget benchmark's ViT at 0.3 of the optimum's peak: 37,616 bytes
for a budget of 36,288, refitted 37,000 or 31,976 as the machine's pace allowed), one move
of its first plan fits: 36,080 bytes, its objective 6% higher.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxpar.ir.graph import OpGraph
from jaxpar.search.dynamic import Problem, objective
from jaxpar.search.propagation import GraphPlan
from jaxpar.search.tables import Tables, local_costs, made_by, touching_edges

_MIN_S = 1.0  # seconds the moves may take at least, whatever time the search has left


def shed_copies(graph: OpGraph, t: Tables, problem: Problem, choice: np.ndarray,
                plan: GraphPlan, peak: float, ties: Sequence[tuple[int, int]], budget: float,
                plan_of: Callable[[np.ndarray], GraphPlan],
                peak_of: Callable[[GraphPlan], float], seconds: float
                ) -> tuple[np.ndarray, GraphPlan, int]:
    """(choice, its plan, moves made): `choice` with carried states moved where their end
    copies break `budget` (see the module docstring).

    Args:
      graph, t, problem: the program, its tables (not folded) and their Problem.
      choice: a candidate per node of `t`; plan, peak: its plan and that plan's peak.
      ties: (input value, output position) pairs of carried state.
      budget: bytes per device.
      plan_of: the GraphPlan of a choice (exact._to_plan); peak_of: its peak as the budget
        counts it (plan.search_peak).
      seconds: time for the moves (at least _MIN_S).
    """
    deadline = time.perf_counter() + max(seconds, _MIN_S)
    groups = {n: list(g) for g in t.tied for n in g}
    touching = touching_edges(t)
    producer = made_by(graph)  # value -> (op, result index)
    cost, moves = objective(problem, choice), 0
    while peak > budget and time.perf_counter() < deadline:
        priced = []
        for tried in _moves(graph, t, plan, choice, ties, producer, groups, touching):
            p = plan_of(tried)
            held = peak_of(p)
            if held < peak:
                priced.append((held, objective(problem, tried), tried, p))
            if time.perf_counter() > deadline:
                break
        if not priced:
            break
        fits = [m for m in priced if m[0] <= budget]
        peak, cost, choice, plan = min(fits, key=lambda m: m[1]) if fits else \
            max(priced, key=lambda m: (peak - m[0]) / max(m[1] - cost, 1e-300))
        moves += 1
    return choice, plan, moves


def moved_note(moved: int) -> str:
    """What a plan's note says of `moved` (> 0) carried states moved so (Solution.moved)."""
    return (f"then {moved} carried state{'s' if moved > 1 else ''} given one layout in and "
            "out where the copy held at the step's end broke the budget")


def _moves(graph: OpGraph, t: Tables, plan: GraphPlan, choice: np.ndarray, ties, producer,
           groups: dict[int, list[int]], touching: dict[int, list]):
    """The choices one move away: per carried output held twice at the end (largest first,
    by the bytes its input holds), its input in the made spec, or its producer making it in
    the input's spec."""
    twice = [(v_in, graph.outputs[pos]) for v_in, pos in ties
             if v_in in t.input_nodes and graph.outputs[pos] in producer
             and plan.specs.get(graph.outputs[pos]) is not plan.specs.get(v_in)]
    twice.sort(key=lambda p: -t.node_mem[t.input_nodes[p[0]]][choice[t.input_nodes[p[0]]]])
    for v_in, v in twice:
        node = t.input_nodes[v_in]
        made, wanted = plan.specs[v], plan.specs[v_in]
        k = next((k for k, s in enumerate(t.cands[node]) if s is made), None)
        if k is not None:
            yield _moved(choice, groups.get(node, [node]), k)
        op, j = producer[v]
        op_node = t.op_nodes.get(op.index)
        if op_node is None:
            continue
        members = groups.get(op_node, [op_node])
        ks = [k for k, s in enumerate(t.cands[op_node]) if s.outs[j].resolved() is wanted]
        if ks:
            local = sum(local_costs(t, choice, n, touching.get(n, ())) for n in members)
            yield _moved(choice, members, min(ks, key=local.__getitem__))


def _moved(choice: np.ndarray, nodes: list[int], k: int) -> np.ndarray:
    out = choice.copy()
    out[nodes] = k
    return out
