"""The process-wide parallel context: MindSpore's set/get/reset_auto_parallel_context.

Before: keyword values from a user, or a YAML file (jaxpar's own keys, or a MindFormers file with
`use_parallel`, `parallel:` and `parallel_config:` blocks). After: a frozen `ParallelContext`
whose every field holds a checked, normalised value (sequences as tuples, dicts completed), and
one module-level current context that `set_auto_parallel_context` replaces all-or-nothing.

A bad value never gets in: `ParallelContext(...)` raises `TypeError` for a wrong type and
`ValueError` for a wrong value, naming the key, the value and what would work. Nothing here
touches jax devices, so `device_num` may exceed the devices of this machine (a plan for a larger
cluster). YAML keys map one to one onto the fields; `load_config` translates MindFormers' forms
(integer `parallel_mode`, `pipeline_stage`, `mem_coeff` under `parallel_config:`).
"""

from __future__ import annotations

import copy
import difflib
import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any

import yaml

MAX_DEVICES = 4096  # MindSpore: device_num in [1, 4096], global_rank in [0, 4095]
PARALLEL_MODES = ("stand_alone", "data_parallel", "hybrid_parallel", "semi_auto_parallel",
                  "auto_parallel")
SEARCH_MODES = ("recursive_programming", "dynamic_programming", "sharding_propagation")
DATASET_STRATEGIES = ("data_parallel", "full_batch")
PARALLEL_OPTIMIZER_DEFAULTS = {
    "gradient_accumulation_shard": True,   # shard accumulated gradients over data parallel
    "parallel_optimizer_threshold": 64,    # KB: smaller parameters are not sharded
    "optimizer_weight_shard_size": -1,     # -1: the whole data parallel group
}
COMM_FUSION_MODES = {"allreduce": ("auto", "size", "index"), "allgather": ("auto", "size"),
                     "reducescatter": ("auto", "size")}
MINDFORMERS_INT_KEYS = ("data_parallel", "model_parallel", "context_parallel", "expert_parallel",
                        "micro_batch_num", "gradient_aggregation_group", "seq_split_num")
MINDFORMERS_BOOL_KEYS = ("vocab_emb_dp", "use_seq_parallel", "auto_pipeline")
MINDFORMERS_PARALLEL_MODES = {0: "data_parallel", 1: "semi_auto_parallel", 2: "auto_parallel",
                              3: "hybrid_parallel"}  # MindFormers' build_context table


