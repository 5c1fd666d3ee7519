"""Print what a rank sees (its arguments and launch environment) to stdout, and a line to
stderr; no JAX. Usage: echo.py ARGS..."""

import os
import sys

env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("JAXPAR_")}
print(f"argv={sys.argv[1:]} env={env}")
print(f"rank {env['JAXPAR_PROCESS_ID']} to stderr", file=sys.stderr)
