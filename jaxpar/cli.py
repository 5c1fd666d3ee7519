"""The `jaxpar` command line: demo, plan, explain, launch, calibrate (`jaxpar --help`).

Each subcommand is a pair of functions: `_add_NAME(subparsers)` declares its arguments and sets
`run=_run_NAME`, which takes the parsed arguments and returns the exit status. To add one,
write the pair and list `_add_NAME` in SUBCOMMANDS. Bad input (a bad config file, a plan file
that is not one) is one line on stderr and exit status 2, never a traceback.

`jaxpar plan CONFIG --json` prints one JSON object with the keys of PLAN_JSON_KEYS:
  config, model, mode, search_mode, devices, mesh {names, sizes}, hardware, layout,
  cost {compute_s, comm_s, comm_bytes, peak_memory_bytes, total_s} (modeled, per device),
  memory_per_device_bytes (the profile's), collectives {kind: {count, bytes}} (predicted),
  parameters {path: spec}, inputs {path: spec} (the batch), ops {primitive: count},
  plan_s, notes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from typing import Any

PLAN_JSON_KEYS = ("config", "model", "mode", "search_mode", "devices", "mesh", "hardware",
                  "layout", "cost", "memory_per_device_bytes", "collectives", "parameters",
                  "inputs", "ops", "plan_s", "notes")


# ---- demo ---------------------------------------------------------------------------------------

def _add_demo(sub) -> None:
    from jaxpar.auto_parallel import PARALLEL_MODES

    p = sub.add_parser("demo", help="plan, compare, train and check a small GPT on 8 simulated "
                                    "CPU devices",
                       description="Plan a small GPT training step with AutoParallel "
                                   "(dynamic_programming), check its predicted collectives "
                                   "against the compiled program, compare it with data parallel "
                                   "and Megatron, then train it and check the loss against "
                                   "single-device jax.jit. Exit status 1 if they differ.")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="training steps (default 50; 5 with --quick)")
    p.add_argument("--quick", action="store_true", help="a tiny model and few steps")
    p.add_argument("--hardware", default="h100-nvlink", metavar="NAME",
                   help="hardware profile to plan and price for (default h100-nvlink)")
    p.add_argument("--mode", default="dynamic_programming", choices=PARALLEL_MODES,
                   help="AutoParallel's parallel_mode (default dynamic_programming, the exact "
                        "search)")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from jaxpar.demo import run_demo
    return _guard("demo", lambda: run_demo(steps=args.steps, quick=args.quick,
                                           hardware=args.hardware, mode=args.mode))


# ---- plan ---------------------------------------------------------------------------------------

def _add_plan(sub) -> None:
    from jaxpar.run_config import PLAN_MODES

    p = sub.add_parser("plan", help="plan a model from a run config without running it (any "
                                    "device count)",
                       description="Plan the training step a run config (configs/*.yaml) "
                                   "describes, over an abstract mesh: no devices are used and "
                                   "nothing runs, so --devices may exceed this machine's. "
                                   "Prints the plan, memory and modeled time per device.")
    p.add_argument("config", help="run config YAML, e.g. configs/gpt_small_auto_parallel.yaml")
    p.add_argument("--mode", choices=PLAN_MODES, help="planning mode (default: the config's "
                   "parallel_mode / search_mode)")
    p.add_argument("--devices", type=int, metavar="N", help="plan for N devices")
    p.add_argument("--hardware", metavar="NAME", help="hardware profile name or YAML path")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead")
    p.add_argument("--out", metavar="PLAN.json", help="save the plan (for `jaxpar explain`)")
    p.add_argument("--full", action="store_true", help="also print the per-op table")
    p.set_defaults(run=_run_plan)


def _run_plan(args: argparse.Namespace) -> int:
    return _guard("plan", lambda: _plan(args))


def _plan(args: argparse.Namespace) -> int:
    from jaxpar.plan import check_writable
    from jaxpar.run_config import load_run_config, plan_run

    if args.full and args.json:
        raise ValueError("--full prints the per-op table, which --json leaves out; give one of "
                         "them (the JSON's \"ops\" counts the ops; --out saves every row for "
                         "`jaxpar explain`).")
    if args.out is not None:  # "" too: check_writable names it
        check_writable(args.out, "--out")  # before planning, which may take a while
    run = load_run_config(args.config)
    planned = plan_run(run, mode=args.mode, devices=args.devices, hardware=args.hardware)
    if args.out is not None:
        planned.plan.save(args.out)
    if args.json:
        print(json.dumps(plan_summary(planned, args.config), indent=1))
        return 0
    console = make_console()
    _print_planned(console, planned, args.config)
    if args.full:
        console.print(planned.plan.explain(width=console.width), markup=False, highlight=False)
    if args.out:
        console.print(f"saved the plan to {args.out}: jaxpar explain {args.out}", markup=False)
    return 0


def plan_summary(planned, config: str) -> dict[str, Any]:
    """The `jaxpar plan --json` object (keys: PLAN_JSON_KEYS) for a `run_config.PlannedRun`.

    Example:
      >>> plan_summary(plan_run(load_run_config(path)), path)["cost"]["total_s"]
    """
    from dataclasses import asdict

    from jaxpar.cost.hardware import load_profile

    plan, problem = planned.plan, planned.problem
    specs = dict(zip(plan.in_paths, (str(s) for s in plan.flat_in_specs), strict=True))
    owner = dict(zip(problem.paths, problem.owners, strict=True))
    return {"config": config, "model": {"name": planned.model.name, **_model_fields(planned)},
            "mode": planned.mode, "search_mode": plan.search_mode, "devices": plan.mesh.size,
            "mesh": {"names": list(plan.mesh.names), "sizes": list(plan.mesh.sizes)},
            "hardware": planned.hardware, "layout": plan.layout, "cost": asdict(plan.cost),
            "memory_per_device_bytes": load_profile(planned.hardware).memory_bytes,
            "collectives": plan.collectives,
            "parameters": {p: s for p, s in specs.items() if owner.get(p) == 0},
            "inputs": {p: s for p, s in specs.items() if owner.get(p, 0) >= 2},
            "ops": dict(Counter(r.op for r in plan.rows).most_common()),
            "plan_s": planned.seconds, "notes": list(plan.notes)}


def _model_fields(planned) -> dict[str, Any]:
    """The model config's fields as JSON values (dtypes by name)."""
    from dataclasses import fields

    cfg = planned.model.config
    return {f.name: _plain(getattr(cfg, f.name)) for f in fields(cfg)}


