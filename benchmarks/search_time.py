"""Plan time of each search mode against program size: GPT training steps from 2 to 48 layers.

For each layer count and search mode: trace the GPT training step (Adam; d_model 1024, 16 heads,
vocab 8192, seq 512, batch 16 by default), build jaxpar's op graph, then plan it with
`jaxpar.shard(step, search_mode=mode).plan(*args)` on `make_mesh(8)` under h100-nvlink with no
strategy given. Reported per run: jaxpr equations (top level) and graph ops (region bodies
included), trace and graph-building time (first, cold), the search time (the whole `.plan()`
minus a second, warm trace and graph build: `.plan()` traces again, so what is left is the
strategy parsing, the search (carried state priced and tied within it), and assembling the
Plan), the same in CPU time (`time.process_time`: below the wall clock when the process
waits, equal to it when the machine just runs slow), how the search's wall time splits over
its steps (progress.timed: the steps its progress line shows; a table per mode at the most
layers it planned), the plan's modelled cost (the step's time) and objective (what the
automatic searches minimise: at the default level 0 and mem_coeff 0.1, communication counts
twice and memory is weighed too), and for
dynamic_programming whether the solver proved the plan optimal or stopped at a gap (its note
in `plan.notes`).

Each run is its own process, killed after `--time-limit` seconds ("timeout") and limited to
`--memory-limit` GB of address space ("out of memory"); a mode that ran out of either is not
run on the larger programs ("skipped"). With `--repeat N` each (layers, mode) is run N times,
each in a fresh process, and its row is the run with the least search time (the others'
search times are kept in the JSON): wall times on a shared machine vary by up to 2x. A mode
this jaxpar does not have is recorded as "unavailable". `--memory-budget` plans under
jaxpar.shard's memory_budget (bytes per device, or "hardware"). Writes DIR/search_time.json and
DIR/search_time.md after every run, so a long sweep stopped early keeps what it measured.

    python benchmarks/search_time.py --layers 2 4 8 16 32 48 --time-limit 600 --repeat 3
    python benchmarks/search_time.py --layers 1 2 --d-model 64 --heads 4 --vocab 128 --seq 16 \
        --batch 8 --modes sharding_propagation
    python benchmarks/search_time.py --layers 48 --modes dynamic_programming \
        --memory-budget hardware
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_MODES = ("sharding_propagation", "dynamic_programming", "recursive_programming")
DEFAULT_LAYERS = (2, 4, 8, 16, 32, 48)
_MARK = "SEARCH_TIME_RESULT "  # prefixes the one line a child run prints for its parent
_OOM = ("MemoryError", "Unable to allocate", "bad_alloc", "RESOURCE_EXHAUSTED")


@dataclass(frozen=True)
class Config:
    """The GPT step to plan, less its depth (field names follow GPTConfig)."""

    d_model: int = 1024
    heads: int = 16
    vocab: int = 8192
    seq: int = 512
    batch: int = 16
    hardware: str = "h100-nvlink"
    memory_budget: str | None = None  # jaxpar.shard's: bytes per device, or "hardware"


def plan_once(layers: int, mode: str, cfg: Config) -> dict:
    """Trace, build the graph and plan one GPT step in this process; the figures of one run."""
    from jaxpar.demo import ensure_devices

    ensure_devices(8)
    from search_gap import plan_objective  # beside this file: on the path of the child process

    import jaxpar
    from jaxpar import progress
    from jaxpar.api import AUTOMATIC_MODES
    from jaxpar.ir import build_graph, trace
    from jaxpar.models.gpt import GPTConfig, abstract_train_step

    gpt = GPTConfig(layers=layers, d_model=cfg.d_model, heads=cfg.heads, vocab=cfg.vocab,
                    seq=cfg.seq)
    step, args = abstract_train_step(gpt, cfg.batch)
    start = time.perf_counter()
    traced = trace(step, args)
    trace_s = time.perf_counter() - start
    start = time.perf_counter()
    graph = build_graph(traced.closed_jaxpr, traced.in_paths)
    graph_s = time.perf_counter() - start
    start, cpu = time.perf_counter(), time.process_time()  # again, warm, as `.plan()` will
    build_graph(trace(step, args).closed_jaxpr, traced.in_paths)  # trace and build it
    warm_s, warm_cpu = time.perf_counter() - start, time.process_time() - cpu
    f = jaxpar.shard(step, mesh=jaxpar.make_mesh(8), search_mode=mode, hardware=cfg.hardware,
                     memory_budget=_budget(cfg.memory_budget))
    start, cpu = time.perf_counter(), time.process_time()
    with progress.timed() as timings:
        plan = f.plan(*args)
    plan_s, plan_cpu = time.perf_counter() - start, time.process_time() - cpu
    score = plan_objective(plan, graph, cfg.hardware, f.opts.level, f.opts.mem_coeff,
                           recompute_heavy=mode not in AUTOMATIC_MODES)
    return {"eqns": len(traced.closed_jaxpr.jaxpr.eqns), "ops": sum(1 for _ in graph.walk()),
            "trace_s": trace_s, "graph_s": graph_s, "plan_s": plan_s,
            "search_s": max(plan_s - warm_s, 0.0),
            "search_cpu_s": max(plan_cpu - warm_cpu, 0.0), "cost": plan.cost.total_s,
            "objective": score,
            "comm_bytes": plan.cost.comm_bytes, "notes": plan.notes,
            "steps": _steps(timings, f"searching ({mode})")} | _optimality(plan.notes)


def _budget(given: str | None) -> float | str | None:
    """--memory-budget as jaxpar.shard takes it: "hardware" (the profile's memory per device),
    a number of bytes per device, or None."""
    if given is None or given == "hardware":
        return given
    try:
        return float(given)
    except ValueError:
        raise ValueError(f"--memory-budget {given!r}: bytes per device (a number, e.g. 8e9) or "
                         "'hardware'") from None


def _steps(timings, stage: str) -> list[list]:
    """[[step, seconds, runs]] of the search stage's steps (progress.timed), as they first
    ran: where the search's time goes."""
    path = next((p for p in timings.seconds if p[-1] == stage), None)
    if path is None:
        return []
    return [[name, seconds, timings.runs[path + (name,)]]
            for name, seconds in timings.under(*path).items()]


def _optimality(notes: list[str]) -> dict:
    """{"optimal": bool | None, "gap": float | None} from a dynamic_programming note."""
    for note in notes:
        if note.startswith("dynamic_programming"):
            gap = re.search(r"gap ([\d.]+|inf)%", note)
            return {"optimal": gap is None and "optimal" in note,
                    "gap": float(gap.group(1)) / 100 if gap else 0.0}
    return {"optimal": None, "gap": None}


def run_child(layers: int, mode: str, cfg: Config, time_limit: float,
              memory_gb: float | None = None) -> dict:
    """plan_once in a fresh process, killed after `time_limit` seconds, its address space
    capped at `memory_gb` (None: no cap)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(layers), mode,
           *(a for k, v in asdict(cfg).items() if v is not None
             for a in (f"--{k.replace('_', '-')}", str(v)))]

    def cap() -> None:
        limit = int(memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=time_limit,
                              preexec_fn=cap if memory_gb else None)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"no plan within {time_limit:g} s"}
    wall = time.perf_counter() - start
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(_MARK)]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        oom = any(m in done.stderr for m in _OOM)
        return {"status": "out of memory" if oom else "error", "error": tail[:500],
                "wall_s": wall}
    return {"status": "ok", "wall_s": wall} | json.loads(lines[-1][len(_MARK):])


def run(layers: list[int], modes: list[str], cfg: Config, time_limit: float,
        out: Path | None, memory_gb: float | None = None, repeat: int = 1) -> dict:
    """Every (layers, mode) run `repeat` times (see the module docstring); JSON and markdown
    into `out` after each."""
    if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
        raise ValueError(f"repeat={repeat!r}: how many times each (layers, mode) is planned; "
                         "pass a whole number, 1 or more.")
    import jax

    from jaxpar.api import SEARCH_MODES

    result = {"benchmark": "search_time", "config": asdict(cfg), "time_limit_s": time_limit,
              "memory_limit_gb": memory_gb, "repeat": repeat, "devices": 8,
              "jax": jax.__version__, "rows": []}
    stopped: dict[str, str] = {}
    for n in layers:
        for mode in modes:
            row = {"layers": n, "mode": mode}
            if mode not in SEARCH_MODES:
                row |= {"status": "unavailable", "error": f"no search mode {mode!r} in this "
                        f"jaxpar ({SEARCH_MODES})"}
            elif mode in stopped:
                row |= {"status": "skipped", "error": stopped[mode]}
            else:
                row |= _least(n, mode, cfg, time_limit, memory_gb, repeat)
                if row["status"] in ("timeout", "out of memory"):
                    stopped[mode] = f"{row['status']} at {n} layers"
            result["rows"].append(row)
            _write(result, out)
    return result


def _least(layers: int, mode: str, cfg: Config, time_limit: float, memory_gb: float | None,
           repeat: int) -> dict:
    """The run with the least search time of `repeat` (stopping at the first that fails, which
    is then the answer); with every run's search time, wall and CPU."""
    runs = []
    for _ in range(repeat):
        runs.append(run_child(layers, mode, cfg, time_limit, memory_gb))
        if runs[-1]["status"] != "ok":
            return runs[-1]
    best = min(runs, key=lambda r: r["search_s"])
    return best | {"runs": repeat, "search_s_runs": [r["search_s"] for r in runs],
                   "search_cpu_s_runs": [r["search_cpu_s"] for r in runs]}


def _write(result: dict, out: Path | None) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "search_time.json").write_text(json.dumps(result, indent=1))
        (out / "search_time.md").write_text(markdown(result))


