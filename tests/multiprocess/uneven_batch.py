"""Each rank passes shard_batch a local batch of its own size: rank 0 four rows, rank 1 three
(an epoch's last batch split unevenly). shard_batch must refuse it in both ranks, naming the
shapes, before any step runs; rank 0 prints the error and exits 0 so the test reads it.
Then each passes back a global array shard_batch made, which it must refuse naming it (it
failed inside JAX fetching other processes' data). Then rank 1 alone passes what is no array:
both must refuse it, and go on to place the next batch alike.

Usage (under `jaxpar launch -n 2 --devices-per-process 2`): uneven_batch.py
"""

import numpy as np

import jaxpar
from jaxpar.train import shard_batch

info = jaxpar.init()
mesh = jaxpar.make_mesh(4)
x, y = shard_batch((np.ones((4, 3), np.float32), np.ones(4, np.int32)), mesh)  # the same: fine
print(f"even batch {x.shape} {y.shape}", flush=True)
rows = 4 if info.process_id == 0 else 3
try:
    shard_batch((np.ones((rows, 3), np.float32), np.ones(rows, np.int32)), mesh)
except ValueError as err:
    print(f"refused: {err}", flush=True)
else:
    print("placed", flush=True)
try:
    shard_batch(x, mesh)
except TypeError as err:
    print(f"global refused: {err}", flush=True)
else:
    print("global placed", flush=True)
# Rank 1 alone passes what is no array: both refuse, and the next batch places in both (rank
# 0 waited for rank 1 in the shapes' all-gather, which rank 1's next call then joined).
try:
    shard_batch(("rows" if info.process_id else np.ones((4, 3), np.float32),), mesh)
except (TypeError, ValueError) as err:
    print(f"one refused: {type(err).__name__}: {err}", flush=True)
else:
    print("one placed", flush=True)
x, = shard_batch((np.ones((4, 3), np.float32),), mesh)
print(f"next batch {x.shape}", flush=True)