def _plain(value: Any) -> Any:
    import numpy as np

    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, int | float | str | bool):
        return value
    try:
        return np.dtype(value).name  # GPTConfig.dtype: jnp.float32, a type
    except TypeError:
        return str(value)


def _describe_model(planned) -> str:
    parts = ", ".join(f"{k} {v}" for k, v in _model_fields(planned).items())
    return f"{planned.model.name} ({parts})"


def _print_planned(console, planned, config: str) -> None:
    from jaxpar.cost.hardware import load_profile

    plan = planned.plan
    console.print(f"[bold]{config}[/bold]: {_describe_model(planned)}", highlight=False)
    console.print(f"mode {planned.mode} (search: {plan.search_mode}) over mesh "
                  f"{plan.mesh.describe()} = {plan.mesh.size} devices, planned only (abstract "
                  f"mesh) in {planned.seconds:.2f} s; hardware {planned.hardware}",
                  markup=False, highlight=False)
    for table in plan_tables(plan, dict(zip(planned.problem.paths, planned.problem.shapes,
                                            strict=True))):
        console.print(table)
    console.print(cost_text(plan, load_profile(planned.hardware).memory_bytes), markup=False,
                  highlight=False)
    for note in plan.notes:
        console.print(note, markup=False, highlight=False)


