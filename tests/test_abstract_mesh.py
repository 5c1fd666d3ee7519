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
    # In three axes, as `jaxpar plan --devices 64` lays them out: over abstract_mesh(64)'s six
    # axes of 2, dynamic_programming took 106 s to price tanh(x @ w) of (16, 32) @ (32, 64).
    assert net.mesh.axis_sizes == (4, 4, 4) and net.mesh.axis_names == ("d0", "d1", "d2")
    assert net.plan(*ARGS).mesh.size == 64
    with pytest.raises(ValueError, match="AbstractMesh of 64 devices"):
        net(*(jnp.zeros(a.shape) for a in ARGS))


def test_shard_under_a_context_of_64_devices_plans_over_three_axes():
    jaxpar.set_auto_parallel_context(device_num=64, parallel_mode="auto_parallel",
                                      search_mode="dynamic_programming")
    try:
        f = jaxpar.shard(lambda x, w: jnp.tanh(x @ w))
    finally:
        jaxpar.reset_auto_parallel_context()
    plan = f.plan(jax.ShapeDtypeStruct((16, 32), jnp.float32),
                  jax.ShapeDtypeStruct((32, 64), jnp.float32))
    assert plan.mesh.size == 64 and len(plan.mesh.names) == 3
    assert plan.notes[0].startswith("dynamic_programming: optimal")
