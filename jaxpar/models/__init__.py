"""Small reference programs and models used by the demo, the tests and the benchmarks."""

from jaxpar.models.programs import COMMUNICATING, PROGRAMS

__all__ = ["COMMUNICATING", "PROGRAMS"]
