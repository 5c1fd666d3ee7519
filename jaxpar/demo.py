"""`jaxpar demo`: the MindSpore reference examples, planned, run and checked on 8 CPU devices.

1. dense_relu with in_strategy ((4, 2), None, None): x (32, 128), w (128, 10), b (10,).
2. The reference's three-block network (dense 32 -> gelu -> dense 32, three times) with block 1
   sharded by in_strategy ((8, 1),) and parameter_plan {'block1/dense2/weight': (8, 1)}.
Each prints its plan table, predicted vs measured collectives, and checks its result against
single-device jax.jit.
"""

from __future__ import annotations

import os
import sys


def ensure_devices(n: int = 8) -> None:
    """Ask XLA for n simulated CPU devices; must run before JAX initialises its backends."""
    flag = f"--xla_force_host_platform_device_count={n}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def dense_relu(x, weight, bias):
    return _relu(x @ weight + bias)


def _relu(x):
    import jax
    return jax.nn.relu(x)


def three_blocks(params, x):
    import jax
    for name in ("block1", "block2", "block3"):
        p = params[name]
        x = x @ p["dense1"]["weight"] + p["dense1"]["bias"]
        x = jax.nn.gelu(x)
        x = x @ p["dense2"]["weight"] + p["dense2"]["bias"]
    return x


def _init_blocks(rng, d: int = 32):
    import jax.numpy as jnp

    def dense():
        return {"weight": jnp.asarray(rng.standard_normal((d, d)) / d ** 0.5, jnp.float32),
                "bias": jnp.asarray(rng.standard_normal(d) * 0.1, jnp.float32)}
    return {b: {"dense1": dense(), "dense2": dense()} for b in ("block1", "block2", "block3")}


def _check(console, title: str, f, args, reference) -> None:
    import jax
    import numpy as np

    plan = f.plan(*args)
    console.print(plan.table())
    compiled = f.lower(*args).compile()
    console.print(str(plan.verify(compiled)), markup=False)
    got, want = f(*args), jax.jit(reference)(*args)
    err = float(np.max(np.abs(np.asarray(got) - np.asarray(want))))
    ok = np.allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    console.print(f"{title}: max |sharded - single device| = {err:.2e} "
                  f"({'matches' if ok else 'MISMATCH'}); output sharding {got.sharding.spec}",
                  markup=False)
    if not ok:
        raise SystemExit(f"{title}: sharded result differs from jax.jit")


def main(argv: list[str] | None = None) -> int:
    ensure_devices(8)
    import numpy as np
    from rich.console import Console

    import jaxpar

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # logs and pipes: wide enough for the plan table
    rng = np.random.default_rng(0)
    mesh = jaxpar.make_mesh(8)
    console.print(f"jaxpar demo on {mesh.devices.size} {mesh.devices.flat[0].platform} devices, "
                  f"mesh {dict(mesh.shape)}")
    x = rng.uniform(0, 1, (32, 128)).astype("float32")
    w = rng.uniform(0, 1, (128, 10)).astype("float32")
    b = rng.uniform(0, 1, (10,)).astype("float32")
    f = jaxpar.shard(dense_relu, in_strategy=((4, 2), None, None), mesh=mesh)
    _check(console, "dense_relu", f, (x, w, b), dense_relu)
    params, h = _init_blocks(rng), rng.standard_normal((64, 32)).astype("float32")
    g = jaxpar.shard(three_blocks, in_strategy=(None, (8, 1)), mesh=mesh,
                     parameter_plan={"block1/dense2/weight": (8, 1)})
    _check(console, "three blocks", g, (params, h), three_blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
