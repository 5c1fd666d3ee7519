"""Plan vs compiled program: predicted and measured collectives, and output shardings."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax

from jaxpar.analysis import module_collectives, program_devices, program_module, stats_by_kind
from jaxpar.spec import Spec


@dataclass
class Verification:
    """Result of `Plan.verify`: per-kind figures and any argument or output whose sharding
    differs from the plan's."""

    predicted: dict[str, dict[str, float]]
    measured: dict[str, dict[str, int]]
    sharding_mismatches: list[str] = field(default_factory=list)
    rtol: float = 0.10
    atol: float = 64.0  # bytes: XLA may reduce a scalar (a loss) once per mesh axis
    widened: float = 0.0  # of the measured bytes, at most this was added by XLA:CPU
                          # moving 16-bit floats as float32 (analysis.CollectiveOp.widened):
                          # GPUs and TPUs move between measured - widened and measured

    @property
    def predicted_bytes(self) -> float:
        return sum(v["bytes"] for v in self.predicted.values())

    @property
    def measured_bytes(self) -> float:
        return sum(v["bytes"] for v in self.measured.values())

    @property
    def bytes_ok(self) -> bool:
        p, m = self.predicted_bytes, self.measured_bytes
        gap = max(m - self.widened - p, p - m, 0.0)  # 0 inside [m - widened, m]
        return gap <= self.rtol * max(p, m) + self.atol

    @property
    def kind_gaps(self) -> dict[str, float]:
        """Measured less predicted bytes of each kind that differs by more than the totals'
        tolerance. `ok` looks at the totals only: XLA may run a move by another kind (an
        all-reduce whose users slice it is a reduce-scatter on a GPU, counted so here); a gap
        here with the totals agreeing says the plan named some of its bytes otherwise."""
        gaps = {}
        for kind in sorted(set(self.predicted) | set(self.measured)):
            p = self.predicted.get(kind, {}).get("bytes", 0.0)
            m = self.measured.get(kind, {}).get("bytes", 0.0)
            if max(m - self.widened - p, p - m, 0.0) > self.rtol * max(p, m) + self.atol:
                gaps[kind] = m - p
        return gaps

    @property
    def ok(self) -> bool:
        return self.bytes_ok and not self.sharding_mismatches

    def __str__(self) -> str:
        kinds = sorted(set(self.predicted) | set(self.measured))
        lines = [f"{'collective':<20}{'predicted':>22}{'measured':>22}"]
        for k in kinds:
            p = self.predicted.get(k, {"count": 0, "bytes": 0})
            m = self.measured.get(k, {"count": 0, "bytes": 0})
            lines.append(f"{k:<20}{p['count']:>8g} x {p['bytes']:>10.0f}B"
                         f"{m['count']:>8g} x {m['bytes']:>10.0f}B")
        total = f"{self.predicted_bytes:>22.0f}{self.measured_bytes:>22.0f}"
        lines.append(f"{'total bytes':<20}{total}")
        if self.widened:
            lines.append(f"{'widened, at most':<20}{'':>22}{self.widened:>22.0f}")
            lines.append("(XLA:CPU moved 16-bit floats as float32: on a GPU or TPU the "
                         "program moves between the total less the widened bytes and the total)")
        gaps = self.kind_gaps
        if gaps and self.bytes_ok:
            lines.append("by kind: the totals agree, the kinds do not ("
                         + ", ".join(f"{k} {g:+.0f}B" for k, g in gaps.items())
                         + " measured less predicted): XLA ran some bytes by another kind")
        lines += [f"sharding differs: {s}" for s in self.sharding_mismatches]
        return "\n".join(lines)


def verify_plan(plan, compiled, rtol: float = 0.10) -> Verification:
    """`plan`'s predicted collectives against those `compiled` (a jax.stages.Compiled or its
    HLO text) runs, and (a Compiled) its arguments' and outputs' shardings against the plan's
    specs. A ValueError when `compiled` is not a program of this plan's: another device count,
    or (a Compiled) other numbers or ranks of arguments or outputs."""
    module = program_module(compiled, "Plan.verify")  # the program's HLO read once
    devices = program_devices(compiled, module)
    typed = not isinstance(compiled, str) and hasattr(compiled, "in_avals")  # a jax Compiled
    if typed and not jax.tree_util.tree_leaves(compiled.input_shardings) and \
            not jax.tree_util.tree_leaves(compiled.out_info):
        devices = None  # reads no argument, returns nothing: JAX runs it on one device
    if devices is not None and devices != plan.mesh.size:
        raise ValueError(f"Plan.verify: the program runs on {devices} device(s) but the plan "
                         f"is for mesh {plan.mesh.describe()} ({plan.mesh.size}); pass the "
                         "program compiled from this plan (f.lower(...).compile()).")
    mismatches = _sharding_mismatches(plan, compiled) if typed else []
    ops = module_collectives(module)
    widened = sum(op.widened * op.count for op in ops)
    return Verification(plan.collectives, stats_by_kind(ops), mismatches, rtol, widened=widened)


def _sharding_mismatches(plan, compiled) -> list[str]:
    """'path: planned P(...), compiled P(...)' for each argument and output of `compiled`
    laid out otherwise than the plan says (leaf by leaf, whatever the pytree: one array, a
    dict, a tuple); a ValueError when its arguments or outputs are not the plan's in number
    and rank. Arguments the program does not read have no sharding in it (XLA drops them):
    then only the outputs are compared."""
    ins = jax.tree_util.tree_leaves(compiled.in_avals)
    outs = jax.tree_util.tree_leaves(compiled.out_info)
    for what, avals, specs, paths in (("arguments", ins, plan.flat_in_specs, plan.in_paths),
                                      ("outputs", outs, plan.flat_out_specs, plan.out_paths)):
        ranks = [len(a.shape) for a in avals]
        if ranks != [s.rank for s in specs]:
            shapes = ", ".join(str(tuple(a.shape)) for a in avals) or "none"
            planned = ", ".join(f"{p} (rank {s.rank})" for p, s in zip(paths, specs,
                                                                         strict=True)) or "none"
            raise ValueError(f"Plan.verify: the compiled program's {what} are of shapes "
                             f"{shapes}; the plan's are {planned}. It is another program: pass "
                             "the one compiled from this plan (f.lower(...).compile()).")
    out = []
    pairs = [(plan.out_paths, plan.flat_out_specs,
              jax.tree_util.tree_leaves(compiled.output_shardings))]
    given = jax.tree_util.tree_leaves(compiled.input_shardings)
    if len(given) == len(ins):
        pairs.insert(0, (plan.in_paths, plan.flat_in_specs, given))
    for paths, specs, shardings in pairs:
        for path, spec, sh in zip(paths, specs, shardings, strict=True):
            got = getattr(sh, "spec", None)
            if got is not None and Spec.from_pspec(got, spec.rank) != spec.resolved():
                out.append(f"{path}: planned {spec.to_pspec()}, compiled {got}")
    return out
