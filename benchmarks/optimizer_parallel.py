"""Per-device memory of a GPT Adam step under each optimizer-parallel level, from the compiler.

For each level (none, level1, level2, level3) the step runs through
`jaxpar.AutoParallel(step, parallel_mode)` with `hsdp(threshold=0, optimizer_level=level)`, is
compiled for the 8 simulated CPU devices, and `compiled.memory_analysis()` gives the bytes per
device of the arguments (parameters, Adam moments, batch), of the outputs and of the temporaries.
The collectives of the compiled program (`jaxpar.collective_stats`) show how the gradients are
reduced: all-reduce without optimizer parallel, reduce-scatter (written on CPU as all-reduce +
dynamic-slice, counted as reduce-scatter) once the state is cut. Each level also runs two steps
and its losses are checked against `jax.jit` of the same step.

    python benchmarks/optimizer_parallel.py --out results
    python benchmarks/optimizer_parallel.py --layers 2 --d-model 512 --mode recursive_programming

Writes DIR/optimizer_parallel.json and DIR/optimizer_parallel.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def run(args) -> list[dict]:
    from jaxpar.demo import ensure_devices

    ensure_devices(8)
    import jax
    import numpy as np
    import optax

    import jaxpar
    from jaxpar.models import gpt

    cfg = gpt.GPTConfig(layers=args.layers, d_model=args.d_model, heads=args.heads,
                        vocab=args.vocab, seq=args.seq)
    params = gpt.init_params(cfg, jax.random.key(0))
    step, opt_state = gpt.make_train_step(cfg, params, optax.adamw(1e-3))
    tokens, targets = gpt.batch(cfg, args.batch)
    want, p, o = [], params, opt_state
    for _ in range(2):
        p, o, loss = jax.jit(step)(p, o, tokens, targets)
        want.append(float(loss))
    rows = []
    for level in (None, "level1", "level2", "level3"):
        net = jaxpar.AutoParallel(step, args.mode)
        if level:
            net.hsdp(threshold=0, optimizer_level=level)
        compiled = net.lower(params, opt_state, tokens, targets).compile()
        mem = compiled.memory_analysis()
        comm = jaxpar.collective_stats(compiled)
        p, o, losses = params, opt_state, []
        for _ in range(2):
            p, o, loss = net(p, o, tokens, targets)
            losses.append(float(loss))
        rows.append({"level": level or "none", "argument_bytes": mem.argument_size_in_bytes,
                     "output_bytes": mem.output_size_in_bytes,
                     "temp_bytes": mem.temp_size_in_bytes,
                     "all_reduce_bytes": comm.get("all-reduce", {}).get("bytes", 0),
                     "reduce_scatter_bytes": comm.get("reduce-scatter", {}).get("bytes", 0),
                     "all_gather_bytes": comm.get("all-gather", {}).get("bytes", 0),
                     "matches_jit": bool(np.allclose(losses, want, rtol=1e-4))})
    return rows


def markdown(rows: list[dict], args) -> str:
    head = (f"GPT step (Adam), {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}, "
            f"seq {args.seq}, batch {args.batch}; AutoParallel {args.mode} on 8 simulated CPU "
            "devices; bytes per device from `compiled.memory_analysis()` and "
            "`jaxpar.collective_stats`.\n\n")
    lines = ["| level | arguments | outputs | temporaries | all-reduce | reduce-scatter | "
             "all-gather | losses = jax.jit |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {r['level']} | {r['argument_bytes']:,} | {r['output_bytes']:,} | "
              f"{r['temp_bytes']:,} | {r['all_reduce_bytes']:,.0f} | "
              f"{r['reduce_scatter_bytes']:,.0f} | {r['all_gather_bytes']:,.0f} | "
              f"{'yes' if r['matches_jit'] else 'NO'} |" for r in rows]
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--mode", default="semi_auto")
    ap.add_argument("--out", type=Path, default=Path("results"))
    args = ap.parse_args(argv)
    rows = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "optimizer_parallel.json").write_text(json.dumps(rows, indent=1))
    text = markdown(rows, args)
    (args.out / "optimizer_parallel.md").write_text(text)
    print(text)
    return 0 if all(r["matches_jit"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
