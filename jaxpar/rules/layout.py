"""sharding_constraint: the user's own `with_sharding_constraint` inside the function.

The op keeps the spec the user wrote, as its one candidate, so jaxpar plans around it instead of
overriding it: XLA keeps it whatever the plan says, so no replicated candidate is offered beside
it (registry.EXCLUSIVE; one was chosen where gathering looked cheaper than the user's layout,
and the resharding into and out of that layout went unpredicted). A constraint on another
mesh's axes (or not a NamedSharding) is left replicated.
"""

from __future__ import annotations

from jax._src import pjit
from jax.sharding import NamedSharding

from jaxpar.rules.registry import EXCLUSIVE, RULES, OpInfo
from jaxpar.spec import MeshInfo, OpStrategy, Spec


def sharding_constraint_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    sharding = info.params.get("sharding")
    if not isinstance(sharding, NamedSharding):
        return []
    (shape,) = info.in_shapes
    spec = Spec.from_pspec(sharding.spec, len(shape))
    if not set(spec.axes()) <= set(mesh.names):  # another mesh's axes (or a search's own
        return []                                 # one-axis mesh): no candidate here
    spec = Spec(tuple(mesh.order(d) for d in spec.dims))
    if not spec.fits(shape, mesh):
        return []
    return [OpStrategy((spec,), (spec,), ((),), "user constraint")]


RULES[pjit.sharding_constraint_p] = sharding_constraint_rule
EXCLUSIVE.add(pjit.sharding_constraint_p)