@dataclass(frozen=True)
class ParallelContext:
    """MindSpore's auto-parallel context, one field per `set_auto_parallel_context` key.

    Every value is checked on construction (see the module docstring); `dataclasses.replace`
    checks again, so a ParallelContext never holds a bad value.

    Example:
      >>> ctx = ParallelContext(parallel_mode="auto_parallel", device_num=8)
      >>> ctx.search_mode
      'recursive_programming'
    """

    # Devices to plan for, an int in [1, 4096]; None: all devices jax sees (MindSpore: 1).
    device_num: int | None = None
    # This process's global rank, in [0, 4095].
    global_rank: int = 0
    # Divide all-reduced gradients by the number of devices (a mean, not a sum). Recorded for
    # MindSpore configs; jaxpar's programs see the global batch, so a mean loss's gradients are
    # means already (make_train_step(gradients_mean=False) sums the replicas' instead).
    gradients_mean: bool = False
    # All-reduce gradients in float32 even when they are half precision.
    gradient_fp32_sync: bool = True
    # stand_alone | data_parallel | hybrid_parallel | semi_auto_parallel | auto_parallel.
    parallel_mode: str = "stand_alone"
    # How auto_parallel picks strategies: recursive_programming (SAPP, MindSpore >= 2.3's
    # default; older docs say dynamic_programming), dynamic_programming, sharding_propagation.
    search_mode: str = "recursive_programming"
    # Strategy checkpoint to load: "" (none) or a path ending in .json (a relative one is
    # made absolute when set, against the working directory then).
    strategy_ckpt_load_file: str = ""
    # Where to save the strategy checkpoint: "" (don't) or a path ending in .json (likewise).
    strategy_ckpt_save_file: str = ""
    # Every device loads the whole batch: MindSpore's older name for
    # dataset_strategy="full_batch". The two keys are kept in step (setting one sets the
    # other, as in MindSpore); given together they must agree.
    full_batch: bool = False
    # How inputs are split: "data_parallel", "full_batch", or one tuple of split counts per input.
    dataset_strategy: str | tuple[tuple[int, ...], ...] = "data_parallel"
    # Shard the optimizer's update (and state) over the data parallel devices.
    enable_parallel_optimizer: bool = False
    # gradient_accumulation_shard (bool), parallel_optimizer_threshold (KB >= 0),
    # optimizer_weight_shard_size (-1 or > 1); missing keys take PARALLEL_OPTIMIZER_DEFAULTS.
    parallel_optimizer_config: dict[str, Any] = field(
        default_factory=lambda: dict(PARALLEL_OPTIMIZER_DEFAULTS))
    # MindSpore's switch for all-to-all collectives (else all-gather + split + concat). Read
    # from configs but without effect: XLA's partitioner emits the all-to-alls jaxpar prices.
    enable_alltoall: bool = False
    # Gradient indices that split all-reduce fusion groups, strictly increasing; () = no fusion.
    # Checked and kept for MindSpore configs, without effect: XLA's combiner fuses collectives.
    all_reduce_fusion_config: tuple[int, ...] = ()
    # Number of pipeline stages the devices are divided into.
    pipeline_stages: int = 1
    # Gradient accumulation steps per optimizer update.
    grad_accumulation_step: int = 1
    # {"allreduce"|"allgather"|"reducescatter": {"mode": "auto"|"size"|"index", "config": ...}},
    # and "openstate": a bool (fusion on or off); auto: config None (64 MB threshold); size:
    # MB > 0; index (allreduce only): indices.
    # Checked and kept for MindSpore configs, without effect: XLA's combiner fuses collectives.
    comm_fusion: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Weight of per-device memory against time in the search (MindFormers' default 0.1).
    mem_coeff: float = 0.1
    # Bytes per device a plan must fit in, "hardware" (the profile's memory), or None.
    memory_budget: int | float | str | None = None
    # Hardware profile name (configs/hardware/*.yaml) or YAML path; None: the cpu profile.
    hardware: str | None = None
    # MindFormers' parallel_config block (data_parallel, model_parallel, micro_batch_num, ...),
    # kept as given for the features that read it.
    parallel_config: dict[str, Any] = field(default_factory=dict)
    # Broadcast data-parallel parameters from rank 0 at initialisation. Checked and kept for
    # MindSpore configs, without effect: jaxpar places every argument from the one global
    # array (jaxpar.init's processes pass their copies, which must agree).
    parameter_broadcast: bool = False
    # Divide a loss repeated over model-parallel devices by their number (MindSpore's
    # repeated-calculation mean). Checked and kept, without effect: a jaxpar program computes
    # the global loss once, so no loss is repeated.
    loss_repeated_mean: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, _CHECKS[f.name](getattr(self, f.name)))
        # full_batch is dataset_strategy="full_batch" by its older name: the one not at its
        # default says which (a YAML file or a constructor may give either); both set
        # otherwise is a contradiction.
        whole = self.dataset_strategy == "full_batch"
        if self.full_batch and self.dataset_strategy == "data_parallel":
            object.__setattr__(self, "dataset_strategy", "full_batch")
        elif whole and not self.full_batch:
            object.__setattr__(self, "full_batch", True)
        elif self.full_batch and not whole:
            raise _disagree(True, self.dataset_strategy)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (deep copies): `set_auto_parallel_context(**ctx.to_dict())`.

        Returns:
          {field name: value}, which `ParallelContext.from_dict` turns back into an equal context.
        """
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParallelContext:
        """A context from {field name: value}; missing keys take their defaults.

        Args:
          data: a mapping of field names to values; an unknown key is a ValueError.

        Returns:
          The checked ParallelContext.

        Example:
          >>> ParallelContext.from_dict({"device_num": 8}).device_num
          8
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"ParallelContext.from_dict(data={data!r}): data must be a dict of "
                            f"context keys, e.g. {{'device_num': 8}}.")
        data = _unaliased(data, "ParallelContext.from_dict")
        _check_keys(data, "ParallelContext.from_dict")
        return cls(**_batch_partner(data, cls()))


