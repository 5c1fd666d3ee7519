"""A rank that writes its pid to PID_DIR/rank_i.pid, says "ready" and sleeps; no JAX.

Usage: sleep.py PID_DIR [stubborn | exit3-on-rank1]. "stubborn": ignore SIGINT and SIGTERM, so
only SIGKILL ends it. "exit3-on-rank1": rank 1 exits with status 3 instead of sleeping.
"""

import os
import signal
import sys
import time

rank = int(os.environ["JAXPAR_PROCESS_ID"])
with open(os.path.join(sys.argv[1], f"rank_{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
modes = sys.argv[2:]
if "stubborn" in modes:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
if "exit3-on-rank1" in modes and rank == 1:
    sys.exit(3)
time.sleep(120)
