"""Memory budgets: what each automatic search gives up to fit a step under a per-device budget.

For each model of a preset (`models.build`: Adam training steps of an MLP, a GPT, a top-2 MoE
layer, a ViT) the step is planned on `make_mesh(8)` by dynamic_programming with no budget (the
reference: the optimum of the objective), then by each automatic search mode with budgets of
some fractions of the reference's peak memory per device (`Plan.cost.peak_memory_bytes`); one
budget for every mode, so their rows compare (sharding_propagation too with --modes: it
searches again with larger mem_coeffs as recursive_programming does, from no strategy
given). Reported per case: whether the budget was met (or
the clear error the search gave), the plan's peak, modelled step time and objective (what the
searches minimise, as search_gap.py scores it) as multiples of the reference's, and the plan
time. dynamic_programming bounds the modelled peak exactly (its note says when its time limit
stopped it at a gap; but for the copy of a carried output made in another spec than its free
input's, which its live sets miss and the plan's check refuses); recursive_programming plans
again with larger mem_coeffs until a plan fits, then tries mem_coeffs between the last two. A
budget bounds the modelled peak of live values at their planned layouts (Alpa's definition);
each plan is also compiled (not run) and the bytes its program holds at once by XLA's memory
analysis are reported beside it ("compiled"), which
include XLA's temporaries: a resharded operand's copy, a partial sum before its reduction.

Writes DIR/memory_budget.json and DIR/memory_budget.md (a row per case, then how many budgets
each mode met and what it gave up on average where it met one).

    python benchmarks/memory_budget.py --out results
    python benchmarks/memory_budget.py --models gpt --preset quick --fractions 0.8 0.5
    python benchmarks/memory_budget.py --modes sharding_propagation --out results/sp
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = ("recursive_programming", "dynamic_programming")  # by default; --modes also takes
CHOICES = (*MODES, "sharding_propagation")                   # sharding_propagation
FRACTIONS = (0.8, 0.5, 0.3)


def plan_budgets(name: str, preset: str, modes, fractions, hardware: str) -> list[dict]:
    """Plan one model by dynamic_programming unbudgeted (the reference), then with each mode
    at each fraction of the reference's peak: a row each."""
    import models
    from search_gap import plan_objective

    import jaxpar
    from jaxpar.analysis import compiled_bytes
    from jaxpar.ir import build_graph, trace

    model = models.build(name, preset)
    traced = trace(model.step, model.args)
    graph = build_graph(traced.closed_jaxpr, traced.in_paths)
    rows = []

    def plan(mode: str, budget: float | None = None):
        f = jaxpar.shard(model.step, mesh=jaxpar.make_mesh(8), search_mode=mode,
                         hardware=hardware, memory_budget=budget)
        start = time.perf_counter()
        p = f.plan(*model.args)
        seconds = time.perf_counter() - start
        p.compiled_bytes = compiled_bytes(f.lower(*model.args).compile())
        return p, seconds, plan_objective(p, graph, hardware, f.opts.level, f.opts.mem_coeff)

    free, _, score = plan("dynamic_programming")
    peak, step = free.cost.peak_memory_bytes, free.cost.total_s
    print(f"{name}: unbudgeted optimum's peak {peak:.0f} bytes, compiled "
          f"{free.compiled_bytes:.0f}", flush=True)
    for fraction in fractions:
        for mode in modes:
            row = {"model": name, "mode": mode, "fraction": fraction, "budget": fraction * peak,
                   "free_peak": peak, "free_time": step,
                   "free_compiled": free.compiled_bytes / peak}
            try:
                p, seconds, objective = plan(mode, fraction * peak)
            except ValueError as err:
                row |= {"met": False, "error": str(err)}
            else:
                gap = [n for n in p.notes if n.startswith("dynamic_programming: stopped")]
                row |= {"met": p.cost.peak_memory_bytes <= fraction * peak * (1 + 1e-9),
                        "peak": p.cost.peak_memory_bytes / peak,
                        "compiled": p.compiled_bytes / peak,
                        "time": p.cost.total_s / step, "objective": objective / score,
                        "plan_s": seconds,
                        "note": gap[0] if gap else ""}
            rows.append(row)
            print(f"{name} {mode} {fraction}: " + (
                f"peak {row['peak']:.3f} (compiled {row['compiled']:.3f}), time "
                f"{row['time']:.3f}, objective "
                f"{row['objective']:.3f}, {row['plan_s']:.1f} s"
                if "peak" in row else "refused"), flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        met = [r for r in mine if r["met"]]
        out[mode] = {"cases": len(mine), "met": len(met),
                     "compiled_over_budget": [r["compiled"] / r["fraction"] for r in met],
                     "mean_time": sum(r["time"] for r in met) / len(met) if met else None,
                     "mean_objective": sum(r["objective"] for r in met) / len(met) if met
                     else None}
    return out


def markdown(result: dict) -> str:
    lines = [f"Plans under a memory budget, a fraction of dynamic_programming's unbudgeted "
             f"peak per device; preset {result['preset']}, make_mesh(8), {result['hardware']}; jax "
             f"{result['jax']}. Peak, modelled step time and objective (what the searches "
             "minimise) as multiples of dynamic_programming's unbudgeted plan's; compiled: "
             "the bytes per device the compiled program holds at once (XLA's memory "
             "analysis: arguments, results and temporaries), in the same unit.", "",
             "| model | mode | budget | met | peak | compiled | time | objective | plan time "
             "| note |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        if "peak" in r:
            cells = [f"{r['peak']:.3f}", f"{r['compiled']:.3f}", f"{r['time']:.3f}",
                     f"{r['objective']:.3f}", f"{r['plan_s']:.1f} s", r["note"]]
        else:
            cells = ["", "", "", "", "", r["error"].split(":")[0]]
        lines.append(f"| {r['model']} | {r['mode']} | {r['fraction']:g} | "
                     f"{'yes' if r['met'] else 'no'} | " + " | ".join(cells) + " |")
    lines.append("")
    for mode, s in result["summary"].items():
        mean = "" if s["mean_time"] is None else \
            f"; where met, on average {s['mean_time']:.3f}x the reference's time and " \
            f"{s['mean_objective']:.3f}x its objective"
        over = s["compiled_over_budget"]
        held = "" if not over else \
            f" The compiled programs of the plans that met it hold {min(over):.2f}x to " \
            f"{max(over):.2f}x their budget."
        lines.append(f"{mode}: met {s['met']} of {s['cases']} budgets{mean}.{held}")
    frees = {r["model"]: r["free_compiled"] for r in result["rows"]}
    lines.append("Unbudgeted optimum, compiled over modelled peak: " + ", ".join(
        f"{m} {v:.2f}x" for m, v in frees.items()) + ".")
    return "\n".join(lines) + "\n"


def run(names, preset: str, modes, fractions, hardware: str, out: Path) -> dict:
    import jax

    rows = []
    for name in names:
        rows += plan_budgets(name, preset, modes, fractions, hardware)
    result = {"preset": preset, "hardware": hardware, "jax": jax.__version__, "rows": rows,
              "summary": summary(rows)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_budget.json").write_text(json.dumps(result, indent=1))
    (out / "memory_budget.md").write_text(markdown(result))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["mlp", "gpt", "moe", "vit"])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=CHOICES)
    p.add_argument("--fractions", nargs="+", type=float, default=list(FRACTIONS))
    p.add_argument("--hardware", default="h100-nvlink")
    p.add_argument("--out", type=Path, default=Path("results"))
    a = p.parse_args(argv)
    if any(not 0 < f for f in a.fractions):
        p.error(f"--fractions {a.fractions}: each is a positive fraction of the peak")
    result = run(a.models, a.preset, a.modes, a.fractions, a.hardware, a.out)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