# ---- checks: each takes a value and returns it normalised, or raises naming key and value ----

def _bad(exc: type[Exception], key: str, value: Any, what: str) -> Exception:
    return exc(f"set_auto_parallel_context({key}={value!r}): {what}")


def _close(word: Any, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), list(known), n=3)
    return f" Did you mean {' or '.join(map(repr, close))}?" if close else ""


def _yaml_hint(value: Any) -> str:
    # PyYAML reads 1e9 (no dot) as a string: say so when such a number arrives as text.
    if not isinstance(value, str) or "e" not in value.lower():
        return ""
    try:
        float(value)
    except ValueError:
        return ""
    return " (a number given as text: YAML reads 1e9 as text, write 1.0e+9; in Python, no quotes.)"


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(TypeError, key, value, "must be True or False.")
    return value


def _int(key: str, value: Any, low: int, high: int | None = None) -> int:
    rule = f"must be an int >= {low}." if high is None else f"must be an int in [{low}, {high}]."
    if not _is_int(value):
        raise _bad(TypeError, key, value, rule + _yaml_hint(value))
    if value < low or (high is not None and value > high):
        raise _bad(ValueError, key, value, rule)
    return int(value)


def _choice(key: str, value: Any, choices: tuple[str, ...], hint: str = "") -> str:
    rule = f"must be one of {list(choices)}.{hint}"
    if not isinstance(value, str):
        raise _bad(TypeError, key, value, rule)
    if value not in choices:
        raise _bad(ValueError, key, value, rule + _close(value, choices))
    return value


def _mapping(key: str, value: Any, known: Iterable[str]) -> dict:
    known = list(known)
    if not isinstance(value, Mapping):
        raise _bad(TypeError, key, value, f"must be a dict with keys among {known}.")
    for sub in value:
        if sub not in known:
            raise _bad(ValueError, key, value, f"unknown key {sub!r}.{_close(sub, known)} "
                                               f"Known keys: {known}.")
    return dict(value)


def _device_num(value: Any) -> int | None:
    return None if value is None else _int("device_num", value, 1, MAX_DEVICES)


def _disagree(full_batch: bool, dataset_strategy: Any) -> ValueError:
    return ValueError(
        f"set_auto_parallel_context(full_batch={full_batch}, dataset_strategy="
        f"{dataset_strategy!r}): they disagree: full_batch=True is MindSpore's older name for "
        "dataset_strategy='full_batch' (every input whole on every device), False for "
        "'data_parallel' or split counts. Give one of them.")


def _strategy_file(key: str, value: Any) -> str:
    rule = ("must be '' (no file) or a path ending in .json, e.g. './strategy_stage1.json' "
            "(made absolute when set).")
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise _bad(TypeError, key, value, rule)
    if value.endswith(".ckpt"):
        raise _bad(ValueError, key, value, rule + " MindSpore writes a .ckpt strategy file in "
                   "protobuf; jaxpar reads and writes its strategy files as JSON: name it "
                   f"{value[:-len('.ckpt')] + '.json'!r}.")
    if value and not value.endswith(".json"):
        raise _bad(ValueError, key, value, rule)
    return os.path.abspath(value) if value else value


def _dataset_strategy(value: Any) -> str | tuple[tuple[int, ...], ...]:
    rule = ("must be 'data_parallel', 'full_batch' or one tuple of positive split counts per "
            "input, e.g. ((8, 1), (8,)).")
    if isinstance(value, str):
        if value not in DATASET_STRATEGIES:
            raise _bad(ValueError, "dataset_strategy", value, rule + _close(value,
                                                                              DATASET_STRATEGIES))
        return value
    if not isinstance(value, tuple | list):
        raise _bad(TypeError, "dataset_strategy", value, rule)
    if not value:
        raise _bad(ValueError, "dataset_strategy", value, rule)
    return tuple(_split_counts(value, i, rule) for i in range(len(value)))


