"""Planning for more devices than the machine has, over a jax.sharding.AbstractMesh."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType

import jaxpar

MESH = AbstractMesh((4, 4, 4), ("d0", "d1", "d2"), axis_types=(AxisType.Auto,) * 3)


def _mlp(w1, w2, x):
    return jnp.tanh(x @ w1) @ w2


ARGS = (jax.ShapeDtypeStruct((256, 1024), jnp.float32),
        jax.ShapeDtypeStruct((1024, 256), jnp.float32),
        jax.ShapeDtypeStruct((512, 256), jnp.float32))


@pytest.mark.parametrize("mode", ["sharding_propagation", "recursive_programming",
                                  "dynamic_programming"])
def test_plans_for_64_devices_on_an_8_device_machine(mode):
    f = jaxpar.shard(_mlp, in_strategy=(None, None, (64, 1)) if mode == "sharding_propagation"
                     else None, mesh=MESH, search_mode=mode)
    plan = f.plan(*ARGS)
    assert plan.mesh.size == 64 > len(jax.devices())
    assert max(s.shards(plan.mesh) for s in plan.in_specs) > 8  # uses the devices it lacks


def test_an_abstract_mesh_plan_cannot_run():
    f = jaxpar.shard(_mlp, mesh=MESH, search_mode="recursive_programming")
    for call in (lambda: f.lower(*ARGS), lambda: f(*(jnp.zeros(a.shape) for a in ARGS))):
        with pytest.raises(ValueError, match="AbstractMesh of 64 devices"):
            call()