# ---- plan tables (shared with the demo) ---------------------------------------------------------

def plan_tables(plan, shapes: dict[str, tuple] | None = None, top: int = 10) -> list:
    """A compact view of a Plan as rich Tables: ops by primitive, and the arguments' shardings.

    Args:
      plan: a `jaxpar.Plan`.
      shapes: {argument leaf path: shape} to show beside each sharding (None: leave them out).
      top: primitives to list by modeled cost; the rest are summed on one line.

    Returns:
      [ops table, arguments table]. Layer indices in paths become `*`, and identical rows merge,
      so a 48-layer model's table is as long as a 2-layer one's.

    Example:
      >>> for t in plan_tables(f.plan(x, w)): console.print(t)
    """
    return [_ops_table(plan, top), _args_table(plan, shapes or {})]


def _ops_table(plan, top: int):
    """Ops by kind: how many, how many run cut, how many have no rule, and their modelled
    time (compute and the op's own collectives; the step's time adds the resharding between
    ops; a loop's time holds its body's ops). Not the search's scores, which weigh memory too
    (level, mem_coeff): summed, those read as a time several times the step's."""
    from rich.table import Table

    by_op: dict[str, list] = {}
    for row in plan.rows:
        by_op.setdefault(row.op, []).append(row)
    stats = sorted(((op, len(rows), sum(_cuts(plan, r.path) for r in rows),
                     sum(r.note.startswith("no rule") for r in rows),
                     sum(_time(plan, r.path) for r in rows))
                    for op, rows in by_op.items()), key=lambda s: -s[4])
    layout = f", as {plan.layout}" if plan.layout else ""
    nested = any("." in r.path for r in plan.rows)
    t = Table(title=f"plan: {plan.search_mode} on {plan.mesh.describe()}{layout}",
              caption="ops inside a loop or cond: timed in its row" if nested else None)
    for col in ("op", "count", "sharded", "no rule", "modeled time"):
        t.add_column(col, justify="left" if col == "op" else "right")
    for op, n, cut, norule, cost in stats[:top]:
        t.add_row(op, str(n), str(cut), str(norule or ""), fmt_seconds(cost))
    rest = stats[top:]
    if rest:
        t.add_row(f"{len(rest)} more kinds", str(sum(s[1] for s in rest)),
                  str(sum(s[2] for s in rest)), str(sum(s[3] for s in rest) or ""),
                  fmt_seconds(sum(s[4] for s in rest)))
    return t


def _choice(plan, path: str):
    """The Choice of the op at `path` ("3", or "3.0.5" inside a region)."""
    parts = [int(p) for p in path.split(".")]
    choice = plan.graph_plan.choices[parts[0]]
    for region, op in zip(parts[1::2], parts[2::2], strict=True):
        choice = choice.regions[region].choices[op]
    return choice


def _cuts(plan, path: str) -> bool:
    """Whether the op at `path` runs cut over some axis."""
    strategy = _choice(plan, path).strategy
    return any(d for s in (*strategy.ins, *strategy.outs) for d in s.dims)


def _time(plan, path: str) -> float:
    """The modelled seconds of the top-level op at `path`; 0 for an op inside a loop or cond
    body (its loop's or cond's time holds it, over every trip)."""
    if "." in path:
        return 0.0
    cost = _choice(plan, path).cost
    return cost.compute_s + cost.comm_s


def _args_table(plan, shapes: dict[str, tuple]):
    from rich.table import Table
    from rich.text import Text

    t = Table(title="arguments (optimizer state follows its parameter unless listed)")
    for col in ("argument", "shape", "sharding"):
        t.add_column(col)
    seen = set()
    follows = _follows_param(plan)
    for path, spec in zip(plan.in_paths, plan.flat_in_specs, strict=True):
        if follows.get(path):
            continue
        shape = ("x".join(map(str, shapes[path])) or "()") if path in shapes else ""
        row = (re.sub(r"/\d+(?=/)", "/*", path), shape, str(spec))
        if row not in seen:
            seen.add(row)
            t.add_row(*(Text(c) for c in row))  # Text: "[mp, -]" is not rich markup
    return t