def _split_counts(value: tuple | list, i: int, rule: str) -> tuple[int, ...]:
    counts = value[i]
    if not isinstance(counts, tuple | list) or not all(_is_int(c) for c in counts):
        raise _bad(TypeError, "dataset_strategy", value, f"input {i} has {counts!r}; {rule}")
    if any(c < 1 for c in counts):
        raise _bad(ValueError, "dataset_strategy", value, f"input {i} has {counts!r}; {rule}")
    return tuple(int(c) for c in counts)


def _parallel_optimizer_config(value: Any) -> dict[str, Any]:
    config = {**PARALLEL_OPTIMIZER_DEFAULTS,
              **_mapping("parallel_optimizer_config", value, PARALLEL_OPTIMIZER_DEFAULTS)}
    label = "parallel_optimizer_config[{!r}]".format
    shard = _int(label("optimizer_weight_shard_size"), config["optimizer_weight_shard_size"], -1)
    if shard in (0, 1):
        raise _bad(ValueError, label("optimizer_weight_shard_size"), shard,
                   "must be -1 (the whole data parallel group) or an int > 1.")
    return {"gradient_accumulation_shard": _bool(label("gradient_accumulation_shard"),
                                                 config["gradient_accumulation_shard"]),
            "parallel_optimizer_threshold": _int(label("parallel_optimizer_threshold"),
                                                 config["parallel_optimizer_threshold"], 0),
            "optimizer_weight_shard_size": shard}


def _indices(key: str, value: Any) -> tuple[int, ...]:
    rule = "must be a list of strictly increasing ints >= 0, e.g. [8, 160]."
    if not isinstance(value, tuple | list) or not all(_is_int(v) for v in value):
        raise _bad(TypeError, key, value, rule)
    if any(v < 0 for v in value) or any(a >= b for a, b in zip(value, value[1:], strict=False)):
        raise _bad(ValueError, key, value, rule)
    return tuple(int(v) for v in value)


def _comm_fusion(value: Any) -> dict[str, Any]:
    entries = _mapping("comm_fusion", value, ("openstate", *COMM_FUSION_MODES))
    out: dict[str, Any] = {}
    if "openstate" in entries:  # MindSpore's switch for the whole fusion (default True)
        out["openstate"] = _bool("comm_fusion['openstate']", entries.pop("openstate"))
    return out | {kind: _fusion_entry(kind, entry) for kind, entry in entries.items()}


def _fusion_entry(kind: str, entry: Any) -> dict[str, Any]:
    label = f"comm_fusion[{kind!r}]"
    entry = _mapping(label, entry, ("mode", "config"))
    if "mode" not in entry:
        raise _bad(ValueError, label, entry, "needs a 'mode': e.g. {'mode': 'size', 'config': 32}.")
    hint = " ('index' is for allreduce only.)" if kind != "allreduce" else ""
    mode = _choice(f"{label}['mode']", entry["mode"], COMM_FUSION_MODES[kind], hint)
    config = entry.get("config")
    if mode == "auto" and config is not None:
        raise _bad(ValueError, f"{label}['config']", config,
                   "mode 'auto' takes config None (a 64 MB threshold); use mode 'size' for MB.")
    if mode == "size":
        config = _int(f"{label}['config']", config, 1)  # threshold in MB, above 0
    if mode == "index":
        config = _indices(f"{label}['config']", config)
    return {"mode": mode, "config": config}


