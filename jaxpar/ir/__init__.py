"""Tracing a function to a jaxpr and the op graph jaxpar plans over."""

from jaxpar.ir.graph import Lit, Op, OpGraph, ValueInfo, build_graph
from jaxpar.ir.trace import Traced, arg_paths, leaf_paths, trace

__all__ = ["Lit", "Op", "OpGraph", "Traced", "ValueInfo", "arg_paths", "build_graph", "leaf_paths",
           "trace"]
