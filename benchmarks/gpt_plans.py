"""GPT training step on 8 devices: automatic plans against hand-written layouts, compiled and timed.

The acceptance benchmark: a GPT training step (Adam; 2 layers, d_model 1024, 16 heads, vocab
8192, batch 16, seq 512 by default) planned by each automatic search mode with no strategy given,
and three hand-written layouts, every one compiled for 8 simulated CPU devices and priced from its
compiled HLO by `jaxpar.analysis.estimate_time` under a hardware profile (h100-nvlink): its flops
at the profile's peak plus the alpha-beta time of its collectives (the profile's `compute_time:
flops`, as the planner prices compute).

Hand-written layouts (params and both Adam moments share one spec per leaf; Adam's step count
and the loss are replicated):
- data_parallel: tokens and targets split 8 ways on the batch; everything else replicated.
  A batch 8 does not divide is split over the leading mesh axes whose sizes it divides (batch
  4: d0 and d1, 4 ways, each piece on two devices) and whole on the rest; likewise in fsdp,
  and over Megatron's dp axis (whole where 4 does not divide it).
- fsdp: batch as above; every parameter and moment split over all 8 devices on its largest
  dimension that 8 divides (replicated when none does).
- megatron_tp2_dp4: mesh (dp=4, tp=2); batch on dp. Megatron-LM's layout: wqkv and w1
  column-parallel (P(None, "tp")) with their biases split alike, wo and w2 row-parallel
  (P("tp", None)) with bo and b2 replicated, wte vocab-parallel (P("tp", None): the embedding
  and the tied output projection, so logits and cross-entropy are vocab-parallel), wpe and the
  layer norms replicated. Unlike Megatron's, this model's fused wqkv is not interleaved per
  head: its columns are [q | k | v], so a column split over tp=2 does not fall on the q/k/v
  boundaries and XLA moves a quarter of q and v between the two tp devices per layer.

Each layout is lowered two ways (`--lowering`): "jit", plain `jax.jit` with the layout as in/out
shardings and XLA's partitioner propagating the rest (what a JAX user writes by hand); and
"jaxpar", `jaxpar.shard` in sharding_propagation mode with every argument leaf fixed, so the
plan also predicts its collectives. Automatic plans run `jaxpar.shard(step, search_mode=mode)`
with in_strategy None on `make_mesh(8)`. Every plan donates params and optimizer state, and
every jaxpar plan (automatic or of a layout) minimises the objective `--level`/`--mem-coeff`
give (jaxpar's defaults: level 0, mem_coeff 0.1). `--devices N` plans the automatic modes on
`make_mesh(N)` instead, and `--mesh 2x8` on `make_mesh((2, 8))` (the baselines are laid out
for 8 devices: pass `--baselines` with no names), on as many simulated CPU devices.

Per plan: plan time, compile time, the compiled program's compute/communication/total time
estimate, the plan's own modelled total, predicted (plan) vs measured (HLO) collective bytes,
and peak memory per device (`compiled.memory_analysis()`). The CPU-compiled HLO is what gets
priced: its flops and collectives are those a GPU build partitions to (its "bytes accessed",
reported as memory time but not added, is larger: XLA's CPU backend fuses less).

Exit status 1 when an automatic plan's estimated time exceeds the best baseline's, a plan's
predicted collective bytes are more than 10% off the measured ones, or a mode fails; a mode this
jaxpar does not have is reported as unavailable and skipped.

    python benchmarks/gpt_plans.py --modes dynamic_programming recursive_programming
    python benchmarks/gpt_plans.py --level 2 --mem-coeff 0     # the fastest plan of each
    python benchmarks/gpt_plans.py --layers 1 --d-model 64 --heads 4 --vocab 128 --seq 16 \
        --batch 8 --modes sharding_propagation
    python benchmarks/gpt_plans.py --devices 16 --baselines --modes recursive_programming
    python benchmarks/gpt_plans.py --mesh 2x8 --baselines --modes recursive_programming
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console
from rich.table import Table

import jaxpar
from jaxpar.analysis import collective_stats, estimate_time, memory_stats
from jaxpar.api import SEARCH_MODES
from jaxpar.demo import ensure_devices
from jaxpar.ir import leaf_paths
from jaxpar.models.gpt import GPTConfig, abstract_train_step

BYTES_RTOL = 0.10
DEFAULT_MODES = ("dynamic_programming", "recursive_programming")
BASELINES = ("data_parallel", "fsdp", "megatron_tp2_dp4")
LOWERINGS = ("jit", "jaxpar")
ALL8 = ("d0", "d1", "d2")  # the axes of jaxpar.make_mesh(8)


@dataclass(frozen=True)
class Config:
    """The GPT step to plan (field names follow GPTConfig; batch is the global batch)."""

    layers: int = 2
    d_model: int = 1024
    heads: int = 16
    vocab: int = 8192
    seq: int = 512
    batch: int = 16
    hardware: str = "h100-nvlink"
    level: int = 0            # jaxpar's objective for its plans (shard's level and mem_coeff;
    mem_coeff: float = 0.1    # level 2 with mem_coeff 0 asks for the fastest step)
    devices: int = 8          # the automatic modes plan on make_mesh(devices),
    mesh: tuple[int, ...] = ()  # or on make_mesh(mesh), of as many devices, where given


# ---- hand-written layouts: (leaf path, shape) -> PartitionSpec --------------------------------

def _leaf(path: str) -> str:
    return path.rsplit("/", 1)[-1]


def _batch(shape: tuple[int, ...], axes: tuple[str, ...], sizes: tuple[int, ...]):
    """tokens' or targets' spec: the batch split over the leading `axes` (of `sizes`) whose
    sizes it divides, together (none: whole)."""
    used, n = [], 1
    for axis, size in zip(axes, sizes, strict=True):
        if shape[0] % (n * size):
            break
        used.append(axis)
        n *= size
    return P(tuple(used) if used else None, None)


def data_parallel(path: str, shape: tuple[int, ...]):
    return _batch(shape, ALL8, (2, 2, 2)) if _leaf(path) in ("tokens", "targets") else P()


def fsdp(path: str, shape: tuple[int, ...]):
    if _leaf(path) in ("tokens", "targets"):
        return _batch(shape, ALL8, (2, 2, 2))
    dims = [d for d in range(len(shape)) if shape[d] % 8 == 0]
    if not dims:
        return P()
    best = max(dims, key=lambda d: (shape[d], -d))  # the largest; the first of equals
    return P(*(ALL8 if d == best else None for d in range(len(shape))))


_MEGATRON = {"wqkv": (None, "tp"), "bqkv": ("tp",), "w1": (None, "tp"), "b1": ("tp",),
             "wo": ("tp", None), "w2": ("tp", None), "wte": ("tp", None)}


def megatron(path: str, shape: tuple[int, ...]):
    if _leaf(path) in ("tokens", "targets"):
        return _batch(shape, ("dp",), (4,))
    return P(*_MEGATRON.get(_leaf(path), ()))


@dataclass(frozen=True)
class Layout:
    name: str
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    spec: Callable[[str, tuple[int, ...]], Any]


LAYOUTS = {"data_parallel": Layout("data_parallel", (2, 2, 2), ALL8, data_parallel),
           "fsdp": Layout("fsdp", (2, 2, 2), ALL8, fsdp),
           "megatron_tp2_dp4": Layout("megatron_tp2_dp4", (4, 2), ("dp", "tp"), megatron)}


# ---- building and measuring one plan ---------------------------------------------------------

def _problem(cfg: Config):
    gpt = GPTConfig(layers=cfg.layers, d_model=cfg.d_model, heads=cfg.heads, vocab=cfg.vocab,
                    seq=cfg.seq)
    return abstract_train_step(gpt, cfg.batch)


def _leaf_specs(layout: Layout, args: tuple) -> list:
    """The layout's spec for every argument leaf, in flattening order."""
    names = ("params", "opt_state", "tokens", "targets")
    paths = [p for n, a in zip(names, args, strict=True) for p in leaf_paths(a, n)]
    leaves = jax.tree_util.tree_leaves(args)
    return [(p, layout.spec(p, tuple(x.shape))) for p, x in zip(paths, leaves, strict=True)]


