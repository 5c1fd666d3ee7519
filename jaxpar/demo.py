"""`jaxpar demo`: a small GPT planned, compared, trained and checked on 8 simulated CPU devices.

1. Plan: `AutoParallel(step, "dynamic_programming")` plans a GPT training step (AdamW) with no
   strategy given; the plan's summary (layout, ops by primitive, arguments' shardings, modeled
   cost per device) is printed.
2. Check the prediction: the compiled program's collectives (read from its HLO) beside the
   plan's predicted ones.
3. Compare: data parallel and Megatron tensor parallel (tp2 x dp4), written by hand as
   `jax.jit` shardings, and jaxpar's program, each priced by `jaxpar.estimate_time` from its
   compiled HLO under one hardware profile (step time and communication per device).
4. Train: N steps of the jaxpar program beside single-device `jax.jit` of the same step; the
   losses must agree to rtol 1e-4 (PASS, exit status 0; FAIL, exit status 1).

Before: nothing (the demo makes its model and data). After: the report on stdout; nothing is
written to disk. `dense_relu` and `three_blocks` are MindSpore's reference examples for
`jaxpar.shard`, kept for the README and tests.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import jaxpar
from jaxpar import progress as jaxpar_progress
from jaxpar.analysis import memory_stats
from jaxpar.api import optimizer_followers
from jaxpar.auto_parallel import PARALLEL_MODES
from jaxpar.cli import cost_text, fmt_bytes, fmt_seconds, make_console, plan_tables
from jaxpar.cli import main as cli_main
from jaxpar.cost.hardware import load_profile
from jaxpar.ir import leaf_paths
from jaxpar.models import gpt
from jaxpar.run_config import tensor_parallel_specs

LOSS_RTOL = 1e-4
DEVICES = 8


@dataclass(frozen=True)
class DemoSize:
    """The demo's GPT and training run."""

    layers: int
    d_model: int
    heads: int
    vocab: int
    seq: int
    batch: int
    steps: int


FULL = DemoSize(layers=2, d_model=128, heads=4, vocab=512, seq=64, batch=16, steps=50)
QUICK = DemoSize(layers=1, d_model=32, heads=2, vocab=64, seq=8, batch=16, steps=5)


def ensure_devices(n: int = 8) -> None:
    """Ask XLA for n simulated CPU devices; must run before JAX initialises its backends.
    The demo then builds its meshes from `jax.devices("cpu")`, whatever the default backend.
    A count the environment already sets is left alone (the demo's error names it)."""
    if isinstance(n, bool) or not isinstance(n, int | np.integer):
        raise TypeError(f"ensure_devices(n={n!r}): n is the number of simulated CPU devices, "
                        "an int such as 8.")
    if n < 1:
        raise ValueError(f"ensure_devices(n={n}): ask for one simulated CPU device or more "
                         "(8, say).")
    flag = f"--xla_force_host_platform_device_count={int(n)}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    # The CPU platform must be among JAX's (JAX_PLATFORMS=cuda on a GPU machine leaves it
    # out); JAX read the variable when it was imported, so its config is set too.
    platforms = os.environ.get("JAX_PLATFORMS")
    if platforms is None:
        wanted = "cpu"
    elif platforms and "cpu" not in platforms.split(","):  # "" means every platform
        wanted = f"{platforms},cpu"
    else:
        return
    os.environ["JAX_PLATFORMS"] = wanted
    jax.config.update("jax_platforms", wanted)


def _too_few_devices() -> str:
    """Why JAX has fewer than DEVICES CPU devices: a count in the environment (which
    ensure_devices leaves alone), else a JAX the caller started before ensure_devices ran."""
    fixed = _environment_device_count()
    if fixed is not None and fixed[1] < DEVICES:
        what, count = fixed
        return (f": the environment fixes the CPU device count to {count} ({what}); unset it "
                f"or set it to at least {DEVICES}.")
    return (f". Run it in a fresh process (`jaxpar demo`), which asks XLA for {DEVICES} "
            "simulated CPU devices before JAX starts.")


