"""One rank's save or restore refused before anything is written or read, the other's not.

Usage (under `jaxpar launch -n 2 --devices-per-process 2`): checkpoint_diverge.py DIR. Each
rank catches what its calls raise and prints it, then both meet at a last barrier: a rank
whose call went on alone into orbax's collectives would wait there for the other forever.
"""

import sys
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.train import restore_checkpoint, save_checkpoint

info = jaxpar.init()
root = Path(sys.argv[1])
rank = info.process_id
mesh = jaxpar.make_mesh((4,), ("dp",))
values = np.arange(4096, dtype=np.float32).reshape(64, 64)
state = {"w": jax.make_array_from_callback(values.shape, NamedSharding(mesh, P("dp")),
                                           lambda i: values[i])}


def attempt(what: str, call) -> None:
    try:
        call()
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"{what} refused: {type(err).__name__}: {err}", flush=True)
    else:
        print(f"{what} done", flush=True)


# Rank 1 hands save a leaf it cannot save; rank 0's state is fine.
attempt("save", lambda: save_checkpoint(root, {**state, "name": "x"} if rank else state, step=1))
attempt("save again", lambda: save_checkpoint(root, state, step=1))
# Rank 1 asks for a step that is not there; rank 0 for the one saved.
attempt("restore step", lambda: restore_checkpoint(root, state, step=2 if rank else 1))
# Rank 1's target holds a leaf the checkpoint does not; rank 0's matches it.
attempt("restore target", lambda: restore_checkpoint(
    root, {**state, "extra": state["w"]} if rank else state, step=1))
attempt("restore", lambda: restore_checkpoint(root, state, step=1))
multihost_utils.sync_global_devices("the end")
print("both ranks at the end", flush=True)