def _jit_baseline(step, args: tuple, layout: Layout):
    """(mesh, None, compile()) for plain jax.jit with the layout as in and out shardings."""
    mesh = jaxpar.make_mesh(layout.mesh_shape, layout.axis_names)
    flat = [NamedSharding(mesh, s) for _, s in _leaf_specs(layout, args)]
    ins = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(args), flat)
    jitted = jax.jit(step, in_shardings=ins, out_shardings=(ins[0], ins[1], NamedSharding(
        mesh, P())), donate_argnums=(0, 1))
    return mesh, None, lambda: jitted.lower(*args).compile()


def _jaxpar_plan(step, args: tuple, cfg: Config, mode: str, layout: Layout | None):
    """(mesh, plan, compile()) for jaxpar.shard; a layout fixes every argument leaf."""
    if layout is None:
        mesh = jaxpar.make_mesh(cfg.mesh or cfg.devices)
        f = jaxpar.shard(step, mesh=mesh, search_mode=mode, hardware=cfg.hardware,
                         level=cfg.level, mem_coeff=cfg.mem_coeff, donate_argnums=(0, 1))
    else:
        mesh = jaxpar.make_mesh(layout.mesh_shape, layout.axis_names)
        specs = _leaf_specs(layout, args)
        f = jaxpar.shard(step, in_strategy=(None, None, specs[-2][1], specs[-1][1]),
                         parameter_plan=dict(specs[:-2]), mesh=mesh, search_mode=mode,
                         hardware=cfg.hardware, level=cfg.level, mem_coeff=cfg.mem_coeff,
                         donate_argnums=(0, 1))
    return mesh, f.plan(*args), lambda: f.lower(*args).compile()


