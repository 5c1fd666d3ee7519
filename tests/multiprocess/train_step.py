"""A sharded SGD step of a two-layer MLP over the devices of every process.

Run by tests/test_launch.py as `jaxpar launch -n 2 --devices-per-process 4 train_step.py OUT`:
the mesh (dp=2, tp=4) puts dp across the two processes; the step is called on host (numpy)
values, the same in every process, and a learning rate given as a Python float by keyword; the
batch is cut over dp and w1's contraction dimension over dp too, so the step all-reduces across
processes. Rank 0 writes the losses and the updated weights to OUT (.npz). The test imports
`problem` and `sharded_step` to run the same step in one process with 8 devices.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxpar
from jaxpar.distributed import init

STEPS = 2
IN_STRATEGY = ((2, 4), (4, 1), (2, 1), (2, 1), ())  # w1 (D, H), w2 (H, O), x (B, D), y (B, O),
                                                    # lr ()


def problem() -> tuple:
    """The global weights and batch, the same in every process, and the learning rate."""
    rng = np.random.default_rng(0)
    shapes = [(32, 64), (64, 8), (16, 32), (16, 8)]
    return (*((rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32) for s in shapes), 0.1)


def step(w1, w2, x, y, lr):
    def loss_fn(w1, w2):
        return jnp.mean((jax.nn.relu(x @ w1) @ w2 - y) ** 2)
    loss, (g1, g2) = jax.value_and_grad(loss_fn, argnums=(0, 1))(w1, w2)
    return w1 - lr * g1, w2 - lr * g2, loss


def sharded_step() -> jaxpar.ShardedFunction:
    mesh = jaxpar.make_mesh((2, 4), ("dp", "tp"))
    return jaxpar.shard(step, in_strategy=IN_STRATEGY, mesh=mesh)


def main(out_path: str) -> None:
    info = init()
    f = sharded_step()
    w1, w2, x, y, lr = problem()  # host values: jaxpar fills each process's pieces
    losses = []
    for i in range(STEPS):
        w1, w2, loss = f(w1, w2, x, y, lr=lr)
        losses.append(float(jax.experimental.multihost_utils.process_allgather(loss, tiled=True)))
        print(f"step {i} loss {losses[-1]:.6f} on {info.device_count} devices", flush=True)
    w1, w2 = jax.experimental.multihost_utils.process_allgather((w1, w2), tiled=True)
    if info.process_id == 0:
        np.savez(out_path, losses=np.array(losses), w1=w1, w2=w2,
                 processes=info.num_processes, devices=info.device_count)


if __name__ == "__main__":
    main(sys.argv[1])
