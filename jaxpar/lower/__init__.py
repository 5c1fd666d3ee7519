"""Turning a plan into a program: jax.jit shardings plus sharding constraints."""

from jaxpar.lower.jit import build_callable, replay

__all__ = ["build_callable", "replay"]
