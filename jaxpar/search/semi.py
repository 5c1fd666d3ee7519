"""sharding_propagation as `jaxpar.shard` runs it: propagation, then the plan polished exactly.

Before: an OpGraph, the specs the user fixed (inputs and outputs), carried-state ties, a
CostModel, and for semi-auto the axes each fixed weight is read on as laid out (`kept`, see
propagation.py). After: a GraphPlan and notes for the Plan.

1. Propagation (propagation.propagate) from the fixed specs. It asks a carried output for its
   input's spec only once that input has one, so where carried state is free it plans once to
   place it, then again with it placed; that first pass is a start too (a Linen nn.scan
   transformer's SGD-momentum step, batch fixed: placed, the second pass cut the backward
   scan's carry on one axis of three and came out twice as dear: 0.79 ms modelled after the
   polish, from the first pass 0.28 ms, jit's data parallel). Where the user fixed carried
   state (a training step's parameters and optimizer state), it plans two ways: with each
   carried output tied, asked for its input's spec and reached by the front like any op; and
   with it fixed, its producer planned first from that demand (the optimizer, then the
   gradients backwards). Each way runs in two orders, ops planned as reached or waiting for a
   bigger operand still to be made (propagate's `wait`), and the order of lower objective as
   propagated goes on (on the cases below, the one that also polishes better, or as well). No
   way and no order is better everywhere (modelled step time, each after steps 2 and 3):

   | program | tied | tied, waiting | fixed | fixed, waiting |
   |---|---:|---:|---:|---:|
   | gpt_plans' data-parallel layout | 1.27 ms | 1.10 ms | 1.78 ms | 1.98 ms |
   | gpt_plans' FSDP layout | 1.44 ms | 1.35 ms | 1.35 ms | 1.35 ms |
   | configs/mlp_data_parallel.yaml (tpu-v5e) | 547 us | 547 us | 410 us | 410 us |

   Between the two ways, though, a propagated plan's own score says little of which one
   polishes better (the data-parallel GPT: 3.0 ms tied, 2.5 fixed, as propagated), so both
   are polished.
2. Each plan refined with the exact objective, op by op and chain by chain (refine.refine);
   the ops reading a kept weight keep reading it as laid out (propagation.pinned_ops).
3. Then its tail (the gradients' last matmuls and reductions, the optimizer) solved again
   exactly, the rest held, the carried state it reads placed anew (resolve.solve_tail).
   Propagation decides a gradient's matmul from its operands alone (a reduce-scatter is
   cheaper than an all-reduce), and the optimizer was then computed cut and the replicated
   parameters gathered back at the end of the step. Of the two ways, the plan of lower
   objective is kept. (The tail solved first and the winner refined after: the Megatron
   layout and the semi-auto GPT config came out 1-2% slower.)
4. Then, in the plan kept, the small values moved by collectives solved again exactly with the
   ops around them (resolve.solve_latency_bound): a small partial sum (a BatchNorm's batch
   statistics) reduce-scattered, for half an all-reduce's bytes, and gathered for its
   readers pays two latencies where one all-reduce pays one (an nnx CNN with BatchNorm in
   semi_auto, batch 64: 275 -> 138 us modelled; gpt_plans' Megatron layout: 1.180 -> 1.170
   ms estimated from the compiled program; a GPT step of 2 layers with no strategy: 2.04 ->
   1.78 ms modelled).
5. Then each mesh axis solved again exactly, last to first, the other axes held as the plan
   kept so far uses them and the pinned ops whole (resolve.solve_axes; recursive_programming
   solves two of its axes so, from the union of its starts: resolve.solve_axis_from_any).
   Propagation and the op-by-op polish move one op or one chain at a
   time; the exact solve of one axis moves every op's use of it together, and finds the layouts
   that take several ops changing at once (modelled, before -> after):

   | program | before | after | the exact search |
   |---|---:|---:|---:|
   | GPT step, 2 layers, d 1024, no strategy | 1.784 ms | 1.197 ms | 0.957 ms |
   | the same, 48 layers | 31.6 ms | 23.7 ms | 17.0 ms |
   | nnx CNN with two BatchNorms, semi_auto, batch 64 | 138 us | 52 us | 54 us |
   | attention_tensor_parallel (jaxpar.models.programs) | 45.1 us | 30.2 us | |
   | gpt_plans' Megatron layout | 1.129 ms | 1.111 ms | |
   | the same at level 2, mem_coeff 0, estimated from the compiled program | 1.150 ms | 1.051 ms | |

   It costs search time (benchmarks/search_time.py, two runs): 0.79 s -> 1.64-1.75 s at 2
   layers, 2.32 s -> 4.23-4.80 s at 48 (three axes solved, each over tables of the whole
   graph; repeated layers folded). A second sweep over the axes changed no plan of
   gpt_plans' three layouts nor the 2-layer GPT's.
6. Where no op is pinned (no weight fixed: nothing given, or only the batch) on a mesh of
   several axes, the axes are also solved again, the same way, from the best plan that uses
   every axis together (resolve.solve_lockstep, exact over the plans of the flat mesh) and,
   on three axes or more, from the best that uses each of resolve.axis_runs together
   (solve_grouped: a 4 x 2 mesh's plans on 2 x 2 x 2), the starts recursive_programming
   takes too; the axes are solved again from each start scoring at most _START_NEAR times
   the least (propagation's plan among them, before its axes are solved: a GPT step's
   scores 1.23x the grouped plan, whose axes change nothing), and the plan of lowest
   objective is kept. Propagated from nothing, the first decisions are two-way cuts that suit
   one axis of make_mesh(8)'s three, and one axis solved at a time does not undo them
   (search_gap's quick MLP Adam step on 2 x 2 x 2, h100-nvlink: 1.47x the exact search's
   objective and 1.74x its modelled time, then 1.00x; the GPT step of search_time.py,
   2 layers: 1.267 ms modelled, 1.066 from the lockstep start alone, 1.005 with the grouped
   one, the exact search 1.020; 48 layers 23.3, 18.5 and 17.0 ms, the exact search 17.0).
   It costs two exact solves and the axes of the starts kept (48 layers: about as long as
   the three axes of propagation's plan it skips there).
7. Last, where the reductions of two of the plan's tail ops or more wait for others' results
   (a global norm's sums of squares, cut, wait for the gradients' all-reduce, and XLA cannot
   combine them), or where a device group pays its latency for one reduction, the tail is
   solved again with each kind's reductions kept to fewer device groups and rounds
   (resolve.solve_tail_rounds, as recursive_programming does last): the searches price each
   tail reduction at a share of one latency, and one op at a time no move removes the later
   collectives. optax.clip_by_global_norm before Adam in a 2-layer GPT step (d 128) on 8
   devices: eight all-reduces compiled, then one.
8. A memory budget bounds nothing above (the objective weighs memory): a plan over it is
   searched again, steps 1 to 7, with larger mem_coeffs, and the fitting plan of least
   objective is kept (budget.within_budget, as recursive_programming does), or the plan one
   of them was polished from where that fits and scores less: the polish weighs the bytes a
   plan holds, not its peak, and may raise it. A momentum-SGD
   step of a 2-layer GPT (d_model 64) on make_mesh(8), given its unbudgeted peak less one
   byte: 5.91x the unbudgeted modelled time when this mode kept the leaner of its propagated
   and polished plans, 1.46x searched again (recursive_programming's plan: 1.59x). When none
   fits, the leanest plan found goes back (the caller refuses a plan over the budget, quoting
   its peak).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxpar import progress
from jaxpar.cost.model import CostModel
from jaxpar.ir.graph import OpGraph
from jaxpar.search.budget import scored, within_budget
from jaxpar.search.propagation import GraphIndex, GraphPlan, handed_back, pinned_ops, propagate
from jaxpar.search.refine import refine
from jaxpar.search.resolve import (
    axis_runs,
    objective,
    solve_axes,
    solve_grouped,
    solve_latency_bound,
    solve_lockstep,
    solve_tail,
    solve_tail_rounds,
)
from jaxpar.spec import Spec

_START_NEAR = 1.05  # step 6: the axes are solved again from each start scoring at most this
                    # many times the least (each is solved apart here; recursive_programming
                    # keeps every start, each adding candidates to one solve)


def sharding_propagation(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
                         fixed_out: dict[int, Spec], ties: Sequence[tuple[int, int]] = (),
                         index: GraphIndex | None = None,
                         kept: dict[int, frozenset[str]] | None = None,
                         memory_budget: float | None = None) -> tuple[GraphPlan, list[str]]:
    """Plan `graph` by sharding propagation and polish it (see the module docstring).

    Args:
      graph, model: the program and its cost model.
      fixed_in: {value id: Spec} the user fixed; fixed_out: {output position: Spec}.
      ties: (input value, output position) pairs of carried state: the output comes back in
        the input's spec (the fixed one, for an input in fixed_in).
      index: the graph's GraphIndex, when the caller has one.
      kept: {fixed input: mesh axes} read as laid out (propagate's `kept`).
      memory_budget: bytes per device (step 7), or None.

    Returns:
      (GraphPlan, notes).

    Raises:
      ValueError: when no plan can fit memory_budget (budget.beyond_reach).

    Example:
      >>> gp, notes = sharding_propagation(graph, model, {x: Spec((("dp",), ()))}, {})
    """
    from jaxpar.plan import search_peak

    ties = tuple(ties)
    index = GraphIndex.of(graph, index)
    propagated: list[GraphPlan] = []  # each search's propagated plan, polished or not

    def search(m: CostModel) -> tuple[GraphPlan, list[str]]:
        gp, notes, start = _polished(graph, m, fixed_in, fixed_out, ties, index, kept)
        propagated.append(start)
        return gp, notes

    if memory_budget is None:
        return search(model)
    runs, chosen, _ = within_budget(graph, model, fixed_in, fixed_out, ties, memory_budget,
                                    search, "sharding_propagation")
    if chosen is runs[0]:
        return chosen.plan, chosen.lines
    # Every plan found, the propagated ones each was polished from included (a polish weighs
    # the bytes a plan holds, not its peak, and may raise it): the fitting one of least
    # objective, else the leanest (the caller refuses a plan over the budget, quoting its peak).
    found = [(r.plan, r.mem_coeff, "polished", r.lines) for r in runs] + \
        [(gp, r.mem_coeff, "propagated", []) for gp, r in zip(propagated, runs, strict=True)]
    peaks = [r.peak for r in runs] + [search_peak(graph, gp, model.mesh, fixed_out, ties)
                                      for gp in propagated]
    fits = [k for k, peak in enumerate(peaks) if peak <= memory_budget]
    said = (f"sharding_propagation: memory_budget={memory_budget:.0f} bytes per device: its "
            f"plan with mem_coeff={model.mem_coeff:g} peaked at {runs[0].peak:.0f} bytes, so "
            f"it searched again with larger mem_coeffs ({len(runs) - 1} more plans); ")
    if fits:
        k = min(fits, key=lambda k: (scored(graph, model, found[k][0], fixed_out, ties), k))
        said += (f"kept the {found[k][2]} plan of mem_coeff={found[k][1]:g} (peak "
                 f"{peaks[k]:.0f} bytes), the lowest objective of the {len(fits)} that fit")
    else:
        k = min(range(len(found)), key=peaks.__getitem__)
        said += (f"none fits; kept the leanest plan found ({found[k][2]}, mem_coeff="
                 f"{found[k][1]:g}, {peaks[k]:.0f} bytes at its peak)")
    return found[k][0], found[k][3] + [said]


def _polished(graph: OpGraph, model: CostModel, fixed_in: dict[int, Spec],
              fixed_out: dict[int, Spec], ties: tuple[tuple[int, int], ...],
              index: GraphIndex, kept: dict[int, frozenset[str]] | None
              ) -> tuple[GraphPlan, list[str], GraphPlan]:
    """Steps 1 to 6: (the plan, notes, the propagated plan it was polished from)."""
    pinned = pinned_ops(graph, index, fixed_in, kept)
    placed = dict(fixed_in)
    free = [v for v, _ in ties if v not in fixed_in]
    first = None
    progress.step("propagating")  # (steps of the caller's stage: the progress line, timed())
    if free:  # step 1's first pass: carried inputs no one fixed take the spec it gives them
        first = propagate(graph, model, fixed_in, fixed_out, ties=ties, index=index, kept=kept)
        placed |= {v: first.specs[v].resolved() for v in free}

    def score_of(gp: GraphPlan) -> float:
        return objective(graph, model, gp, fixed_out, ties)

    def start(out: dict[int, Spec], tied: tuple, also: tuple = ()) -> GraphPlan:
        """Propagation both ways (ops planned as reached, or waiting for a bigger operand),
        and the plans `also`: the one of lower objective."""
        plans = [propagate(graph, model, placed, out, ties=tied, index=index, kept=kept,
                           wait=wait) for wait in (False, True)]
        return min([*plans, *also], key=score_of)

    # the first pass too: its state placed as it went, where the passes from it start
    starts = [start(fixed_out, ties, () if first is None else (first,))]
    back = handed_back(graph, fixed_in, fixed_out, ties)
    if len(back) > len(fixed_out):
        starts.append(start(back, tuple((v, pos) for v, pos in ties if pos not in back)))
    progress.step("refining, the step's tail solved again exactly")
    solved = [solve_tail(graph, model, refine(graph, model, gp, fixed_in, fixed_out, None,
                                              ties, index, pinned, chains=True),
                         fixed_in, fixed_out, ties, index, pinned)
              for gp in starts]  # (plan, its objective) each
    k = min(range(len(solved)), key=lambda i: solved[i][1])
    progress.step("latency-bound collectives solved again exactly")
    better, score = solve_latency_bound(graph, model, solved[k][0], fixed_in, fixed_out, ties,
                                        index, pinned, before=solved[k][1])
    axes, solved_axes, notes = model.mesh.names[::-1], [], []
    begins = [("propagation", better, score)]
    if not pinned and len(axes) > 1:  # step 6: also the best plans of fewer axes
        progress.step("every axis used together, solved exactly")
        flat = solve_lockstep(graph, model, fixed_in, fixed_out, ties)
        begins.append(("all of them together", flat, score_of(flat)))
        if len(axes) > 2:
            runs = axis_runs(model)
            named = " and ".join("+".join(r) for r in runs)
            progress.step(f"axes {named} each used together, solved exactly")
            grouped = solve_grouped(graph, model, fixed_in, fixed_out, ties, runs)
            begins.append((f"{named} each together", grouped, score_of(grouped)))
    least = min(s for _, _, s in begins)
    ends = [(what, *solve_axes(graph, model, begin, fixed_in, fixed_out, ties, axes, score_of,
                               before=begin_score, held=pinned, solved=solved_axes)[:2])
            for what, begin, begin_score in begins if begin_score <= least * _START_NEAR]
    what, better, after = min(ends, key=lambda e: e[2])
    progress.step("the step's tail solved again where its reductions wait on one another")
    better, after = solve_tail_rounds(graph, model, better, fixed_in, fixed_out, ties, index,
                                      pinned, after)
    if what != "propagation":
        notes.append(f"sharding_propagation: no weight fixed, so the mesh axes were also solved "
                     f"again from the best plan using {what}; that plan is kept (objective "
                     f"{after:.6g}; propagated and polished {score:.6g})")
    return better, notes, starts[k]
