"""A launched script that forgets jaxpar.init(): its make_mesh must refuse to run alone.

Usage (under `jaxpar launch -n 2`): no_init.py
"""

import jaxpar

jaxpar.make_mesh(1)
print("ran alone", flush=True)
