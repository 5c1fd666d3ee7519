"""Loading benchmarks/*.py in the tests: the benchmarks are scripts, not a package."""

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/<name>.py as the module `bench_<name>`, registered in sys.modules (the
    dataclasses it defines look their module up there)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
