"""Does jaxpar run on this backend, with the numbers and the speed of plain jax.jit?

Runs a GPT training step (Adam) through `jaxpar.shard` in each automatic search mode on every
device of the default backend (a GPU, a TPU slice, or the CPU), checks the loss and the new
parameters against `jax.jit` of the same step, and times both (median of --steps calls after a
warm-up): the replayed program with a sharding constraint on every op should cost nothing extra.
It also prints the plan's modelled compute time next to the measured step time under the given
hardware profile, a first look at how far the profile is from the chip.

    python benchmarks/backend_check.py --layers 4 --d-model 1024 --batch 16 --seq 512 \\
        --hardware h100-nvlink --out results

Writes results/backend_check.json and results/backend_check.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np

import jaxpar
from jaxpar.models.gpt import GPTConfig, batch, init_params, make_train_step


def _time(fn, args, steps: int) -> float:
    jax.block_until_ready(fn(*args))  # warm-up (and compile)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(layers: int, d_model: int, heads: int, vocab: int, seq: int, batch_size: int,
        modes: list[str], hardware: str, steps: int) -> dict:
    cfg = GPTConfig(layers=layers, d_model=d_model, heads=heads, vocab=vocab, seq=seq)
    params = init_params(cfg, jax.random.key(0))
    step, opt_state = make_train_step(cfg, params)
    tokens, targets = batch(cfg, batch_size)
    args = (params, opt_state, tokens, targets)
    ref = jax.jit(step)
    want = ref(*args)
    result = {"backend": jax.default_backend(), "devices": len(jax.devices()),
              "device_kind": jax.devices()[0].device_kind, "jax": jax.__version__,
              "config": {"layers": layers, "d_model": d_model, "heads": heads, "vocab": vocab,
                         "seq": seq, "batch": batch_size},
              "hardware": hardware, "jit_step_s": _time(ref, args, steps), "modes": {}}
    for mode in modes:
        f = jaxpar.shard(step, search_mode=mode, hardware=hardware)
        t = time.perf_counter()
        plan = f.plan(*args)
        plan_s = time.perf_counter() - t
        got = f(*args)
        np.testing.assert_allclose(float(got[2]), float(want[2]), rtol=1e-4)
        worst = max(float(np.max(np.abs(np.asarray(g) - np.asarray(w))))
                    for g, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]),
                                    strict=True))
        result["modes"][mode] = {"plan_s": plan_s, "layout": plan.layout,
                                 "step_s": _time(f, args, steps), "max_param_diff": worst,
                                 "modelled_total_s": plan.cost.total_s,
                                 "modelled_compute_s": plan.cost.compute_s}
    return result


def markdown(r: dict) -> str:
    lines = [f"{r['backend']} x{r['devices']} ({r['device_kind']}), jax {r['jax']}, GPT "
             f"{r['config']}, profile {r['hardware']}; jax.jit step "
             f"{r['jit_step_s'] * 1e3:.2f} ms", "",
             "| mode | layout | plan time | step time | vs jax.jit | modelled step | "
             "max param diff |", "|---|---|---:|---:|---:|---:|---:|"]
    for mode, m in r["modes"].items():
        lines.append(f"| {mode} | {m['layout']} | {m['plan_s']:.2f} s | "
                     f"{m['step_s'] * 1e3:.2f} ms | {m['step_s'] / r['jit_step_s']:.2f}x | "
                     f"{m['modelled_total_s'] * 1e3:.2f} ms | {m['max_param_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--modes", nargs="+", default=["recursive_programming",
                                                   "dynamic_programming"])
    ap.add_argument("--hardware", default="h100-nvlink")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="results")
    a = ap.parse_args(argv)
    r = run(a.layers, a.d_model, a.heads, a.vocab, a.seq, a.batch, a.modes, a.hardware,
            a.steps)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "backend_check.json").write_text(json.dumps(r, indent=1))
    (out / "backend_check.md").write_text(markdown(r))
    print(markdown(r))
    return r


if __name__ == "__main__":
    main()