def is_finite(value) -> bool:
    """math.isfinite, where an int too large for a float (10**400) is not finite."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_mem_coeff(value: Any, where: str = "set_auto_parallel_context") -> float:
    """mem_coeff as a float; a TypeError/ValueError naming `where` (the caller: shard,
    AutoParallel, set_auto_parallel_context) and the value otherwise."""
    rule = "must be a finite number >= 0 (larger favours model parallel, smaller data parallel)."
    if not _is_real(value):
        raise TypeError(f"{where}(mem_coeff={value!r}): {rule}{_yaml_hint(value)}")
    if not is_finite(value) or value < 0:
        raise ValueError(f"{where}(mem_coeff={value!r}): {rule}")
    return float(value) + 0.0  # -0.0 as 0 (the plan's objective said "mem_coeff -0")


def check_memory_budget(value: Any, where: str = "set_auto_parallel_context"
                        ) -> int | float | str | None:
    """memory_budget as given (None, 'hardware', or bytes per device: an int stays an int);
    a TypeError/ValueError naming `where` and the value otherwise."""
    rule = ("must be a finite number of bytes per device, at least 1 (16e9 for 16 GB), "
            "'hardware' (the hardware profile's memory) or None (no budget).")
    if value is None or (isinstance(value, str) and value == "hardware"):
        return value
    if isinstance(value, str):
        raise ValueError(f"{where}(memory_budget={value!r}): {rule}{_yaml_hint(value)}")
    if not _is_real(value):
        raise TypeError(f"{where}(memory_budget={value!r}): {rule}")
    if not is_finite(value) or value < 1:
        raise ValueError(f"{where}(memory_budget={value!r}): {rule}")
    return int(value) if _is_int(value) else float(value)


def _hardware(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise _bad(TypeError, "hardware", value, "must be a hardware profile name (e.g. "
                                                 "'h100-nvlink'), a YAML path, or None.")
    from jaxpar.cost.hardware import load_profile  # lazy: keeps `import jaxpar.context` light

    try:
        load_profile(value)
    except (ValueError, TypeError, OSError, yaml.YAMLError) as err:
        what = str(err).removeprefix(f"hardware={value!r}: ")  # load_profile names it too
        raise _bad(ValueError, "hardware", value, what) from None
    return value


def _parallel_config(value: Any) -> dict[str, Any]:
    config = _mapping("parallel_config", value, MINDFORMERS_INT_KEYS + MINDFORMERS_BOOL_KEYS)
    label = "parallel_config[{!r}]".format
    return {key: _int(label(key), v, 1) if key in MINDFORMERS_INT_KEYS else _bool(label(key), v)
            for key, v in config.items()}


_CHECKS: dict[str, Callable[[Any], Any]] = {
    "device_num": _device_num,
    "global_rank": partial(_int, "global_rank", low=0, high=MAX_DEVICES - 1),
    "gradients_mean": partial(_bool, "gradients_mean"),
    "gradient_fp32_sync": partial(_bool, "gradient_fp32_sync"),
    "parallel_mode": partial(_choice, "parallel_mode", choices=PARALLEL_MODES),
    "search_mode": partial(_choice, "search_mode", choices=SEARCH_MODES),
    "strategy_ckpt_load_file": partial(_strategy_file, "strategy_ckpt_load_file"),
    "strategy_ckpt_save_file": partial(_strategy_file, "strategy_ckpt_save_file"),
    "full_batch": partial(_bool, "full_batch"),
    "dataset_strategy": _dataset_strategy,
    "enable_parallel_optimizer": partial(_bool, "enable_parallel_optimizer"),
    "parallel_optimizer_config": _parallel_optimizer_config,
    "enable_alltoall": partial(_bool, "enable_alltoall"),
    "all_reduce_fusion_config": partial(_indices, "all_reduce_fusion_config"),
    "pipeline_stages": partial(_int, "pipeline_stages", low=1),
    "grad_accumulation_step": partial(_int, "grad_accumulation_step", low=1),
    "comm_fusion": _comm_fusion,
    "mem_coeff": check_mem_coeff,
    "memory_budget": check_memory_budget,
    "hardware": _hardware,
    "parallel_config": _parallel_config,
    "parameter_broadcast": partial(_bool, "parameter_broadcast"),
    "loss_repeated_mean": partial(_bool, "loss_repeated_mean"),
}
# MindSpore's older names of keys: read as the key they name (MindSpore 2.x still takes
# auto_parallel_search_mode, deprecated, for search_mode).
ALIASES = {"auto_parallel_search_mode": "search_mode"}
FIELD_NAMES = tuple(f.name for f in fields(ParallelContext))
assert set(_CHECKS) == set(FIELD_NAMES), "every ParallelContext field needs exactly one check"


def _unaliased(kwargs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`kwargs` with each older key name (ALIASES) as the key it names; both names given
    with different values is a ValueError."""
    out = dict(kwargs)
    for old, new in ALIASES.items():
        if old in out:
            value = out.pop(old)
            if new in out and out[new] != value:
                raise ValueError(f"{where}({old}={value!r}, {new}={out[new]!r}): {old} is "
                                 f"MindSpore's older name of {new}; give one of them.")
            out[new] = value
    return out