def _environment_device_count() -> tuple[str, int] | None:
    """The CPU device count the environment sets, as (where, count), or None: JAX_NUM_CPU_DEVICES
    (JAX prefers it; -1 is its default), else XLA_FLAGS's last
    --xla_force_host_platform_device_count (XLA reads the last of a repeated flag)."""
    count = os.environ.get("JAX_NUM_CPU_DEVICES", "").strip()
    if count.isdigit():
        return f"JAX_NUM_CPU_DEVICES={count}", int(count)
    flags = re.findall(r"--xla_force_host_platform_device_count=(\d+)",
                       os.environ.get("XLA_FLAGS", ""))
    if flags:
        return f"XLA_FLAGS's --xla_force_host_platform_device_count={flags[-1]}", int(flags[-1])
    return None


def dense_relu(x, weight, bias):
    """MindSpore's first shard() example: relu(x @ weight + bias)."""
    return jax.nn.relu(x @ weight + bias)


def three_blocks(params, x):
    """MindSpore's three-block network: (dense -> gelu -> dense) three times."""
    for name in ("block1", "block2", "block3"):
        p = params[name]
        x = x @ p["dense1"]["weight"] + p["dense1"]["bias"]
        x = jax.nn.gelu(x)
        x = x @ p["dense2"]["weight"] + p["dense2"]["bias"]
    return x


def run_demo(steps: int | None = None, quick: bool = False, hardware: str = "h100-nvlink",
             mode: str = "dynamic_programming", console=None) -> int:
    """Run the demo (module docstring) and return its exit status.

    Args:
      steps: training steps (default 50; 5 with quick).
      quick: a tiny GPT (1 layer, d_model 32) for tests.
      hardware: the profile the plan and the comparison are priced under.
      mode: AutoParallel's parallel_mode for the plan (default dynamic_programming).
      console: a rich Console to print to (default: stdout).

    Returns:
      0 when the sharded losses match single-device jax.jit (PASS), 1 when not (FAIL).

    Example:
      >>> run_demo(quick=True)
      0
    """
    size = QUICK if quick else FULL
    steps = size.steps if steps is None else steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r}: must be a positive int, e.g. 50.")
    ensure_devices(DEVICES)
    load_profile(hardware)  # an unknown profile fails before any work
    if mode not in PARALLEL_MODES:
        raise ValueError(f"mode={mode!r}: must be one of {list(PARALLEL_MODES)}.")
    start = time.perf_counter()
    console = console or make_console()
    demo = _Demo(size, hardware, mode, console)
    ok = demo.run(steps)
    console.print(f"demo finished in {time.perf_counter() - start:.0f} s", highlight=False)
    return 0 if ok else 1


