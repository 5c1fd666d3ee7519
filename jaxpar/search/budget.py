"""A memory budget met by a search that weighs memory but does not bound it.

Before: a search (recursive_programming's walk, sharding_propagation's propagation and
polish) as a function of the CostModel it plans for, an OpGraph, a budget in bytes per device.
After: the runs it made (mem_coeff, plan, peak, its log lines) and the fitting plan of least
objective, or none.

Those searches weigh a plan's memory by mem_coeff, so a larger one gives plans that hold less
(more model parallel, fewer copies). A plan over the budget is searched again with mem_coeff
four times larger, up to RETRIES times; once one fits, mem_coeffs between the last two are
tried (bisected BISECT times, geometrically) and the fitting plan of least objective under
the model asked for is kept: four times the mem_coeff may give up more time than the budget
asks for (benchmarks/memory_budget.py, budgets of 0.8 x the optimum's peak: 1.4 to 2.3x less
modelled time for its four steps). The peak need not fall as mem_coeff grows (mem_coeff
weighs the bytes a plan holds, not their peak), so a search may end with no plan that fits:
the caller then searches exactly under the budget (recursive_programming) or refuses it.
Before searching again, a budget below what any plan can hold is refused (exact.least_peak).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from jaxpar.cost.model import CostModel
from jaxpar.ir.graph import OpGraph
from jaxpar.search.propagation import GraphPlan
from jaxpar.spec import Spec

RETRIES = 6  # searches again with mem_coeff x4, x16, ...
BISECT = 2   # then between the last two mem_coeffs this many times


@dataclass
class Run:
    """One search under a mem_coeff: its plan, the plan's peak and the search's log."""

    mem_coeff: float
    plan: GraphPlan
    peak: float
    lines: list[str] = field(default_factory=list)


def bigger(mem_coeff: float, attempt: int) -> float:
    """The mem_coeff of the `attempt`-th search again (1, 2, ...)."""
    return max(mem_coeff, 0.1) * 4.0 ** attempt


def within_budget(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
                  fixed_out: dict[int, Spec], ties: Sequence[tuple[int, int]], budget: float,
                  search: Callable[[CostModel], tuple[GraphPlan, list[str]]], mode: str
                  ) -> tuple[list[Run], Run | None, list[str]]:
    """Search under model's mem_coeff, and again with larger ones while the plan breaks
    `budget` (see the module docstring).

    Args:
      graph, model: the program and the cost model asked for.
      fixed_in, fixed_out, ties: as the search takes them (ties: (input value, output
        position) of carried state: its outputs come back in the input's spec, and the peak
        counts them so).
      budget: bytes per device.
      search: plans for a CostModel, returning (plan, log lines).
      mode: the search's name, for messages.

    Returns:
      (every run, the run kept or None when none fits, lines saying what was tried: empty when
      the first run fits).

    Raises:
      ValueError: when no plan can fit (every value at its leanest spec at the program's
      fullest point holds more than `budget`).
    """
    from jaxpar.plan import search_peak

    runs: list[Run] = []

    def run(mem_coeff: float) -> bool:
        m = model if mem_coeff == model.mem_coeff else model.variant(mem_coeff=mem_coeff)
        gp, lines = search(m)
        runs.append(Run(mem_coeff, gp, search_peak(graph, gp, model.mesh, fixed_out, ties),
                        lines))
        return runs[-1].peak <= budget

    if run(model.mem_coeff):
        return runs, runs[0], []
    beyond_reach(graph, model, fixed_in, fixed_out, budget, ties, runs[0].peak, mode)
    for attempt in range(1, RETRIES + 1):
        if run(bigger(model.mem_coeff, attempt)):
            break
    else:
        return runs, None, _tried(runs, {}, budget)
    low, high = runs[-2].mem_coeff, runs[-1].mem_coeff
    for _ in range(BISECT):
        mid = (max(low, high / 64) * high) ** 0.5
        if run(mid):
            high = mid
        else:
            low = mid
    score = {k: scored(graph, model, r.plan, fixed_out, ties)
             for k, r in enumerate(runs) if r.peak <= budget}
    k = min(score, key=lambda k: (score[k], -runs[k].mem_coeff))
    lines = _tried(runs, score, budget)
    lines.append(f"kept the plan with mem_coeff={runs[k].mem_coeff:g}: the lowest score of "
                 "those that fit, under the objective asked for")
    return runs, runs[k], lines


def scored(graph: OpGraph, model: CostModel, plan: GraphPlan, fixed_out: dict[int, Spec],
           ties: Sequence[tuple[int, int]]) -> float:
    """The objective the fitting plans are compared by: model's, each carried output back in
    its input's spec unless the caller fixed its spec (fixed_out)."""
    from jaxpar.search.resolve import objective

    return objective(graph, model, plan, fixed_out,
                     [(v, pos) for v, pos in ties if pos not in fixed_out])


def _tried(runs: list[Run], score: dict[int, float], budget: float) -> list[str]:
    return [f"memory_budget={budget:.0f} bytes per device: the plan with mem_coeff="
            f"{r.mem_coeff:g} peaks at {r.peak:.0f} bytes" +
            (f" and scores {score[k]:.6g}" if k in score else "")
            for k, r in enumerate(runs)]


def beyond_reach(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
                 fixed_out: dict[int, Spec], budget: float, ties: Sequence[tuple[int, int]],
                 peak: float, mode: str) -> None:
    """A ValueError when no plan can fit the budget (exact.least_peak: every value at its
    leanest spec at the program's fullest point), before the searches again with larger
    mem_coeffs (up to nine runs, tens of seconds, for a budget none could meet). Not for a
    graph with loops or conds: the searches plan their bodies anew, which that bound does not
    cover."""
    from jaxpar.search.exact import least_peak

    if any(op.regions for op in graph.ops):
        return
    floor = least_peak(graph, model, fixed_in, fixed_out, tuple(ties))
    if floor > budget * (1 + 1e-9):
        held = sum(graph.values[v].nbytes / s.shards(model.mesh) for v, s in fixed_in.items())
        fixed = "" if not fixed_in else (
            f" The inputs whose layout is fixed hold {held:.0f} bytes per device as laid out: "
            "the strategies given, and under AutoParallel's sharding_propagation (semi_auto) "
            "the parameters as its strategies lay them out, replicated unless parameter_plan "
            "or hsdp cuts them (recursive_programming and dynamic_programming lay them out "
            "themselves).")
        raise ValueError(
            f"memory_budget={budget:.0f} bytes per device cannot be met: no plan holds less "
            f"than {floor:.0f} bytes per device at its fullest point (every value cut as far "
            f"as its op's strategies allow); {mode}'s plan peaks at {peak:.0f}.{fixed} Cut "
            "more dimensions in in_strategy/parameter_plan, use a larger mesh, or raise the "
            "budget.")
