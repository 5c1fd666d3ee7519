"""Plan vs compiled program: predicted and measured collectives, and output shardings."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxpar.analysis import module_collectives, program_module, stats_by_kind
from jaxpar.spec import Spec


@dataclass
class Verification:
    """Result of `Plan.verify`: per-kind figures and any output whose sharding differs."""

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
        lines += [f"output sharding differs: {s}" for s in self.sharding_mismatches]
        return "\n".join(lines)


def verify_plan(plan, compiled, rtol: float = 0.10) -> Verification:
    module = program_module(compiled)  # the program's HLO read once
    if module.num_devices is not None and module.num_devices != plan.mesh.size:
        raise ValueError(f"Plan.verify: the program runs on {module.num_devices} devices but "
                         f"the plan is for mesh {plan.mesh.describe()} ({plan.mesh.size}); "
                         "pass the program compiled from this plan (f.lower(...).compile()).")
    ops = module_collectives(module)
    measured = stats_by_kind(ops)
    mismatches = []
    try:
        shardings = list(compiled.output_shardings)
    except (AttributeError, TypeError):
        shardings = []
    import jax
    for path, spec, sh in zip(plan.out_paths, plan.flat_out_specs, jax.tree_util.tree_leaves(
            shardings), strict=False):
        got = getattr(sh, "spec", None)
        if got is not None and Spec.from_pspec(got, spec.rank) != spec.resolved():
            mismatches.append(f"{path}: planned {spec.to_pspec()}, compiled {got}")
    widened = sum(op.widened * op.count for op in ops)
    return Verification(plan.collectives, measured, mismatches, rtol, widened=widened)

