"""recursive_programming against the exact optimum: how far the fast search's plans are from
dynamic_programming's, in the cost model's own objective, on the benchmark models.

For each model of a preset (`models.build`: Adam training steps of an MLP, a GPT, a top-2 MoE
layer, a ViT), each mesh ((8,), (4, 2) and make_mesh(8)'s (2, 2, 2) of the 8 simulated CPU
devices), each hardware
profile and two objectives (the default, level 0 with mem_coeff 0.1, and "speed", level 2 with
mem_coeff 0), both modes plan the step with no strategy given, and each plan is scored with the
objective its search minimised (`CostModel.score` of `graph_cost`, carried outputs back in
their input's spec and the step's tail reductions one latency per kind and device group, as
`Plan.cost` prices them: `resolve.objective`). Reported per case: both scores, their ratio
(1.0: recursive_programming's plan scores as the exact search's; below 1 where the exact
search's tables, pricing each tail reduction a share of one latency, missed the cheaper
tail) and both plan times. Nothing is compiled:
`gpt_plans.py` and `run.py` check plans against compiled programs.

Writes DIR/search_gap.json and DIR/search_gap.md (a row per case, then the summary: mean and
worst ratio, and how many cases are within 5%).

    python benchmarks/search_gap.py --out results
    python benchmarks/search_gap.py --models mlp gpt --meshes 8 --hardware h100-nvlink
    python benchmarks/search_gap.py --preset deep --models gpt vit --out results  # 8 layers
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

OBJECTIVES = {"default": {"level": 0, "mem_coeff": 0.1}, "speed": {"level": 2, "mem_coeff": 0.0}}
MODES = ("recursive_programming", "dynamic_programming")
HARDWARE = ("h100-nvlink", "h100-2node-ib", "tpu-v5e")
MESHES = ("8", "4x2", "2x2x2")  # 2x2x2: make_mesh(8), the default mesh


def plan_objective(plan, graph, hardware: str, level: int, mem_coeff: float,
              recompute_heavy: bool = False) -> float:
    """`plan`'s score under the objective the automatic searches minimise (CostModel.score of
    graph_cost: level 0 counts communication twice, mem_coeff weighs memory; the step's tail
    reductions one latency per kind and device group: resolve.objective), its carried
    outputs back in their input's spec as Plan.cost prices them. search_time.py uses it too."""
    from jaxpar.cost import CostModel, load_profile
    from jaxpar.search.resolve import objective

    model = CostModel(plan.mesh, load_profile(hardware), level, mem_coeff,
                      recompute_heavy=recompute_heavy)
    return objective(graph, model, plan.graph_plan, dict(enumerate(plan.flat_out_specs)), ())


def score_plans(name: str, preset: str, meshes, hardware, objectives) -> list[dict]:
    """Plan one model with both modes for every (mesh, hardware, objective); a row each."""
    import jax
    import models
    import numpy as np
    from jax.sharding import Mesh

    import jaxpar
    from jaxpar.ir import build_graph, trace

    model = models.build(name, preset)
    traced = trace(model.step, model.args)
    graph = build_graph(traced.closed_jaxpr, traced.in_paths)
    rows = []
    for mesh_name in meshes:
        shape = tuple(int(n) for n in mesh_name.split("x"))
        devices = np.array(jax.devices("cpu")[:8]).reshape(shape)
        mesh = Mesh(devices, tuple(f"d{i}" for i in range(len(shape))))
        for hw in hardware:
            for objective in objectives:
                kw = OBJECTIVES[objective]
                row = {"model": name, "mesh": mesh_name, "hardware": hw,
                       "objective": objective}
                for mode in MODES:
                    f = jaxpar.shard(model.step, mesh=mesh, search_mode=mode, hardware=hw, **kw)
                    start = time.perf_counter()
                    plan = f.plan(*model.args)
                    row[f"{mode}_s"] = time.perf_counter() - start
                    row[mode] = plan_objective(plan, graph, hw, kw["level"], kw["mem_coeff"])
                row["ratio"] = row["recursive_programming"] / row["dynamic_programming"]
                rows.append(row)
                print(f"{name} {mesh_name} {hw} {objective}: RP/DP {row['ratio']:.3f}",
                      flush=True)
    return rows


def summary(rows: list[dict]) -> dict:
    ratios = [r["ratio"] for r in rows]
    return {"cases": len(rows), "mean_ratio": sum(ratios) / len(ratios),
            "worst_ratio": max(ratios), "within_5pct": sum(r <= 1.05 for r in ratios)}


def markdown(result: dict) -> str:
    s = result["summary"]
    lines = [f"recursive_programming / dynamic_programming, each plan scored with the objective "
             f"its search minimised; preset {result['preset']}; jax {result['jax']}.", "",
             "| model | mesh | hardware | objective | RP | DP | RP / DP | RP time | DP time |",
             "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['model']} | {r['mesh']} | {r['hardware']} | {r['objective']} | "
                     f"{r['recursive_programming'] * 1e3:.4f} ms | "
                     f"{r['dynamic_programming'] * 1e3:.4f} ms | {r['ratio']:.3f} | "
                     f"{r['recursive_programming_s']:.2f} s | "
                     f"{r['dynamic_programming_s']:.2f} s |")
    lines += ["", f"{s['cases']} cases: mean RP/DP {s['mean_ratio']:.3f}, worst "
                  f"{s['worst_ratio']:.3f}, within 5%: {s['within_5pct']} of {s['cases']}."]
    return "\n".join(lines) + "\n"


def run(names, preset: str, meshes, hardware, objectives, out: Path) -> dict:
    import jax

    rows = []
    for name in names:
        rows += score_plans(name, preset, meshes, hardware, objectives)
    result = {"preset": preset, "jax": jax.__version__, "rows": rows,
              "summary": summary(rows)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "search_gap.json").write_text(json.dumps(result, indent=1))
    (out / "search_gap.md").write_text(markdown(result))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["mlp", "gpt", "moe", "vit"])
    p.add_argument("--preset", default="quick")
    p.add_argument("--meshes", nargs="+", default=list(MESHES), choices=MESHES)
    p.add_argument("--hardware", nargs="+", default=list(HARDWARE))
    p.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=OBJECTIVES)
    p.add_argument("--out", type=Path, default=Path("results"))
    a = p.parse_args(argv)
    result = run(a.models, a.preset, a.meshes, a.hardware, a.objectives, a.out)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