def _follows_param(plan) -> dict[str, bool]:
    """{path: True} for optimizer-state leaves sharded exactly as their parameter."""
    specs = dict(zip(plan.in_paths, plan.flat_in_specs, strict=True))
    params = {p.partition("/")[2]: s for p, s in specs.items() if p.startswith("params/")}
    out = {}
    for path, spec in specs.items():
        if path.startswith("params/"):
            continue
        parts = path.split("/")
        for k in range(1, len(parts)):  # longest parameter suffix first
            if "/".join(parts[k:]) in params:
                out[path] = params["/".join(parts[k:])] == spec
                break
    return out


def cost_text(plan, memory_bytes: float | None = None) -> str:
    """One paragraph: the plan's modeled cost per device and its predicted collectives."""
    c = plan.cost
    of = f" of {fmt_bytes(memory_bytes)}" if memory_bytes else ""
    cols = ", ".join(f"{k} x{v['count']:g} ({fmt_bytes(v['bytes'])})"
                     for k, v in plan.collectives.items()) or "none"
    over = ""
    if memory_bytes and c.peak_memory_bytes > memory_bytes:  # planned without a budget
        over = (f"\nthe peak is over the device's {fmt_bytes(memory_bytes)}: it does not fit; "
                "plan within it with memory_budget: hardware (a run config's parallel block; "
                "memory_budget=\"hardware\" in Python), or over more devices")
    return (f"per device (modeled): compute {fmt_seconds(c.compute_s)}, communication "
            f"{fmt_seconds(c.comm_s)} ({fmt_bytes(c.comm_bytes)}), peak memory "
            f"{fmt_bytes(c.peak_memory_bytes)}{of}; step time {fmt_seconds(c.total_s)}{over}\n"
            f"predicted collectives: {cols}")


def fmt_seconds(s: float) -> str:
    """Seconds with a unit: 0.0123 -> '12.3 ms'."""
    for unit, k in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= k:
            return f"{s / k:.3g} {unit}"
    return f"{s * 1e9:.3g} ns" if s else "0"


def fmt_bytes(b: float) -> str:
    """Bytes with a unit: 2.5e9 -> '2.5 GB'."""
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= k:
            return f"{b / k:.3g} {unit}"
    return f"{b:.0f} B"


# ---- explain ------------------------------------------------------------------------------------

def _add_explain(sub) -> None:
    p = sub.add_parser("explain", help="print a saved plan (jaxpar plan --out, Plan.save)",
                       description="Print a saved plan: one row per op (chosen sharding, "
                                   "runner-up, modeled costs), totals, notes and the search's "
                                   "decisions.")
    p.add_argument("plan", help="a plan JSON file (several plans in one: each in turn)")
    p.add_argument("--width", type=int, default=160, help="table width (default 160)")
    p.add_argument("--no-decisions", action="store_true",
                   help="leave out the search's decision log (recursive_programming)")
    p.set_defaults(run=_run_explain)


def _run_explain(args: argparse.Namespace) -> int:
    from jaxpar.plan import load_plans

    def explain() -> int:
        plans = load_plans(args.plan)  # an AutoParallel strategy file may hold several
        for k, plan in enumerate(plans):
            if len(plans) > 1:
                print(f"{'' if k == 0 else chr(10)}plan {k + 1} of {len(plans)} in this file "
                      "(one per argument signature its program was called with)")
            print(plan.explain(width=args.width, decisions=not args.no_decisions), end="")
        return 0
    return _guard("explain", explain)


# ---- launch and calibrate -----------------------------------------------------------------------