def measure(name: str, kind: str, lowering: str, cfg: Config, build) -> dict:
    """One row: build the plan (timed; None for plain jit), compile it (timed), price and measure
    the program."""
    row: dict[str, Any] = {"name": name, "kind": kind, "lowering": lowering, "status": "ok"}
    try:
        start = time.perf_counter()
        mesh, plan, compile_ = build()
        row["plan_s"] = None if plan is None else time.perf_counter() - start
        start = time.perf_counter()
        compiled = compile_()
        row["compile_s"] = time.perf_counter() - start
    except Exception as err:  # a failing mode is a result to report, not a crash
        return row | {"status": "error", "error": f"{type(err).__name__}: {err}"[:500]}
    est = estimate_time(compiled, mesh, cfg.hardware)
    measured = collective_stats(compiled)
    row |= {"mesh": est["mesh"], "estimate": {k: est[k] for k in (
        "compute_s", "flop_s", "memory_s", "comm_s", "total_s")},
        "estimate_notes": est["notes"], "measured": measured,
        "measured_bytes": sum(v["bytes"] for v in measured.values()),
        "peak_bytes": memory_stats(compiled).get("peak_bytes")}
    return row | _predicted(plan, row["measured_bytes"])


def _predicted(plan, measured_bytes: float) -> dict:
    """The plan's own figures; ratio = predicted / measured collective bytes."""
    if plan is None:
        return {"predicted": None, "predicted_bytes": None, "bytes_ratio": None,
                "modelled_total_s": None, "predicted_peak_bytes": None, "plan_notes": []}
    predicted = sum(v["bytes"] for v in plan.collectives.values())
    ratio = (predicted / measured_bytes if measured_bytes else
             (1.0 if predicted == 0 else math.inf))
    return {"predicted": plan.collectives, "predicted_bytes": predicted, "bytes_ratio": ratio,
            "modelled_total_s": plan.cost.total_s,
            "predicted_peak_bytes": plan.cost.peak_memory_bytes, "plan_notes": plan.notes}


# ---- the run ---------------------------------------------------------------------------------