def _check_keys(keys: Iterable[Any], where: str) -> None:
    for key in keys:
        if key not in FIELD_NAMES:
            raise ValueError(f"{where}({key}=...): unknown key {key!r}.{_close(key, FIELD_NAMES)}"
                             f" Known keys: {list(FIELD_NAMES)}.")


# ---- the process-wide context (the one module-level state, as in MindSpore) ----

_current = ParallelContext()


def set_auto_parallel_context(**kwargs: Any) -> None:
    """Set keys of the process-wide parallel context; all or nothing.

    Args:
      **kwargs: context keys (the `ParallelContext` fields) and their new values. If any key is
        unknown or any value bad, a ValueError/TypeError is raised and nothing changes.

    Returns:
      None.

    Example:
      >>> set_auto_parallel_context(parallel_mode="auto_parallel", mem_coeff=0.1, device_num=8)
    """
    global _current
    kwargs = _unaliased(kwargs, "set_auto_parallel_context")
    _check_keys(kwargs, "set_auto_parallel_context")
    # replace() re-runs every check before assigning
    _current = replace(_current, **_batch_partner(kwargs, _current))


def _batch_partner(kwargs: dict[str, Any], ctx: ParallelContext) -> dict[str, Any]:
    """`kwargs` with full_batch or dataset_strategy, when one of them is given alone, joined
    by the other in step with it (MindSpore: full_batch=True is dataset_strategy="full_batch",
    False is "data_parallel"); full_batch=False leaves split counts as they are."""
    full, split = kwargs.get("full_batch"), kwargs.get("dataset_strategy")
    if "full_batch" in kwargs and "dataset_strategy" in kwargs:
        if (full is False and split == "full_batch") or (full is True and
                                                         split == "data_parallel"):
            raise _disagree(full, split)  # (ParallelContext takes "data_parallel" for unset)
        return kwargs  # ParallelContext checks full_batch=True against split counts
    if "full_batch" not in kwargs and "dataset_strategy" not in kwargs:
        return kwargs
    if isinstance(full, bool):
        keep = ctx.dataset_strategy if ctx.dataset_strategy != "full_batch" else "data_parallel"
        return kwargs | {"dataset_strategy": "full_batch" if full else keep}
    if "dataset_strategy" in kwargs:
        return kwargs | {"full_batch": split == "full_batch"}
    return kwargs  # a bad full_batch: its own check names it


def get_auto_parallel_context(name: str) -> Any:
    """The current value of one context key (a copy: changing it changes nothing).

    Args:
      name: a `ParallelContext` field name, e.g. "search_mode".

    Returns:
      Its value in the process-wide context.

    Example:
      >>> get_auto_parallel_context("search_mode")
      'recursive_programming'
    """
    if not isinstance(name, str):
        raise TypeError(f"get_auto_parallel_context(name={name!r}): name must be a str key, "
                        f"one of {list(FIELD_NAMES)}.")
    name = ALIASES.get(name, name)
    _check_keys([name], "get_auto_parallel_context")
    return copy.deepcopy(getattr(_current, name))


def reset_auto_parallel_context() -> None:
    """Put every key of the process-wide context back to its default.

    Example:
      >>> reset_auto_parallel_context(); get_auto_parallel_context("parallel_mode")
      'stand_alone'
    """
    global _current
    _current = ParallelContext()


def current_context() -> ParallelContext:
    """A copy of the process-wide context.

    Returns:
      A ParallelContext equal to the current one; nothing done to it reaches the global.

    Example:
      >>> current_context().mem_coeff
      0.1
    """
    return copy.deepcopy(_current)


# ---- YAML files ----

_SAVE_HEADER = "# jaxpar parallel context (jaxpar.context.save_config); keys = ParallelContext.\n"
_FILE_KEYS = ("parallel_context", "parallel", "parallel_config", "use_parallel")


