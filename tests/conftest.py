"""Every test runs on 8 simulated CPU devices, with XLA's CPU backend compiling quickly.

Most of the suite's time is XLA compiling small programs (a rule's check compiles each of its
candidates: test_ragged_dot compiles 81). The two flags below skip LLVM's optimisation and use
the older fusion emitters: a small sharded matmul compiles in about 0.03 s instead of 0.1 s,
and the suite (pytest -n 2, 2 cores) took 10m16s instead of 17m43s. Neither touches the HLO
passes (SPMD partitioning, collectives, buffer assignment) the tests check; numbers still match
unsharded jit, compiled the same way. XLA aborts on a flag it does not know, and fusion
emitters are a transition, so the flags are given only to the jaxlib they were checked on
(0.10); another runs the suite with XLA's defaults, slower. A flag given in XLA_FLAGS before
the tests start wins (XLA reads the last of a repeated flag).
"""

import os
from importlib.metadata import version

_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
_FAST_COMPILE_JAXLIB = "0.10."  # the jaxlib releases that know those flags (checked: 0.10.2)

fast = _FAST_COMPILE if version("jaxlib").startswith(_FAST_COMPILE_JAXLIB) else ""
os.environ["XLA_FLAGS"] = " ".join((
    fast, os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