class _Demo:
    """The demo's state: the model, its data, the planned network and the printed sections."""

    def __init__(self, size: DemoSize, hardware: str, mode: str, console):
        cpus = len(jax.devices("cpu"))
        if cpus < DEVICES:
            raise ValueError(f"the demo needs {DEVICES} CPU devices; JAX has {cpus}"
                             + _too_few_devices())
        self.size, self.hardware, self.mode, self.console = size, hardware, mode, console
        self.cfg = gpt.GPTConfig(layers=size.layers, d_model=size.d_model, heads=size.heads,
                                 vocab=size.vocab, seq=size.seq)
        opt = optax.adamw(1e-3)

        def init(key):
            params = gpt.init_params(self.cfg, key)
            return params, opt.init(params)

        # One compiled init: op-by-op dispatch would compile each op of it separately.
        params, opt_state = jax.jit(init)(jax.random.key(0))
        self.step, _ = gpt.make_train_step(self.cfg, jax.eval_shape(lambda: params), opt)
        self.args = (params, opt_state, *gpt.batch(self.cfg, size.batch))
        names = ("params", "opt_state", "tokens", "targets")
        self.paths = [p for n, a in zip(names, self.args, strict=True) for p in leaf_paths(a, n)]
        self.shapes = [tuple(x.shape) for x in jax.tree_util.tree_leaves(self.args)]

    def run(self, steps: int) -> bool:
        net, plan = self.plan()
        compiled = self.verify(net, plan)
        self.compare(net, plan, compiled)
        return self.train(net, steps)

    # -- 1. plan --------------------------------------------------------------------------------
    def plan(self):
        c, s = self.console, self.size
        c.rule("[bold]jaxpar demo")
        c.print(f"{len(jax.devices('cpu'))} simulated CPU devices; GPT with "
                f"{s.layers} layer(s), d_model {s.d_model}, {s.heads} heads, vocab {s.vocab}, "
                f"seq {s.seq}; batch {s.batch}; AdamW. Priced for {self.hardware}.",
                highlight=False)
        net = jaxpar.AutoParallel(self.step, self.mode, mesh=jaxpar.make_mesh(8, device="CPU"),
                                  hardware=self.hardware)
        t = time.perf_counter()
        plan = net.plan(*self.args)
        c.rule(f"1. the plan: AutoParallel(step, {self.mode!r}), no strategy given")
        c.print(f"planned in {time.perf_counter() - t:.1f} s; logical mesh {plan.layout}",
                highlight=False)
        for table in plan_tables(plan, dict(zip(self.paths, self.shapes, strict=True))):
            c.print(table)
        c.print(cost_text(plan, load_profile(self.hardware).memory_bytes), markup=False,
                highlight=False)
        return net, plan

    # -- 2. predicted vs measured ---------------------------------------------------------------
    def verify(self, net, plan):
        t = time.perf_counter()
        compiled = net.lower(*self.args).compile()
        v = plan.verify(compiled)
        self.console.rule("2. predicted collectives vs the compiled program's (HLO)")
        table = Table(title=f"compiled in {time.perf_counter() - t:.1f} s")
        for col in ("collective", "predicted", "measured"):
            table.add_column(col, justify="left" if col == "collective" else "right")
        for kind in sorted(set(v.predicted) | set(v.measured)):
            p, m = v.predicted.get(kind), v.measured.get(kind)
            table.add_row(kind, *(f"{x['count']:g} x, {fmt_bytes(x['bytes'])}" if x else "-"
                                  for x in (p, m)))
        table.add_row("total bytes", fmt_bytes(v.predicted_bytes), fmt_bytes(v.measured_bytes))
        self.console.print(table)
        verdict = "agree" if v.bytes_ok else "differ"
        self.console.print(f"total bytes {verdict} within {v.rtol:.0%}; output shardings "
                           + ("as planned" if not v.sharding_mismatches else
                              "differ: " + "; ".join(v.sharding_mismatches)), highlight=False)
        return compiled

    # -- 3. against hand-written layouts --------------------------------------------------------
    def compare(self, net, plan, compiled) -> None:
        self.console.rule("3. against hand-written layouts (jax.jit shardings), priced from "
                          "each compiled HLO")
        rows = [(f"jaxpar {self.mode}", plan.layout, net.mesh, compiled)]
        for name, layout, mesh, specs in self._layouts():
            t = time.perf_counter()
            rows.append((name, layout, mesh, self._compile_layout(mesh, specs)))
            self.console.print(f"compiled {name} in {time.perf_counter() - t:.1f} s",
                               highlight=False)
        priced = [(n, lay, jaxpar.estimate_time(c, m, self.hardware), memory_stats(c))
                  for n, lay, m, c in rows]
        best, best_name = min((p[2]["total_s"], p[0]) for p in priced[1:])
        table = Table(title=f"modeled step time per device on {self.hardware}")
        for col in ("strategy", "layout", "compute", "communication", "comm bytes",
                    "step time", "speed vs best hand-written", "peak memory (XLA, CPU)"):
            table.add_column(col, justify="left" if col in ("strategy", "layout") else "right")
        for name, layout, est, mem in priced:
            table.add_row(name, layout, fmt_seconds(est["compute_s"]), fmt_seconds(est["comm_s"]),
                          fmt_bytes(est["comm_bytes"]), fmt_seconds(est["total_s"]),
                          f"{best / est['total_s']:.2f}x", fmt_bytes(mem.get("peak_bytes", 0)))
        self.console.print(table)
        ratio = best / priced[0][2]["total_s"]
        self.console.print(f"jaxpar's program runs at {ratio:.2f}x the modeled speed of the best "
                           f"hand-written layout ({best_name}).", highlight=False)

    def _layouts(self):
        """(name, layout, mesh, {leaf path: PartitionSpec}) of the hand-written baselines."""
        paths = self.paths
        follows = optimizer_followers(paths, self.shapes)
        dp_mesh = jaxpar.make_mesh(8, device="CPU")
        every = tuple(dp_mesh.axis_names)
        data = {p: P(every) if p in ("tokens", "targets") else P() for p in paths}
        tp_mesh = jaxpar.make_mesh((4, 2), ("dp", "tp"), device="CPU")
        tp = tensor_parallel_specs("gpt", [p for p in paths if p.startswith("params/")], "tp")
        tp |= {"tokens": P("dp"), "targets": P("dp")}
        tp |= {paths[i]: tp[paths[j]] for i, j in follows.items()}  # Adam moments follow
        return [("data parallel", "dp8", dp_mesh, data),
                ("Megatron", "dp4 x tp2", tp_mesh, {p: tp.get(p, P()) for p in paths})]

    def _compile_layout(self, mesh, specs: dict):
        """jax.jit of the step with these shardings in and out (loss replicated), compiled."""
        flat = [NamedSharding(mesh, specs[p]) for p in self.paths]
        ins = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(self.args), flat)
        outs = (ins[0], ins[1], NamedSharding(mesh, P()))
        return jax.jit(self.step, in_shardings=ins, out_shardings=outs).lower(
            *self.args).compile()

    # -- 4. train -------------------------------------------------------------------------------
    def train(self, net, steps: int) -> bool:
        self.console.rule(f"4. {steps} training steps: jaxpar beside single-device jax.jit")
        reference = jax.jit(self.step)
        ref_args = jax.device_put(self.args, jax.devices("cpu")[0])
        params, opt_state, *batch = self.args
        ref_params, ref_opt, *ref_batch = ref_args
        got, want = [], []
        # The first step compiles: jaxpar's own progress line would overwrite this bar.
        with self._progress() as progress, jaxpar_progress.quiet():
            task = progress.add_task("training", total=steps, loss=float("nan"),
                                     ref=float("nan"))
            for _ in range(steps):
                params, opt_state, loss = net(params, opt_state, *batch)
                ref_params, ref_opt, ref_loss = reference(ref_params, ref_opt, *ref_batch)
                got.append(float(loss))
                want.append(float(ref_loss))
                progress.update(task, advance=1, loss=got[-1], ref=want[-1])
        ok, worst = losses_match(got, want)
        self.console.print(f"loss {got[0]:.4f} -> {got[-1]:.4f} over {steps} steps "
                           f"(single device {want[0]:.4f} -> {want[-1]:.4f}); largest relative "
                           f"difference {worst:.1e}", highlight=False)
        verdict = "[bold green]PASS" if ok else "[bold red]FAIL"
        self.console.print(f"{verdict}[/]: sharded training loss "
                           f"{'matches' if ok else 'does NOT match'} single-device jax.jit "
                           f"(rtol {LOSS_RTOL:g})")
        return ok

    def _progress(self) -> Progress:
        return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("loss {task.fields[loss]:.4f}"),
                        TextColumn("single device {task.fields[ref]:.4f}"), TimeElapsedColumn(),
                        console=self.console)


def losses_match(got, want, rtol: float = LOSS_RTOL) -> tuple[bool, float]:
    """Whether two loss curves agree to rtol at every step, and their largest relative gap.

    Example:
      >>> losses_match([2.0, 1.0], [2.0, 1.0])
      (True, 0.0)
      >>> losses_match([2.0, 1.0], [2.0, 1.1])[0]
      False
    """
    got_a, want_a = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got_a.shape != want_a.shape or not got_a.size:
        raise ValueError(f"losses_match: {got_a.shape} losses against {want_a.shape}; give "
                         "two equally long, non-empty curves.")
    worst = float(np.max(np.abs(got_a - want_a) / np.abs(want_a)))
    ok = bool(np.allclose(got_a, want_a, rtol=rtol, atol=0)) and bool(np.all(np.isfinite(got_a)))
    return ok, worst


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxpar.demo [--steps N] [--quick]`: the same as `jaxpar demo`."""
    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
