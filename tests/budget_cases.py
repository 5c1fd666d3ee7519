"""Programs the memory-budget tests of several modes share."""

import re

import jax
import jax.numpy as jnp
import pytest

import jaxpar


def sgd_mlp_and_its_least_peak():
    """(step, args, least): a plain-SGD MLP step (widths 32-64-16, batch 32) and the least peak
    any plan of it can have, bytes per device on 8 devices, as dynamic_programming's refusal of
    a 1-byte budget states it."""
    from jaxpar.models import mlp

    params = mlp.init_mlp(jax.random.key(0), [32, 64, 16])
    args = (params, jnp.ones((32, 32)), jnp.ones((32, 16)))
    step = mlp.make_sgd_step(0.1)
    with pytest.raises(ValueError, match="smallest possible peak is") as err:
        jaxpar.shard(step, search_mode="dynamic_programming", memory_budget=1).plan(*args)
    return step, args, float(re.search(r"smallest possible peak is ([\d.e+]+)",
                                       str(err.value))[1])
