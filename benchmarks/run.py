"""jaxpar's automatic plans against hand-written JAX layouts: models x meshes x hardware profiles.

For each (model, mesh, hardware) case every strategy is planned and compiled for 8 simulated CPU
devices (nothing runs for the modeled figures):
- jaxpar, one row per search mode: `jaxpar.shard(step, mesh=mesh, search_mode=mode,
  hardware=hw)` with no strategy given (rows "jaxpar-<mode>", and "jaxpar-<mode>-speed" with
  level=2, mem_coeff=0: see OBJECTIVES); the plan depends on the profile.
- the hand-written baselines of `baselines.py` in plain `jax.jit` with in/out shardings:
  data_parallel, fsdp, megatron, maxtext_2d, jax_default, alpa_heuristic (compiled once per
  model and mesh, priced under each profile). A layout that does not fit the case (Megatron's
  tp not dividing the heads, fsdp x tensor on a 1-D mesh) is a row with status "n/a" and why.
Models are `models.py`'s (Adam training steps of an MLP, a GPT, a top-2 MoE layer, a ViT);
meshes (8,), (4, 2), (2, 2, 2) with axes d0, d1, ...; profiles h100-nvlink, h100-2node-ib,
tpu-v5e.

Figures per row (all per device, from the compiled program, never from the plan's prediction):
- modeled_step_s = flops / the profile's peak flop/s + the alpha-beta time of the program's
  collectives (`jaxpar.analysis.estimate_time`: "flop_s" + "comm_s"), which is also how
  jaxpar's planner prices compute under these profiles (`compute_time: flops`). The roofline
  figure (max(flop time, bytes accessed / memory bandwidth) + comm) is kept beside it as
  roofline_step_s; XLA's CPU backend fuses less than a GPU/TPU one, so its byte counts, and
  with them the memory-bound time, are inflated alike for every strategy.
- hlo_comm_bytes: bytes of every collective in the HLO (`collective_stats`, loops counted).
- peak_memory_bytes: `jaxpar.analysis.memory_stats(compiled)["peak_bytes"]`: arguments +
  outputs + temporaries - aliased, or XLA's own peak where larger (as gpt_plans.py).
- search_s: the time of `ShardedFunction.plan` (trace, graph, search); 0 for baselines.
  predicted_comm_bytes and plan_modeled_s: the plan's own figures (jaxpar rows only).
- wall_s (`--wall` only): median time of a few executed steps on the 8 simulated CPU devices.
  They share this machine's cores, so work a layout replicates is paid once per device, and
  other processes add noise: a secondary check. The exit status looks at modeled times only.
Identical programs (same StableHLO) are compiled once and shared by their rows. Without
--wall, XLA is told to spend less effort optimising the CPU machine code (`COMPILE_ONLY_FLAGS`):
the partitioned HLO that every figure is read from is the same.

Writes DIR/results.json (a list of rows), DIR/results.md (per case: jaxpar's best row against
the best baseline; then every row) and DIR/results.png (matplotlib, if installed). Exits with
status 1 when in some case jaxpar's best row is modeled slower than the best baseline, or no
jaxpar row compiled; those cases are printed.

`--quick` (under 10 minutes on 2 cores): `models.py`'s "quick" preset (the issue's sizes,
with 2 instead of 4 layers for the GPT and the ViT: MLP 8 x d 1024 / ffn 4096; GPT d 512,
seq 256; MoE d 1024 / ffn 4096, 8 experts; ViT-Base width, 224 px), on the meshes (8,) and
(4, 2) (not (2, 2, 2)), under all three profiles, with the search modes recursive_programming
and dynamic_programming (the automatic ones; sharding_propagation, MindSpore's mode for
spreading given strategies, runs in the full benchmark); every baseline. `--wall` runs the
"small" preset unless --sizes says otherwise: executing the issue's sizes on 8 simulated CPU
devices takes too long.

    python benchmarks/run.py --quick --out results
    python benchmarks/run.py --models gpt-512 --meshes 4x2 --hardware tpu-v5e --wall
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MESHES = ((8,), (4, 2), (2, 2, 2))
HARDWARE = ("h100-nvlink", "h100-2node-ib", "tpu-v5e")
MODES = ("sharding_propagation", "recursive_programming", "dynamic_programming")
QUICK = {"meshes": ((8,), (4, 2)), "hardware": HARDWARE,
         "modes": ("recursive_programming", "dynamic_programming")}
WALL_STEPS = 3
# "Slower" means by more than 0.01%: below the model's resolution (a 4-byte loss all-reduce
# more or less, a few flops); ratios are printed to four decimals, so nothing is hidden.
RTOL = 1e-4
# XLA flags for runs that only compile: less LLVM optimisation of the CPU machine code. The
# partitioned HLO, and with it every modeled figure, is unchanged (same text, same flops,
# collectives and buffer sizes); only compile time drops. Not used with --wall.
COMPILE_ONLY_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


# jaxpar's objective settings (shard's level and mem_coeff). "default" is what a user gets
# without asking (mem_coeff 0.1 trades some speed for memory); "speed" is level 2 with no
# memory term, the setting for a user who wants the fastest step, which is what this
# benchmark's modeled step time measures. Row names: jaxpar-<mode> and jaxpar-<mode>-speed.
OBJECTIVES = {"default": {"level": 0, "mem_coeff": 0.1}, "speed": {"level": 2, "mem_coeff": 0.0}}


@dataclass(frozen=True)
class Options:
    """What to run (see `main` for the flags)."""

    models: tuple[str, ...]
    meshes: tuple[tuple[int, ...], ...]
    hardware: tuple[str, ...]
    modes: tuple[str, ...] = MODES
    objectives: tuple[str, ...] = tuple(OBJECTIVES)  # jaxpar's objective settings, by name
    baselines: tuple[str, ...] = ()          # empty: every baseline of baselines.BASELINES
    preset: str = "full"                     # models.PRESETS: full, quick, small or tiny
    wall: bool = False
    wall_steps: int = WALL_STEPS


@dataclass
class _Programs:
    """Compiled programs of one (model, mesh), by the hash of their StableHLO."""

    by_text: dict[str, Any] = field(default_factory=dict)
    compile_s: dict[str, float] = field(default_factory=dict)

    def compile(self, lowered) -> tuple[Any, float]:
        key = hashlib.sha1(lowered.as_text().encode()).hexdigest()
        if key not in self.by_text:
            start = time.perf_counter()
            self.by_text[key] = lowered.compile()
            self.compile_s[key] = time.perf_counter() - start
        return self.by_text[key], self.compile_s[key]


def mesh_name(shape: tuple[int, ...]) -> str:
    """(4, 2) -> "4x2"."""
    return "x".join(map(str, shape))


def parse_mesh(text: str) -> tuple[int, ...]:
    """"4x2" (or "4,2") -> (4, 2); the product must be 8."""
    try:
        shape = tuple(int(t) for t in text.replace(",", "x").split("x"))
    except ValueError:
        shape = ()
    if not shape or any(n < 1 for n in shape) or math.prod(shape) != 8:
        raise argparse.ArgumentTypeError(f"--meshes {text!r}: give axis sizes whose product is "
                                         "8, e.g. 8, 4x2 or 2x2x2.")
    return shape


# ---- pricing one compiled program ------------------------------------------------------------

def price(compiled, mesh, hardware: str) -> dict[str, Any]:
    """The row figures of a compiled program under `hardware` (see the module docstring)."""
    from jaxpar.analysis import estimate_time, memory_stats

    est = estimate_time(compiled, mesh, hardware)  # its collectives are collective_stats'
    stats = {k: {"count": int(v["count"]), "bytes": int(v["bytes"])}
             for k, v in est["collectives"].items()}
    return {"modeled_step_s": est["flop_s"] + est["comm_s"], "compute_s": est["flop_s"],
            "comm_s": est["comm_s"],
            "roofline_step_s": max(est["flop_s"], est["memory_s"]) + est["comm_s"],
            "hlo_comm_bytes": float(sum(v["bytes"] for v in stats.values())),
            "peak_memory_bytes": float(memory_stats(compiled).get("peak_bytes", 0)),
            "collectives": stats}


def _row(model, mesh_shape, hardware: str, strategy: str, kind: str, **extra) -> dict:
    return {"model": model.name, "mesh": mesh_name(mesh_shape), "hardware": hardware,
            "strategy": strategy, "kind": kind, "status": "ok", "reason": "",
            "modeled_step_s": None, "hlo_comm_bytes": None, "peak_memory_bytes": None,
            "search_s": 0.0, "predicted_comm_bytes": None, "plan_modeled_s": None} | extra


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"[:400]


# ---- one (model, mesh): baselines once, jaxpar per profile ----------------------------------

def baseline_rows(model, mesh_shape: tuple[int, ...], opts: Options, programs: _Programs,
                  mesh) -> list[dict]:
    """Every baseline compiled once and priced under each profile (n/a rows say why)."""
    import baselines as bl

    rows = []
    for name in opts.baselines or bl.BASELINES:
        try:
            compiled, compile_s = programs.compile(bl.jitted(name, model, mesh).lower(*model.args))
            done = {"compiled": compiled, "compile_s": compile_s}
        except bl.NotApplicable as why:
            done = {"status": "n/a", "reason": str(why)}
        except Exception as err:  # a baseline XLA refuses is a result to report
            done = {"status": "error", "reason": _error(err)}
        for hw in opts.hardware:
            rows.append(_priced(_row(model, mesh_shape, hw, name, "baseline"), done, mesh))
    return rows


def _priced(row: dict, done: dict, mesh) -> dict:
    """row completed by a compile result ({"compiled", "compile_s"} or a status)."""
    if "compiled" not in done:
        return row | done
    return row | {"compile_s": done["compile_s"], "_compiled": done["compiled"]} | price(
        done["compiled"], mesh, row["hardware"])


def jaxpar_row(model, mesh_shape: tuple[int, ...], hardware: str, mode: str,
               programs: _Programs, mesh, objective: str = "default") -> dict:
    """jaxpar.shard in one search mode and objective (OBJECTIVES) with no strategy given:
    planned, compiled, priced."""
    import jaxpar

    suffix = "" if objective == "default" else f"-{objective}"
    row = _row(model, mesh_shape, hardware, f"jaxpar-{mode}{suffix}", "jaxpar")
    try:
        f = jaxpar.shard(model.step, mesh=mesh, search_mode=mode, hardware=hardware,
                         donate_argnums=(0, 1), **OBJECTIVES[objective])
        start = time.perf_counter()
        plan = f.plan(*model.args)
        search_s = time.perf_counter() - start
        compiled, compile_s = programs.compile(f.lower(*model.args))
    except Exception as err:  # a failing mode is a result to report, not a crash
        return row | {"status": "error", "reason": _error(err)}
    predicted = float(sum(v["bytes"] for v in plan.collectives.values()))
    return _priced(row | {"search_s": search_s, "predicted_comm_bytes": predicted,
                          "plan_modeled_s": plan.cost.total_s},
                   {"compiled": compiled, "compile_s": compile_s}, mesh)


# ---- wall clock -------------------------------------------------------------------------------

def execute(compiled, leaves: list, steps: int) -> tuple[float, Any]:
    """(median seconds of `steps` runs, the last run's outputs) on host arrays `leaves`.

    Arguments are copied on the program's input shardings before each run (donated buffers
    are gone after it), outside the timed region.
    """
    import jax

    args, _ = jax.tree_util.tree_unflatten(compiled.in_tree, leaves)
    times, out = [], None
    for _ in range(steps):
        placed = jax.block_until_ready(jax.device_put(args, compiled.input_shardings[0]))
        start = time.perf_counter()
        out = jax.block_until_ready(compiled(*placed))
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _wall(rows: list[dict], model, steps: int) -> None:
    """wall_s of every row with a program: each distinct program timed once (one warm-up)."""
    import jax
    import numpy as np

    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(model.make_args(0))]
    seen: dict[int, float] = {}
    for row in rows:
        compiled = row.get("_compiled")
        if compiled is None:
            continue
        if id(compiled) not in seen:
            execute(compiled, leaves, 1)
            seen[id(compiled)] = execute(compiled, leaves, steps)[0]
        row["wall_s"] = seen[id(compiled)]


# ---- the run ----------------------------------------------------------------------------------

def run(opts: Options, log: Callable[[str], None] | None = None) -> list[dict]:
    """Every row of every (model, mesh, hardware) case; see the module docstring.

    Args:
      opts: models (names of `models.PRESETS[opts.preset]`), meshes, profiles, modes.
      log: called with one line per finished row (None: silent).

    Returns:
      The rows, as written to results.json (plus a private "_compiled" per compiled row).

    Example:
      >>> rows = run(Options(("mlp",), ((4, 2),), ("h100-nvlink",), preset="tiny"))
    """
    import models

    import jaxpar

    rows = []
    for name in opts.models:
        model = models.build(name, opts.preset)
        for shape in opts.meshes:
            mesh, programs = jaxpar.make_mesh(shape), _Programs()
            group = baseline_rows(model, shape, opts, programs, mesh)
            group += [jaxpar_row(model, shape, hw, mode, programs, mesh, objective)
                      for hw in opts.hardware for mode in opts.modes
                      for objective in opts.objectives]
            if opts.wall:
                _wall(group, model, opts.wall_steps)
            for row in group:
                (log or (lambda _: None))(_line(row))
            rows += group
    return rows


def _line(row: dict) -> str:
    head = f"[{row['model']} {row['mesh']} {row['hardware']}] {row['strategy']}"
    if row["status"] != "ok":
        return f"{head}: {row['status']} ({row['reason']})"
    extra = f", search {row['search_s']:.2f} s" if row["kind"] == "jaxpar" else ""
    extra += f", wall {_ms(row['wall_s'])}" if row.get("wall_s") is not None else ""
    return f"{head}: {_ms(row['modeled_step_s'])} (compile {row['compile_s']:.1f} s{extra})"


def public(rows: list[dict]) -> list[dict]:
    """The rows without their private entries (what results.json holds)."""
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]


# ---- per case: jaxpar's best against the best baseline --------------------------------------

def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (model, mesh, hardware): the best jaxpar and baseline rows and their ratio.

    Returns:
      [{"model", "mesh", "hardware", "jaxpar", "jaxpar_s", "baseline", "baseline_s", "ratio",
        "wall_ratio"}]; names/times None where no such row compiled; ratio jaxpar / baseline
        (modeled), wall_ratio the same for wall_s (None without --wall).
    """
    cases: dict[tuple, list[dict]] = {}
    for r in rows:
        cases.setdefault((r["model"], r["mesh"], r["hardware"]), []).append(r)
    return [_case(key, group) for key, group in cases.items()]


