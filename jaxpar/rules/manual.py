"""shard_map: a `jax.shard_map` inside the user's function.

Its operands are cut as its in_specs say and its results as its out_specs say, whatever jaxpar
plans around it: its one candidate takes them so (no replicated one beside it: XLA would run the
body in its specs all the same, and gather its results after), and the ops around it then plan
for those specs. Its cost is its body's work (cost/manual.py), not the strategy's. A shard_map
over another mesh's axes, or the same names on other sizes, gets no candidate here (it stays
replicated, as an op without a rule, and what it moves is not priced).
"""

from __future__ import annotations

from jax._src.shard_map import shard_map_p

from jaxpar.cost.manual import on_mesh
from jaxpar.rules.registry import EXCLUSIVE, RULES, OpInfo
from jaxpar.spec import MeshInfo, OpStrategy, Spec


def shard_map_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    if not on_mesh(info.params, mesh):
        return []

    def specs(pspecs, shapes) -> tuple[Spec, ...]:
        return tuple(Spec(tuple(mesh.order(d) for d in Spec.from_pspec(p, len(s)).dims))
                     for p, s in zip(pspecs, shapes, strict=True))
    ins = specs(info.params["in_specs"], info.in_shapes)
    outs = specs(info.params["out_specs"], info.out_shapes)
    return [OpStrategy(ins, outs, tuple(() for _ in outs), "shard_map's specs")]


RULES[shard_map_p] = shard_map_rule
EXCLUSIVE.add(shard_map_p)