def load_config(path: str | os.PathLike) -> ParallelContext:
    """Read a parallel context from YAML.

    Accepted forms: top-level keys that are `ParallelContext` fields (or the same under a
    `parallel_context:` mapping), and MindFormers files: `use_parallel` (false: stand_alone;
    true: data_parallel unless a mode is given), a `parallel:` block of context keys where
    `parallel_mode` may be MindFormers' int (0 data_parallel, 1 semi_auto_parallel,
    2 auto_parallel, 3 hybrid_parallel) or upper-case name and `auto_pipeline` is kept in
    `parallel_config`, and a `parallel_config:` block whose `pipeline_stage` becomes
    `pipeline_stages` and `mem_coeff` becomes `mem_coeff`.

    Args:
      path: the YAML file.

    Returns:
      The checked ParallelContext (the process-wide context is not changed).

    Example:
      >>> ctx = load_config("configs/parallel/mindformers_auto.yaml")
      >>> set_auto_parallel_context(**ctx.to_dict())
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"load_config(path={path!r}): pass the path of a YAML file (a str or "
                        "pathlib.Path), such as 'configs/parallel/default.yaml'.")
    path = Path(path)
    data = read_yaml(path, f"load_config(path={str(path)!r})", "configs/parallel/default.yaml")
    return context_from_mapping(data, str(path))


class _UniqueKeys(yaml.SafeLoader):
    """yaml.safe_load's loader, but a key given twice in one mapping is an error: PyYAML keeps
    the last, so a config with two `parallel:` blocks would drop the first unsaid."""


def _unique_mapping(loader: _UniqueKeys, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            twice = key in seen
        except TypeError:  # an unhashable key: construct_mapping names it
            continue
        if twice:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice (YAML would keep the last)",
                key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


_UniqueKeys.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def read_yaml(path: Path, who: str, example: str) -> Any:
    """The YAML document in `path`, or a ValueError starting with `who` (no such file) or the
    path (not valid YAML: what and where, on one line)."""
    if not path.is_file():
        raise ValueError(f"{who}: no such file; pass a YAML file such as {example}.")
    try:
        return yaml.load(path.read_text(), Loader=_UniqueKeys)  # noqa: S506 -- a SafeLoader
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a YAML text file ({err}).") from None
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply to read; a config is a few levels of "
                         "mappings.") from None
    except yaml.YAMLError as err:
        mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
        where = " ".join(str(err).split()) if mark is None or problem is None else \
            f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
        raise ValueError(f"{path}: not valid YAML ({where}).") from None


def context_from_mapping(data: Mapping[str, Any] | None, where: str) -> ParallelContext:
    """A parallel context from a mapping in any form `load_config` reads from a YAML file.

    For configs that hold a parallel context among other things (a run config's `parallel:`
    and `parallel_config:` blocks): the same translation, the same checks.

    Args:
      data: the mapping (None: every key at its default), e.g. {"parallel": {"parallel_mode": 2}}.
      where: what the mapping came from (a file name), put before every error message.

    Returns:
      The checked ParallelContext (the process-wide context is not changed).

    Example:
      >>> context_from_mapping({"parallel": {"parallel_mode": 2}}, "run.yaml").parallel_mode
      'auto_parallel'
    """
    try:
        return ParallelContext(**_batch_partner(_fields_from_yaml(data), ParallelContext()))
    except (ValueError, TypeError) as err:  # a file's bad type is a bad value of the file
        raise ValueError(f"{where}: {err}") from None


def save_config(ctx: ParallelContext, path: str | os.PathLike) -> None:
    """Write `ctx` as YAML (one top-level key per field) that `load_config` reads back equal.

    Args:
      ctx: the context to write, e.g. `current_context()`.
      path: the file to (over)write.

    Example:
      >>> save_config(current_context(), "/tmp/parallel.yaml")
    """
    if not isinstance(ctx, ParallelContext):
        raise TypeError(f"save_config(ctx={ctx!r}): pass a ParallelContext, e.g. "
                        "current_context().")
    from jaxpar.plan import check_writable

    check_writable(path, "save_config(path=...)")
    text = yaml.safe_dump(_plain(ctx.to_dict()), sort_keys=False, default_flow_style=None)
    Path(path).write_text(_SAVE_HEADER + text)


def _plain(value: Any) -> Any:
    """Tuples as lists, recursively: plain YAML sequences."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def _fields_from_yaml(data: Any) -> dict[str, Any]:
    """A YAML document -> ParallelContext keyword arguments (values still unchecked)."""
    data = {} if data is None else _yaml_mapping("the file", data)
    if "parallel_context" in data:
        if len(data) != 1:
            raise ValueError(f"'parallel_context:' must be the only top-level key; found also "
                             f"{sorted(k for k in data if k != 'parallel_context')}.")
        data = _yaml_mapping("parallel_context", data["parallel_context"])
    kwargs: dict[str, Any] = {}
    for key, value in _unaliased(data, "the file").items():
        if key == "parallel":
            _add(kwargs, _from_parallel_block(value), "parallel")
        elif key == "parallel_config":
            _add(kwargs, _from_parallel_config(value), "parallel_config")
        elif key in FIELD_NAMES:
            _add(kwargs, {key: value}, key)
        elif key != "use_parallel":
            _unknown("", key, FIELD_NAMES + _FILE_KEYS)
    _apply_use_parallel(kwargs, data)
    return kwargs