def _best(group: list[dict], kind: str, key: str) -> dict | None:
    ok = [r for r in group if r["kind"] == kind and r["status"] == "ok" and r.get(key) is not None]
    return min(ok, key=lambda r: r[key], default=None)


def _case(key: tuple, group: list[dict]) -> dict:
    ours, theirs = _best(group, "jaxpar", "modeled_step_s"), _best(group, "baseline",
                                                                    "modeled_step_s")
    wall_ours, wall_theirs = _best(group, "jaxpar", "wall_s"), _best(group, "baseline", "wall_s")
    return {"model": key[0], "mesh": key[1], "hardware": key[2],
            "jaxpar": ours and ours["strategy"], "jaxpar_s": ours and ours["modeled_step_s"],
            "baseline": theirs and theirs["strategy"],
            "baseline_s": theirs and theirs["modeled_step_s"],
            "ratio": _ratio(ours and ours["modeled_step_s"], theirs and theirs["modeled_step_s"]),
            "wall_ratio": _ratio(wall_ours and wall_ours["wall_s"],
                                 wall_theirs and wall_theirs["wall_s"])}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def failures(summary: list[dict]) -> list[str]:
    """Cases where jaxpar's best row is modeled slower than the best baseline, or has none."""
    out = []
    for c in summary:
        case = f"{c['model']} {c['mesh']} {c['hardware']}"
        if c["jaxpar_s"] is None:
            out.append(f"{case}: no jaxpar plan compiled")
        elif c["baseline_s"] is not None and c["jaxpar_s"] > c["baseline_s"] * (1 + RTOL):
            out.append(f"{case}: {c['jaxpar']} {_ms(c['jaxpar_s'])} is {c['ratio']:.3f}x "
                       f"{c['baseline']} {_ms(c['baseline_s'])}")
    return out


