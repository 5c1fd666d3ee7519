"""Plan time of each search mode on programs unlike a GPT's repeated layers.

search_time.py times GPT steps, whose layers repeat (the searches fold them). These programs do
not fold, or hold loops whose bodies are solved exactly in every mode (model.search_bodies):

  scan_grad N      the gradient of a loss over lax.scan across 8 stacked layers, each body N
                   residual tanh-matmuls (64 x 64 weights, batch 32): its backward body is
                   one exact solve of a core with cycles
  scan_forward N   the forward scan alone, bodies of N residual matmuls reading N slices of one
                   stacked weight (a core with a hub read by every matmul)
  mlp_step N       an Adam step of an N-layer MLP whose widths all differ (64 + 8 i), so that no
                   two layers fold

Each run is its own process (killed after `--time-limit` seconds), on `make_mesh(8)` under the
`--hardware` profile (default `cpu`, jaxpar's own default) with no strategy given; the time is
`.plan()`'s wall clock less a warm trace of the same function (what is left: the search and
assembling the plan), with the plan's modelled cost. Writes DIR/search_programs.json and
DIR/search_programs.md.

    python benchmarks/search_programs.py --out results
    python benchmarks/search_programs.py --programs scan_grad:8 --modes dynamic_programming
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MODES = ("sharding_propagation", "dynamic_programming", "recursive_programming")
PROGRAMS = ("scan_grad:8", "scan_grad:32", "scan_forward:32", "scan_forward:128",
            "mlp_step:16", "mlp_step:32", "mlp_step:64")
_MARK = "SEARCH_PROGRAMS_RESULT "


def program(name: str, n: int):
    """(function, abstract arguments) of one program of the module docstring."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax import lax

    arg = jax.ShapeDtypeStruct
    f32 = jnp.float32

    def residual(h, w):
        for i in range(n):
            h = jnp.tanh(h @ w[i]) + h
        return h

    if name == "scan_grad":
        def loss(ws, x):
            h, _ = lax.scan(lambda h, w: (residual(h, w), None), x, ws)
            return jnp.sum(h ** 2)

        return jax.grad(loss), (arg((8, n, 64, 64), f32), arg((32, 64), f32))
    if name == "scan_forward":
        def forward(x, ws):
            return lax.scan(lambda h, w: (residual(h, w), jnp.sum(h)), x, ws)

        return forward, (arg((32, 64), f32), arg((8, n, 64, 64), f32))
    if name == "mlp_step":
        widths = [64 + 8 * i for i in range(n + 1)]
        params = [{"w": arg((widths[i], widths[i + 1]), f32), "b": arg((widths[i + 1],), f32)}
                  for i in range(n)]
        opt = optax.adam(1e-3)

        def mlp_loss(p, x, y):
            h = x
            for i, layer in enumerate(p):
                h = h @ layer["w"] + layer["b"]
                h = jax.nn.relu(h) if i < n - 1 else h
            return jnp.mean((h - y) ** 2)

        def step(p, s, x, y):
            value, g = jax.value_and_grad(mlp_loss)(p, x, y)
            updates, s = opt.update(g, s, p)
            return optax.apply_updates(p, updates), s, value

        return step, (params, jax.eval_shape(opt.init, params), arg((32, widths[0]), f32),
                      arg((32, widths[-1]), f32))
    raise ValueError(f"program {name!r} is not one of scan_grad, scan_forward, mlp_step")


def plan_once(name: str, n: int, mode: str, hardware: str) -> dict:
    """Trace and plan one program in this process; the figures of one run."""
    from jaxpar.demo import ensure_devices

    ensure_devices(8)
    import jax

    import jaxpar

    fn, args = program(name, n)
    eqns = len(jax.make_jaxpr(fn)(*args).jaxpr.eqns)
    start = time.perf_counter()
    jax.make_jaxpr(fn)(*args)  # warm, as `.plan()` traces it again
    warm = time.perf_counter() - start
    f = jaxpar.shard(fn, mesh=jaxpar.make_mesh(8), search_mode=mode, hardware=hardware)
    start = time.perf_counter()
    plan = f.plan(*args)
    seconds = time.perf_counter() - start
    return {"eqns": eqns, "plan_s": seconds, "search_s": max(seconds - warm, 0.0),
            "cost": plan.cost.total_s, "notes": plan.notes}


def run_child(name: str, n: int, mode: str, hardware: str, time_limit: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", f"{name}:{n}", mode,
           "--hardware", hardware]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=time_limit)
    except subprocess.TimeoutExpired:
        return {"status": "timeout"}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(_MARK)]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": "error", "error": tail[:500]}
    return {"status": "ok"} | json.loads(lines[-1][len(_MARK):])


def parse_program(text: str) -> tuple[str, int]:
    name, _, size = text.partition(":")
    if name not in ("scan_grad", "scan_forward", "mlp_step") or not size.isdigit() or \
            int(size) < 1:
        raise argparse.ArgumentTypeError(
            f"program {text!r}: write NAME:N with NAME scan_grad, scan_forward or mlp_step and "
            "N a positive integer (scan_grad:8)")
    return name, int(size)


def markdown(rows: list[dict], hardware: str, time_limit: float) -> str:
    lines = [f"8 devices, {hardware} profile, no strategy given; each run its own process, "
             f"limit {time_limit:g} s.", "",
             "| program | mode | eqns | search | modelled cost | status |",
             "|---|---|---:|---:|---:|---|"]
    for r in rows:
        ok = r["status"] == "ok"
        lines.append(f"| {r['program']} | {r['mode']} | {r.get('eqns', '')} | "
                     f"{r['search_s']:.2f} s | {r['cost'] * 1e3:.4f} ms | ok |" if ok else
                     f"| {r['program']} | {r['mode']} | | | | {r['status']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", nargs="+", type=parse_program,
                        default=[parse_program(p) for p in PROGRAMS])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--hardware", default="cpu")
    parser.add_argument("--time-limit", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        name, n = parse_program(args.child[0])
        print(_MARK + json.dumps(plan_once(name, n, args.child[1], args.hardware)), flush=True)
        return
    if args.time_limit <= 0:
        parser.error(f"--time-limit {args.time_limit:g}: give a positive number of seconds")
    rows = []
    for name, n in args.programs:
        for mode in args.modes:
            row = {"program": f"{name}:{n}", "mode": mode} | \
                run_child(name, n, mode, args.hardware, args.time_limit)
            rows.append(row)
            print(markdown([row], args.hardware, args.time_limit).splitlines()[-1], flush=True)
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "search_programs.json").write_text(json.dumps(rows, indent=1))
                (args.out / "search_programs.md").write_text(
                    markdown(rows, args.hardware, args.time_limit))
    print(markdown(rows, args.hardware, args.time_limit))


if __name__ == "__main__":
    main()
