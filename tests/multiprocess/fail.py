"""Rank 1 fails while rank 0 waits for it in a collective; every rank records its pid.

Usage (under `jaxpar launch -n 2`): fail.py MODE PID_DIR, MODE "exit" (os._exit(3)), "kill"
(SIGKILL to itself) or "raise" (an uncaught exception: rank 0's collective then raises too, and
the launcher orders the two by the failure times the ranks write). Without the launcher's
stopping it, rank 0 would wait in the barrier until JAX's heartbeat timeout.
"""

from __future__ import annotations

import os
import signal
import sys

from jax.experimental import multihost_utils

from jaxpar.distributed import init


def main(mode: str, pid_dir: str) -> None:
    info = init()
    with open(os.path.join(pid_dir, f"rank_{info.process_id}.pid"), "w") as f:
        f.write(str(os.getpid()))
    multihost_utils.sync_global_devices("both ranks are up")
    if info.process_id == 1:
        print("rank 1 fails now", flush=True)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "raise":
            raise RuntimeError("rank 1 raises")
        # os._exit, not sys.exit: sys.exit runs JAX's exit-time shutdown of the distributed
        # client, which waits on the coordinator, and on a loaded machine rank 0's barrier
        # then fails first (status 1) and the launch names the wrong rank.
        os._exit(3)
    multihost_utils.sync_global_devices("rank 1 never gets here")
    print("rank 0 passed a barrier without rank 1", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