def _s(x: float | None) -> str:
    return "" if x is None else f"{x:.3f} s" if x >= 0.01 else f"{x * 1e3:.2f} ms"


def _cells(r: dict) -> list[str]:
    if r["status"] != "ok":
        return [str(r["layers"]), r["mode"], "", "", "", "", "", "", "", "", f"{r['status']}: "
                f"{r['error']}"]
    opt = "" if r["optimal"] is None else "optimal" if r["optimal"] else f"gap {r['gap']:.1%}"
    return [str(r["layers"]), r["mode"], str(r["eqns"]), str(r["ops"]),
            _s(r["trace_s"] + r["graph_s"]), _s(r["search_s"]), _s(r["search_cpu_s"]),
            _s(r["plan_s"]),
            f"{r['cost'] * 1e3:.3f} ms", f"{r['objective'] * 1e3:.3f} ms", opt or "ok"]


HEADER = ["layers", "mode", "eqns", "ops", "trace+graph", "search", "search CPU", "plan()",
          "modelled cost", "objective", "status"]


def markdown(result: dict) -> str:
    c = result["config"]
    budget = "" if c.get("memory_budget") is None else f", memory_budget {c['memory_budget']}"
    lines = [f"GPT step, d_model {c['d_model']}, {c['heads']} heads, vocab {c['vocab']}, seq "
             f"{c['seq']}, batch {c['batch']}; 8 devices, {c['hardware']}{budget}; limits per run "
             f"{result['time_limit_s']:g} s, {result['memory_limit_gb'] or 'no'} GB; "
             f"each row the least search time of {result.get('repeat', 1)} run(s); "
             f"jax {result['jax']}.", "",
             "| " + " | ".join(HEADER) + " |", "|---:|---|" + "---:|" * 8 + "---|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in result["rows"]]
    for mode in dict.fromkeys(r["mode"] for r in result["rows"]):
        ran = [r for r in result["rows"] if r["mode"] == mode and r["status"] == "ok"
               and r.get("steps")]
        if not ran:
            continue
        r = max(ran, key=lambda r: r["layers"])
        lines += ["", f"Where {mode}'s search time goes at {r['layers']} layers (that row's "
                  f"run; a step's time includes the exact searches inside it):", "",
                  "| step | time | runs | share of the search |", "|---|---:|---:|---:|"]
        lines += [f"| {name} | {_s(t)} | {n} | {t / r['search_s']:.0%} |"
                  for name, t, n in r["steps"]]
    return "\n".join(lines) + "\n"


def _default_memory_gb() -> float:
    return round(0.6 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=list(DEFAULT_LAYERS))
    parser.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES))
    parser.add_argument("--time-limit", type=float, default=600.0,
                        help="seconds one (layers, mode) run may take, tracing included")
    parser.add_argument("--memory-limit", type=float, default=_default_memory_gb(),
                        help="GB of address space one run may use (0: no limit; default 60%% "
                        "of this machine's memory)")
    for flag, default in (("d-model", 1024), ("heads", 16), ("vocab", 8192), ("seq", 512),
                          ("batch", 16)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per (layers, mode), each its own process; the row is the one "
                        "with the least search time")
    parser.add_argument("--hardware", default="h100-nvlink")
    parser.add_argument("--memory-budget", default=None,
                        help="jaxpar.shard's memory_budget: bytes per device, or 'hardware' "
                        "(default: none)")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--child", nargs=2, metavar=("LAYERS", "MODE"), help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.repeat < 1:
        parser.error(f"--repeat {a.repeat}: runs per (layers, mode); pass 1 or more")
    cfg = Config(a.d_model, a.heads, a.vocab, a.seq, a.batch, a.hardware, a.memory_budget)
    try:
        _budget(cfg.memory_budget)
    except ValueError as err:
        parser.error(str(err))
    if a.child:
        print(_MARK + json.dumps(plan_once(int(a.child[0]), a.child[1], cfg)))
        return 0
    result = run(a.layers, a.modes, cfg, a.time_limit, a.out, a.memory_limit or None, a.repeat)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
