"""Layers under `jax.lax.scan`: how close the automatic searches get to the unrolled plan.

A GPT Adam step (`GPTConfig(scan_layers=...)`) is planned twice per layer count: layers as a
Python list (one traced copy each) and stacked under one `lax.scan` (one body, run once per
layer; its backward is a second scan). For each automatic mode the scanned step is planned with
loop bodies solved exactly (`CostModel.search_bodies`, what `jaxpar.shard` uses) and without
(bodies planned by propagation only, as before it). Reported per row: the plan's modelled cost
(compute plus communication, as `Plan.cost.total_s`) and objective (what the searches minimise,
as `search_gap.plan_objective`), each with carried outputs back in their input's spec, and the
search's CPU time. Nothing is compiled: tests/test_search.py checks that scanned plans run like
jit and move what they predict.

Writes DIR/scan_layers.json and DIR/scan_layers.md.

    python benchmarks/scan_layers.py --out results
    python benchmarks/scan_layers.py --layers 2 --d-model 256 --vocab 1024 --seq 128
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
MODES = ("recursive_programming", "dynamic_programming")


def plan_step(layers: int, scan: bool, mode: str, search_bodies: bool, args) -> dict:
    """Trace, build and search one GPT step; its modelled cost, objective and search time."""
    import jax

    from jaxpar.cost import CostModel, load_profile
    from jaxpar.ir import build_graph, trace
    from jaxpar.models.gpt import GPTConfig, abstract_train_step
    from jaxpar.plan import tail_latency
    from jaxpar.search.exact import dynamic_programming
    from jaxpar.search.propagation import graph_cost
    from jaxpar.search.recursive import recursive_programming
    from jaxpar.search.resolve import objective as plan_objective
    from jaxpar.spec import MeshInfo

    cfg = GPTConfig(layers=layers, d_model=args.d_model, heads=args.heads, vocab=args.vocab,
                    seq=args.seq, scan_layers=scan)
    step, inputs = abstract_train_step(cfg, args.batch)
    traced = trace(step, inputs)
    graph = build_graph(traced.closed_jaxpr, traced.in_paths)
    carried = len(jax.tree_util.tree_leaves(inputs[:2]))  # params and optimizer state
    ties = tuple((graph.inputs[i], i) for i in range(carried))
    model = CostModel(MeshInfo(("d0", "d1", "d2"), (2, 2, 2)), load_profile(args.hardware),
                      0, 0.1, recompute_heavy=False, search_bodies=search_bodies)
    start = time.process_time()
    if mode == "dynamic_programming":
        plan, _ = dynamic_programming(graph, model, {}, {}, ties=ties)
    else:
        plan, _ = recursive_programming(graph, model, {}, {}, ties=ties)
    seconds = time.process_time() - start
    back = {pos: plan.specs[v] for v, pos in ties}
    cost = graph_cost(graph, plan, model, back, shared=True)  # as Plan.cost prices it,
    comm = cost.comm_s + tail_latency(graph, plan, model)      # the tail's latencies too
    objective = plan_objective(graph, model, plan, {}, ties)  # as the searches compare plans
    return {"layers": layers, "scan": scan, "mode": mode, "search_bodies": search_bodies,
            "ops": len(graph.ops), "cost_ms": (cost.compute_s + comm) * 1e3,
            "objective_ms": objective * 1e3, "search_s": seconds}


def markdown(rows: list[dict], args) -> str:
    head = (f"GPT Adam step, d_model {args.d_model}, {args.heads} heads, vocab {args.vocab}, "
            f"seq {args.seq}, batch {args.batch}; 2 x 2 x 2 devices, {args.hardware}; search "
            "CPU time.\n\n| layers | mode | layers as | loop bodies | ops | modelled cost | "
            "objective | search |\n|---:|---|---|---|---:|---:|---:|---:|\n")
    lines = [f"| {r['layers']} | {r['mode']} | {'scan' if r['scan'] else 'list'} | "
             f"{'' if not r['scan'] else 'solved' if r['search_bodies'] else 'propagated'} | "
             f"{r['ops']} | {r['cost_ms']:.3f} ms | {r['objective_ms']:.3f} ms | "
             f"{r['search_s']:.1f} s |" for r in rows]
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", type=int, default=[2, 8])
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--hardware", default="h100-nvlink")
    p.add_argument("--out", type=Path, default=Path("results"))
    args = p.parse_args(argv)
    from jaxpar.demo import ensure_devices

    ensure_devices(8)
    rows = []
    for layers in args.layers:
        for mode in MODES:
            for scan, searched in ((False, True), (True, False), (True, True)):
                rows.append(plan_step(layers, scan, mode, searched, args))
                r = rows[-1]
                print(f"layers {layers} {mode:22s} {'scan' if scan else 'list'} "
                      f"bodies {'solved' if searched else 'propagated'}: cost "
                      f"{r['cost_ms']:.3f} ms, search {r['search_s']:.1f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scan_layers.json").write_text(json.dumps({"config": vars(args) | {
        "out": str(args.out)}, "rows": rows}, indent=1))
    table = markdown(rows, args)
    (args.out / "scan_layers.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
