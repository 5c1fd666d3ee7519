"""Checks the reference models share (their configs and batch builders)."""

from __future__ import annotations

import numbers

# The dtypes a model's parameters and activations may take: a training step differentiates
# them (a run config's model.dtype and GPTConfig.dtype alike).
MODEL_DTYPES = ("float32", "bfloat16", "float16", "float64")


def check_count(fn: str, name: str, value) -> None:
    """A ValueError unless `value` (argument `name` of `fn`) is a positive int: a leading
    dimension (-1 made a ShapeDtypeStruct of shape (-1, ...), 0 an empty batch)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{fn}({name}={value!r}): must be a positive int, e.g. 8.")


def check_flag(fn: str, name: str, value) -> None:
    """A ValueError unless `value` (argument `name` of `fn`) is True or False: 1 or "no" would
    pick a layout by their truth."""
    if not isinstance(value, bool):
        raise ValueError(f"{fn}({name}={value!r}): must be True or False.")
