"""jaxpar: automatic sharding for JAX, with MindSpore's shard()/AutoParallel API."""

from jaxpar.analysis import collective_stats, estimate_time
from jaxpar.api import ShardedFunction, shard
from jaxpar.mesh import make_mesh
from jaxpar.plan import Plan
from jaxpar.spec import OpStrategy, Spec
from jaxpar.strategy import Layout

__all__ = ["Layout", "OpStrategy", "Plan", "ShardedFunction", "Spec", "collective_stats",
           "estimate_time", "make_mesh", "shard"]
__version__ = "0.1.0"