def _yaml_mapping(where: str, value: Any) -> dict:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a mapping of parallel context keys, got {value!r}.")
    return dict(value)


def _unknown(prefix: str, key: Any, known: Iterable[str]) -> None:
    known = sorted(set(known))
    raise ValueError(f"unknown key {prefix}{key}.{_close(key, known)} Known keys: {known}.")


def _add(kwargs: dict[str, Any], new: dict[str, Any], where: str) -> None:
    """Merge `new` into `kwargs`; a key given twice is an error (parallel_config dicts merge)."""
    for key, value in new.items():
        if key == "parallel_config" and isinstance(kwargs.get(key), dict) and isinstance(value,
                                                                                          dict):
            _add(kwargs[key], value, where)
            continue
        if key in kwargs:
            raise ValueError(f"key {key!r} is given twice (again under '{where}'); give it once.")
        kwargs[key] = value


def _from_parallel_block(block: Any) -> dict[str, Any]:
    """MindFormers' `parallel:` block: context keys; parallel_mode may be an int or upper-case."""
    block = _unaliased(_yaml_mapping("parallel", block), "parallel")
    out: dict[str, Any] = {}
    if "auto_pipeline" in block:  # MindFormers-only switch: kept for the pipeline planner
        out["parallel_config"] = {"auto_pipeline": block.pop("auto_pipeline")}
    for key, value in block.items():
        if key not in FIELD_NAMES:
            _unknown("parallel.", key, FIELD_NAMES + ("auto_pipeline",))
        if key == "parallel_config" and isinstance(value, Mapping) and key in out:
            value = {**value, **out[key]}  # beside auto_pipeline, not instead of it
        out[key] = _mindformers_mode(value) if key == "parallel_mode" else value
    return out


def _mindformers_mode(value: Any) -> Any:
    if _is_int(value):
        if value not in MINDFORMERS_PARALLEL_MODES:
            raise ValueError(f"parallel.parallel_mode={value!r}: MindFormers' integer modes are "
                             f"{MINDFORMERS_PARALLEL_MODES}; or give the mode's name.")
        return MINDFORMERS_PARALLEL_MODES[value]
    return value.lower() if isinstance(value, str) else value  # 'AUTO_PARALLEL' is MindFormers'


def _from_parallel_config(block: Any) -> dict[str, Any]:
    """MindFormers' `parallel_config:`: pipeline_stage and mem_coeff are context keys."""
    block = _yaml_mapping("parallel_config", block)
    out: dict[str, Any] = {}
    if "pipeline_stage" in block:
        out["pipeline_stages"] = block.pop("pipeline_stage")
    if "mem_coeff" in block:
        out["mem_coeff"] = block.pop("mem_coeff")
    out["parallel_config"] = block
    return out


def _apply_use_parallel(kwargs: dict[str, Any], data: dict) -> None:
    """MindFormers' `use_parallel`: false runs stand-alone; true defaults to mode 0 (data)."""
    if "use_parallel" not in data:
        return
    use = data["use_parallel"]
    if not isinstance(use, bool):
        raise ValueError(f"use_parallel={use!r}: must be true or false.")
    if use:
        kwargs.setdefault("parallel_mode", "data_parallel")
    else:
        kwargs["parallel_mode"] = "stand_alone"
