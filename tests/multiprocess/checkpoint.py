"""Save a state sharded across both ranks, restore it, then damage one byte and restore again.

Usage (under `jaxpar launch -n 2 --devices-per-process 2`): checkpoint.py DIR. Each rank prints
what its restores gave; rank 0 flips a byte of the largest data file between the two restores.
Each rank verifies a share of the files, so one of them finds the damage and the other is told.
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
mesh = jaxpar.make_mesh((4,), ("dp",))
values = np.arange(4096, dtype=np.float32).reshape(64, 64)
sharding = NamedSharding(mesh, P("dp"))
state = {"w": jax.make_array_from_callback(values.shape, sharding, lambda i: values[i])}
save_checkpoint(root, state, step=1)
print("checksums", (root / "1" / "_CHECKSUMS.json").is_file(), flush=True)
back = restore_checkpoint(root, state, step=1)
print("restored equal", bool(np.array_equal(
    multihost_utils.process_allgather(back["w"], tiled=True), values)), flush=True)
# Shapes alone, with no mesh: each rank's own default device (it was process 0's, which rank 1
# cannot place onto: "the data files may be missing or damaged").
whole = restore_checkpoint(root, {"w": jax.ShapeDtypeStruct(values.shape, values.dtype)},
                           step=1)["w"]
print("restored whole here", whole.sharding.device_set == {jax.local_devices()[0]} and
      bool(np.array_equal(np.asarray(whole), values)), flush=True)
multihost_utils.sync_global_devices("restored once")
if info.process_id == 0:
    data = max((p for p in (root / "1").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
multihost_utils.sync_global_devices("damaged")
try:
    restore_checkpoint(root, state, step=1)
except ValueError as err:  # each rank checks a share of the files: one finds the damage
    found = "names the file" if "has crc32" in str(err) else \
        "names the rank that found it" if "checked by process(es)" in str(err) else str(err)
    print("refused:", found, flush=True)
else:
    print("restored the damaged checkpoint", flush=True)