# ---- markdown and plot ------------------------------------------------------------------------

def _ms(s: float | None) -> str:
    return "" if s is None else f"{s * 1e3:.3f} ms"


def _mb(b: float | None) -> str:
    return "" if b is None else f"{b / 1e6:.2f} MB"


def _x(r: float | None) -> str:
    return "" if r is None else f"{r:.4f}"


SUMMARY_HEADER = ["model", "mesh", "hardware", "best jaxpar", "modeled", "best baseline",
                  "modeled", "jaxpar / baseline", "wall ratio"]
ROW_HEADER = ["model", "mesh", "hardware", "strategy", "status", "modeled step", "compute",
              "comm", "HLO comm", "predicted comm", "peak memory", "search", "compile", "wall"]


def _table(header: list[str], lines: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(cells) + " |" for cells in lines]


def _row_cells(r: dict) -> list[str]:
    head = [r["model"], r["mesh"], r["hardware"], r["strategy"]]
    if r["status"] != "ok":
        return head + [f"{r['status']}: {r['reason']}"] + [""] * 9
    search = f"{r['search_s']:.2f} s" if r["kind"] == "jaxpar" else ""
    wall = _ms(r.get("wall_s"))
    return head + ["ok", _ms(r["modeled_step_s"]), _ms(r["compute_s"]), _ms(r["comm_s"]),
                   _mb(r["hlo_comm_bytes"]), _mb(r["predicted_comm_bytes"]),
                   _mb(r["peak_memory_bytes"]), search, f"{r['compile_s']:.1f} s", wall]