def run(cfg: Config, modes: list[str], baselines: list[str], lowerings: list[str],
        out: Path | None) -> dict:
    """Plan, compile and price every requested plan; write JSON and markdown into `out`."""
    if isinstance(cfg.devices, bool) or not isinstance(cfg.devices, int) or cfg.devices < 1:
        raise ValueError(f"--devices {cfg.devices!r}: give a number of simulated CPU devices "
                         "(8, 16).")
    if cfg.mesh and math.prod(cfg.mesh) != cfg.devices:
        raise ValueError(f"--mesh {'x'.join(map(str, cfg.mesh))} has {math.prod(cfg.mesh)} "
                         f"devices and --devices is {cfg.devices}: give one of them, or both "
                         "alike.")
    if cfg.devices != 8 and baselines:
        raise ValueError(f"--devices {cfg.devices} with --baselines {' '.join(baselines)}: the "
                         "hand-written layouts are for 8 devices (2 x 2 x 2, Megatron dp4 x "
                         "tp2); pass --baselines with no names to plan the automatic modes "
                         f"alone on make_mesh({cfg.devices}).")
    ensure_devices(cfg.devices)  # before JAX starts its backends (importing it starts none)
    have = len(jax.devices("cpu"))
    if have < cfg.devices:
        raise ValueError(f"--devices {cfg.devices}: JAX has {have} CPU devices (started "
                         "before this benchmark, or XLA_FLAGS sets the count): run it in a "
                         "fresh process, or set --xla_force_host_platform_device_count="
                         f"{cfg.devices} in XLA_FLAGS.")
    step, args = _problem(cfg)
    rows = []
    for mode in modes:
        if mode not in SEARCH_MODES:
            rows.append({"name": mode, "kind": "automatic", "lowering": f"jaxpar:{mode}",
                         "status": "unavailable",
                         "error": f"this jaxpar has no search mode {mode!r} ({SEARCH_MODES})"})
            continue
        rows.append(measure(mode, "automatic", f"jaxpar:{mode}", cfg,
                            lambda m=mode: _jaxpar_plan(step, args, cfg, m, None)))
    for name in baselines:
        layout = LAYOUTS[name]
        for how in lowerings:
            build = ((lambda lay=layout: _jit_baseline(step, args, lay)) if how == "jit" else
                     (lambda lay=layout: _jaxpar_plan(step, args, cfg, "sharding_propagation",
                                                      lay)))
            lowering = "jit" if how == "jit" else "jaxpar:sharding_propagation"
            rows.append(measure(name, "baseline", lowering, cfg, build))
    result = {"benchmark": "gpt_plans", "config": asdict(cfg), "devices": cfg.devices,
              "jax": jax.__version__, "rows": rows, "failures": failures(rows)}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpt_plans.json").write_text(json.dumps(result, indent=1, default=float))
        (out / "gpt_plans.md").write_text(markdown(result))
    return result


def failures(rows: list[dict]) -> list[str]:
    """What breaks the acceptance: slower automatic plans, bytes mispredicted, failed modes."""
    ok = [r for r in rows if r["status"] == "ok"]
    base = [r for r in ok if r["kind"] == "baseline"]
    best = min(base, key=lambda r: r["estimate"]["total_s"], default=None)
    out = [f"{r['name']} failed: {r['error']}" for r in rows if r["status"] == "error"]
    for r in ok:
        if r["kind"] == "automatic" and best and r["estimate"]["total_s"] > best["estimate"][
                "total_s"]:
            out.append(f"{r['name']} ({_ms(r['estimate']['total_s'])}) is slower than "
                       f"{best['name']} [{best['lowering']}] ({_ms(best['estimate']['total_s'])})")
        if r["bytes_ratio"] is not None and abs(r["bytes_ratio"] - 1) > BYTES_RTOL:
            out.append(f"{r['name']} [{r['lowering']}]: predicted {r['predicted_bytes']:.4g} "
                       f"collective bytes, measured {r['measured_bytes']:.4g} "
                       f"(ratio {r['bytes_ratio']:.3f})")
    return out


def _ms(s: float | None) -> str:
    return "" if s is None else f"{s * 1e3:.3f} ms"


def _mb(b: float | None) -> str:
    return "" if b is None else f"{b / 1e6:.1f} MB"


