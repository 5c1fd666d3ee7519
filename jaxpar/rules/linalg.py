"""Matrix factorizations and solves (jax.lax.linalg), cut on their batch dims.

cholesky, eigh, qr, svd, lu and triangular_solve work on their operands' last two dims, the
matrix. Every leading dim is a batch of independent problems that the operands and the results
share, so each is a loop: a device solves the problems of its piece, with no communication and
the same numbers. The matrix dims are never cut (each problem needs all of its matrix). XLA's
SPMD partitioner runs these ops on the local batch as they are (checked by
tests/test_rules_linalg.py against jax.jit, values and collectives).

FFTs work on their last `len(fft_lengths)` dims and are cut on the leading ones the same way.
XLA all-gathers an FFT's operand even where only its batch dims are cut (a strict xfail in
tests/test_rules_linalg.py says when that changes), so `fft` is in `registry.LOCAL`: the
lowering binds it per shard in a shard_map, each device transforming its own rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax import lax
from jax._src.lax import linalg

from jaxpar.rules.registry import LOCAL, RULES, Loop, OpInfo, loop_strategies
from jaxpar.spec import MeshInfo, OpStrategy


def _batch_loops(info: OpInfo, core: int) -> list[Loop]:
    """A loop per leading dim of the first operand (all but its last `core` dims) that every
    operand and result has at the same place and size."""
    arrays: Sequence[tuple[int, ...]] = (*info.in_shapes, *info.out_shapes)
    batch = len(info.in_shapes[0]) - core
    loops = []
    for d in range(max(batch, 0)):
        size = info.in_shapes[0][d]
        if all(len(s) > d and s[d] == size for s in arrays):
            loops.append(Loop(size, (d,) * len(info.in_shapes), (d,) * len(info.out_shapes)))
    return loops


def matrix_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    return loop_strategies(info, mesh, _batch_loops(info, 2))


def fft_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    # A real FFT changes the length of the last dim (n <-> n // 2 + 1): only batch dims are
    # shared, and _batch_loops checks every array has them at the same size.
    return loop_strategies(info, mesh, _batch_loops(info, len(info.params["fft_lengths"])))


RULES[lax.fft_p] = fft_rule
LOCAL.add(lax.fft_p)
for _p in (linalg.cholesky_p, linalg.eigh_p, linalg.qr_p, linalg.svd_p, linalg.lu_p,
           linalg.triangular_solve_p):
    RULES[_p] = matrix_rule