def markdown(rows: list[dict], summary: list[dict], command: str = "") -> str:
    """results.md: the per-case summary, failures, then every row."""
    lines = ["# jaxpar vs hand-written layouts", ""]
    if command:
        lines += [f"`{command}`", ""]
    lines += ["Modeled step = compiled flops at the profile's peak + alpha-beta time of the "
              "compiled program's collectives (per device; 8 devices).", ""]
    lines += _table(SUMMARY_HEADER, [[c["model"], c["mesh"], c["hardware"], c["jaxpar"] or "",
                                      _ms(c["jaxpar_s"]), c["baseline"] or "",
                                      _ms(c["baseline_s"]), _x(c["ratio"]), _x(c["wall_ratio"])]
                                     for c in summary])
    bad = failures(summary)
    lines += ["", "jaxpar's best is no slower than the best baseline in every case." if not bad
              else "Cases where jaxpar's best is slower:", *[f"- {f}" for f in bad], ""]
    lines += ["## Every row", ""] + _table(ROW_HEADER, [_row_cells(r) for r in rows])
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], path: Path) -> bool:
    """results.png: per case, jaxpar's best and the best baseline, normalised to the baseline.

    Returns False (and prints why) when matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib, or jaxpar[bench])")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in summary if c["ratio"] is not None]
    labels = [f"{c['model']}\n{c['mesh']}\n{c['hardware']}" for c in cases]
    xs = range(len(cases))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(cases) + 2), 4.5))
    ax.bar([x - 0.2 for x in xs], [1.0] * len(cases), 0.4, label="best baseline")
    ax.bar([x + 0.2 for x in xs], [c["ratio"] for c in cases], 0.4, label="best jaxpar")
    ax.set_xticks(list(xs), labels, fontsize=6)
    ax.set_ylabel("modeled step time / best baseline")
    ax.set_title("jaxpar vs the best hand-written layout (lower is better)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write(rows: list[dict], out: Path, command: str = "") -> list[dict]:
    """results.json, results.md and results.png in `out`; returns the summary."""
    summary = summarize(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(public(rows), indent=1))
    (out / "results.md").write_text(markdown(public(rows), summary, command))
    plot(summary, out / "results.png")
    return summary


# ---- command line -----------------------------------------------------------------------------

def options(a: argparse.Namespace) -> Options:
    """Options from parsed flags; --quick supplies what was not given."""
    import baselines
    import models

    preset = a.sizes or ("small" if a.wall else "quick" if a.quick else "full")
    quick = QUICK if a.quick else {}
    known = list(models.PRESETS[preset])
    names = tuple(a.models or known)
    for n in names:
        if n not in known:
            raise SystemExit(f"--models {n!r}: the {preset} models are {known}.")
    for b in a.baselines or ():
        if b not in baselines.BASELINES:
            raise SystemExit(f"--baselines {b!r}: use some of {list(baselines.BASELINES)}.")
    return Options(names, tuple(a.meshes or quick.get("meshes", MESHES)),
                   tuple(a.hardware or quick.get("hardware", HARDWARE)),
                   tuple(a.modes or quick.get("modes", MODES)), baselines=tuple(a.baselines or ()),
                   preset=preset, wall=a.wall)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and a subset "
                        "(see the module docstring); under 10 minutes on 2 cores")
    parser.add_argument("--wall", action="store_true",
                        help="also run a few steps of each strategy on 8 CPU devices")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--sizes", choices=("full", "quick", "small", "tiny"),
                        help="models.py preset (default full; quick with --quick; small with "
                        "--wall, whose steps run on the CPU)")
    parser.add_argument("--models", nargs="*", help="models of models.py's preset")
    parser.add_argument("--meshes", nargs="*", type=parse_mesh, help="e.g. 8 4x2 2x2x2")
    parser.add_argument("--hardware", nargs="*", help=f"profiles (default {list(HARDWARE)})")
    parser.add_argument("--modes", nargs="*", choices=MODES, help="jaxpar search modes")
    parser.add_argument("--baselines", nargs="*", help="baselines (default: all)")
    a = parser.parse_args(argv)
    if not a.wall:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {COMPILE_ONLY_FLAGS}"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA's rematerialisation warnings
    from jaxpar.demo import ensure_devices

    ensure_devices(8)  # before JAX starts a backend
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    start = time.perf_counter()
    rows = run(options(a), log=lambda line: print(line, flush=True))
    summary = write(rows, a.out, "python benchmarks/run.py " + " ".join(argv or sys.argv[1:]))
    print(f"\n{len(rows)} rows in {time.perf_counter() - start:.0f} s; wrote {a.out}/results.*\n")
    print("\n".join(_table(SUMMARY_HEADER[:-1] if not a.wall else SUMMARY_HEADER, [
        [c["model"], c["mesh"], c["hardware"], c["jaxpar"] or "", _ms(c["jaxpar_s"]),
         c["baseline"] or "", _ms(c["baseline_s"]), _x(c["ratio"])]
        + ([_x(c["wall_ratio"])] if a.wall else []) for c in summary])))
    bad = failures(summary)
    for f in bad:
        print(f"SLOWER: {f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
