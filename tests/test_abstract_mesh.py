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
    assert max(s.shards(plan.mesh) for s in plan.flat_in_specs) > 8  # uses the devices it lacks


def test_an_abstract_mesh_plan_cannot_run():
    f = jaxpar.shard(_mlp, mesh=MESH, search_mode="recursive_programming")
    for call in (lambda: f.lower(*ARGS), lambda: f(*(jnp.zeros(a.shape) for a in ARGS))):
        with pytest.raises(ValueError, match="AbstractMesh of 64 devices"):
            call()


def test_a_context_device_num_above_the_machine_plans_for_that_cluster():
    # ParallelContext's device_num "may exceed the devices of this machine (a plan for a larger
    # cluster)"; AutoParallel then asked make_mesh for 64 devices and stopped on XLA_FLAGS.
    jaxpar.set_auto_parallel_context(device_num=64)
    try:
        net = jaxpar.AutoParallel(_mlp, "recursive_programming")
    finally:
        jaxpar.reset_auto_parallel_context()
    assert net.mesh.size == 64 and net.mesh.axis_names == tuple(f"d{k}" for k in range(6))
    assert net.plan(*ARGS).mesh.size == 64
    with pytest.raises(ValueError, match="AbstractMesh of 64 devices"):
        net(*(jnp.zeros(a.shape) for a in ARGS))
