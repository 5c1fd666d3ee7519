"""Every test runs on 8 simulated CPU devices, with XLA's CPU backend compiling quickly.

Most of the suite's time is XLA compiling small programs (a rule's check compiles each of its
candidates: test_ragged_dot compiles 81). The two flags below skip LLVM's optimisation and use
the older fusion emitters: a small sharded matmul compiles in about 0.03 s instead of 0.1 s.
Neither touches the HLO passes (SPMD partitioning, collectives, buffer assignment) the tests
check; numbers still match unsharded jit, compiled the same way. A flag given in XLA_FLAGS
before the tests start wins (XLA reads the last of a repeated flag).
"""

import os

_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = " ".join((
    _FAST_COMPILE, os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8",
)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