def _add_launch(sub) -> None:
    p = sub.add_parser(
        "launch", help="run a script in N processes joined by jaxpar.init()",
        description="Start N processes of a Python script on this machine. Each one finds its "
                    "rank, the process count and the coordinator in the environment that "
                    "jaxpar.init() reads. If a rank fails, the others are stopped.",
        usage="jaxpar launch -n N [--devices-per-process K] [--port P] [--log-dir DIR] "
              "[--grace S] (script.py | -m module) [args ...]")
    p.add_argument("-n", "--num-processes", type=int, required=True, metavar="N",
                   help="number of processes (ranks)")
    p.add_argument("--devices-per-process", type=int, metavar="K",
                   help="simulated CPU devices per process (default: the platform's count)")
    p.add_argument("--port", type=int, metavar="P",
                   help="coordinator port on 127.0.0.1 (default: a free port)")
    p.add_argument("--log-dir", metavar="DIR",
                   help="write DIR/rank_i.log per rank instead of prefixing stdout lines")
    p.add_argument("--grace", type=float, default=5.0, metavar="S",
                   help="seconds a rank has to exit after SIGTERM (a peer failed) or a "
                        "forwarded SIGINT/SIGTERM before it is killed (default: 5)")
    p.add_argument("-m", dest="module", metavar="module",
                   help="run a module, as python -m (put -- before module arguments that start "
                        "with a dash)")
    p.add_argument("program", nargs=argparse.REMAINDER,
                   help="the script and its arguments (after -m: the module's arguments)")
    p.set_defaults(run=_run_launch, parser=p)


def _run_launch(args: argparse.Namespace) -> int:
    from jaxpar.launch import launch
    rest = args.program[1:] if args.program[:1] == ["--"] else args.program
    program = ["-m", args.module, *rest] if args.module else rest
    try:
        return launch(args.num_processes, program, devices_per_process=args.devices_per_process,
                      port=args.port, log_dir=args.log_dir, grace_s=args.grace)
    except (ValueError, TypeError) as err:
        args.parser.error(str(err))  # prints the usage and the error, exits with status 2


def _add_calibrate(sub) -> None:
    # Its arguments (and --help) belong to jaxpar.calibrate.main: everything after the word
    # reaches it unparsed.
    p = sub.add_parser("calibrate", add_help=False,
                       help="measure this machine's devices and write a hardware profile "
                            "(jaxpar calibrate --help)")
    p.set_defaults(run=_run_calibrate, passthrough=True)


def _run_calibrate(args: argparse.Namespace) -> int:
    from jaxpar.calibrate import main as calibrate
    return calibrate(args.rest)


SUBCOMMANDS = (_add_demo, _add_plan, _add_explain, _add_launch, _add_calibrate)


# ---- shared -------------------------------------------------------------------------------------

def _guard(command: str, body) -> int:
    """Run body(); bad input (ValueError, TypeError, a file that cannot be written) becomes one
    line on stderr and exit status 2. A reader that closed the output early (`| head`) ends it
    quietly, with status 1, as the commands of a shell do."""
    try:
        return body()
    except BrokenPipeError:
        try:  # no second error as Python flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout with no file descriptor (captured)
            pass
        return 1
    except (ValueError, TypeError, OSError) as err:
        print(f"jaxpar {command}: error: {err}", file=sys.stderr)
        return 2


def make_console():
    """A rich Console on stdout; 160 columns wide when stdout is not a terminal."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=160)  # logs and pipes: wide


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxpar", description="Automatic sharding for JAX.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the `jaxpar` command line with argv (default sys.argv[1:]); returns the exit status.

    Example:
      >>> main(["plan", "configs/gpt_small_auto_parallel.yaml", "--devices", "64", "--json"])
      0
    """
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    if args.command is None:  # a usage error, as argparse's own: the help, status 2
        parser.print_help(sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
