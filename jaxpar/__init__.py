"""jaxpar: automatic sharding for JAX, with MindSpore's shard()/AutoParallel API."""

from jaxpar.analysis import collective_stats, estimate_time
from jaxpar.api import ShardedFunction, shard
from jaxpar.auto_parallel import AutoParallel
from jaxpar.context import (
    ParallelContext,
    current_context,
    get_auto_parallel_context,
    load_config,
    reset_auto_parallel_context,
    save_config,
    set_auto_parallel_context,
)
from jaxpar.distributed import ProcessInfo, init
from jaxpar.mesh import make_hybrid_mesh, make_mesh
from jaxpar.plan import Plan
from jaxpar.spec import OpStrategy, Spec
from jaxpar.strategy import Layout
from jaxpar.train import (
    checkpoint_steps,
    latest_step,
    make_train_step,
    restore_checkpoint,
    save_checkpoint,
    shard_batch,
)

__all__ = ["AutoParallel", "Layout", "OpStrategy", "ParallelContext", "Plan", "ProcessInfo",
           "ShardedFunction", "Spec", "checkpoint_steps", "collective_stats", "current_context",
           "estimate_time", "get_auto_parallel_context", "init", "latest_step", "load_config",
           "make_hybrid_mesh", "make_mesh", "make_train_step",
           "reset_auto_parallel_context", "restore_checkpoint", "save_checkpoint",
           "save_config", "set_auto_parallel_context", "shard", "shard_batch"]
__version__ = "0.1.0"