def _cells(r: dict) -> list[str]:
    if r["status"] != "ok":
        return [r["name"], r["lowering"]] + [""] * (len(HEADER) - 3) + [r["status"]]
    e = r["estimate"]
    ratio = "" if r["bytes_ratio"] is None else f"{r['bytes_ratio']:.3f}"
    plan_s = "" if r["plan_s"] is None else f"{r['plan_s']:.2f} s"
    return [r["name"], r["lowering"], r["mesh"], plan_s,
            f"{r['compile_s']:.2f} s", _ms(e["compute_s"]), _ms(e["comm_s"]), _ms(e["total_s"]),
            _ms(r["modelled_total_s"]), _mb(r["predicted_bytes"]), _mb(r["measured_bytes"]),
            ratio, _mb(r["peak_bytes"]), "ok"]


HEADER = ["plan", "lowering", "mesh", "plan time", "compile", "compute", "comm", "est. total",
          "modelled", "pred. bytes", "meas. bytes", "pred/meas", "peak mem", "status"]


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [f"GPT step: {c['layers']} layers, d_model {c['d_model']}, {c['heads']} heads, "
             f"vocab {c['vocab']}, seq {c['seq']}, batch {c['batch']}; "
             f"{c.get('devices', 8)} devices, "
             f"{c['hardware']}, jax {result['jax']}. Times per step per device.", "",
             "| " + " | ".join(HEADER) + " |", "|---|---|---|" + "---:|" * (len(HEADER) - 4)
             + "---|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in result["rows"]]
    lines += ["", *[f"- {r['name']}: {r['status']}: {r['error']}" for r in result["rows"]
                    if r["status"] != "ok"]]
    lines += ["", "Acceptance: " + ("passed" if not result["failures"] else "FAILED"),
              *[f"- {f}" for f in result["failures"]]]
    return "\n".join(lines) + "\n"


def table(result: dict) -> str:
    t = Table(title="GPT training step plans (estimated from compiled HLO)")
    for col in HEADER:
        t.add_column(col, overflow="fold")
    for r in result["rows"]:
        t.add_row(*_cells(r))
    buf = io.StringIO()
    Console(file=buf, width=200, color_system=None).print(t)
    return buf.getvalue()


def _mesh_shape(text: str) -> tuple[int, ...]:
    """--mesh 2x8 -> (2, 8)."""
    try:
        shape = tuple(int(n) for n in text.split("x"))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give the mesh's axis sizes joined by 'x', "
                                         "all positive (2x8)")
    return shape


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("layers", 2), ("d-model", 1024), ("heads", 16), ("vocab", 8192),
                          ("seq", 512), ("batch", 16)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--hardware", default="h100-nvlink")
    parser.add_argument("--level", type=int, default=0, choices=(0, 1, 2),
                        help="objective of jaxpar's plans (2: speed)")
    parser.add_argument("--mem-coeff", type=float, default=0.1,
                        help="memory weight of jaxpar's plans (0: time only)")
    parser.add_argument("--modes", nargs="*", default=list(DEFAULT_MODES),
                        help="automatic search modes to plan with (in_strategy None)")
    parser.add_argument("--baselines", nargs="*", default=list(BASELINES), choices=BASELINES)
    parser.add_argument("--lowering", nargs="*", default=list(LOWERINGS), choices=LOWERINGS,
                        help="how baselines are built: plain jax.jit and/or jaxpar.shard")
    parser.add_argument("--devices", type=int, default=None,
                        help="plan the automatic modes on make_mesh(DEVICES) (default 8; "
                             "baselines: 8 only)")
    parser.add_argument("--mesh", type=_mesh_shape, default=(),
                        help="plan the automatic modes on make_mesh(MESH), e.g. 2x8")
    parser.add_argument("--out", type=Path, default=Path("results"))
    a = parser.parse_args(argv)
    devices = a.devices if a.devices is not None else (math.prod(a.mesh) if a.mesh else 8)
    cfg = Config(a.layers, a.d_model, a.heads, a.vocab, a.seq, a.batch, a.hardware, a.level,
                 a.mem_coeff, devices, a.mesh)
    result = run(cfg, a.modes, a.baselines, a.lowering, a.out)
    print(table(result))
    for f in result["failures"]:
        print(f"FAIL: {f}")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
