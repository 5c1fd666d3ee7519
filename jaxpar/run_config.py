"""Run configs: one YAML file naming a model, how it trains, the mesh, the hardware and the
parallel context; what `jaxpar plan CONFIG.yaml` reads.

Before: a YAML file (or a mapping) with the top-level keys

    model:            name (gpt | mlp | nnx_gpt) and that model's config fields
    train:            batch_size, optimizer (adam | adamw | sgd), learning_rate
    mesh:             a device count (64), a shape ([4, 2]) or {devices, shape, names}
    hardware:         a hardware profile name (configs/hardware/*.yaml) or a YAML path
    use_parallel, parallel, parallel_config:
                      the parallel context, MindFormers style, read by `jaxpar.context` exactly
                      as `load_config` reads them (parallel_mode may be 0-3 or a name)

After: a frozen `RunConfig` whose every field holds a checked value (an unknown key or a bad
value is a ValueError naming the file and the key), and from it, with `plan_run`, the model's
abstract training step planned over a `jax.sharding.AbstractMesh`: any device count, no devices
used, nothing run.

How the context's parallel_mode becomes a planning mode (`RunConfig.plan_mode`):
  auto_parallel                  -> the context's search_mode (recursive_programming by default)
  semi_auto_parallel, hybrid_parallel -> semi_auto: the batch data parallel, parameters
                                    replicated, except that parallel_config.model_parallel = k > 1
                                    cuts them Megatron style over an "mp" axis of size k (the
                                    mesh is then (dp, mp)); sharding propagation plans the rest
  data_parallel                  -> data_parallel: the batch over every device, parameters
                                    replicated, sharding propagation plans the rest
  stand_alone (the default)      -> nothing to plan: give a mode (`plan_run(mode=...)`)
"""

from __future__ import annotations

import difflib
import math
import numbers
import re
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from jaxpar.context import (
    MAX_DEVICES,
    ParallelContext,
    context_from_mapping,
    is_finite,
    read_yaml,
)
from jaxpar.models._checks import MODEL_DTYPES

MODELS = ("gpt", "mlp", "nnx_gpt")
OPTIMIZERS = ("adam", "adamw", "sgd")
ACTIVATIONS = ("relu", "gelu", "tanh", "none")
PLAN_MODES = ("semi_auto", "data_parallel", "sharding_propagation", "recursive_programming",
              "dynamic_programming")
AUTOMATIC_MODES = ("recursive_programming", "dynamic_programming")
TOP_KEYS = ("model", "train", "mesh", "hardware", "use_parallel", "parallel", "parallel_config")
_CONTEXT_KEYS = ("use_parallel", "parallel", "parallel_config")
_FROM_PARALLEL_MODE = {"semi_auto_parallel": "semi_auto", "hybrid_parallel": "semi_auto",
                       "data_parallel": "data_parallel"}
TP_AXIS = "mp"


@dataclass(frozen=True)
class MLPConfig:
    """The `mlp` model (`jaxpar.models.mlp`): layer widths, input first and output last."""

    sizes: tuple[int, ...] = (1024, 4096, 1024)
    bias: bool = True           # layers have a bias
    activation: str = "relu"    # between layers: relu | gelu | tanh | none


@dataclass(frozen=True)
class ModelSpec:
    """The `model:` block: the model's name and its config (GPTConfig or MLPConfig)."""

    name: str
    config: Any


@dataclass(frozen=True)
class TrainConfig:
    """The `train:` block."""

    batch_size: int = 8           # the global batch
    optimizer: str = "adamw"      # adam | adamw | sgd (optax, default hyper-parameters)
    learning_rate: float = 1e-3


@dataclass(frozen=True)
class MeshConfig:
    """The `mesh:` block. None everywhere: the context's device_num, else every device."""

    devices: int | None = None                 # device count
    shape: tuple[int, ...] | None = None       # axis sizes, outermost first
    names: tuple[str, ...] | None = None       # axis names (default d0, d1, ...)

    @property
    def size(self) -> int | None:
        return math.prod(self.shape) if self.shape else self.devices


@dataclass(frozen=True)
class RunConfig:
    """A checked run config (see the module docstring for the YAML keys).

    Example:
      >>> run = load_run_config("configs/gpt_small_auto_parallel.yaml")
      >>> run.plan_mode(), run.mesh_axes(devices=64)
      ('recursive_programming', ((4, 4, 4), ('d0', 'd1', 'd2')))
    """

    model: ModelSpec
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    hardware: str | None = None
    context: ParallelContext = field(default_factory=ParallelContext)
    source: str = "<run config>"
    use_parallel: bool | None = None  # MindFormers' key as the file gave it (None: not given)

    def plan_mode(self, mode: str | None = None) -> str:
        """The planning mode: `mode` when given, else the one the context's parallel_mode
        names (module docstring)."""
        if mode is not None:
            return _check_mode(mode)
        ctx = self.context
        if ctx.parallel_mode == "auto_parallel":
            return ctx.search_mode
        if ctx.parallel_mode in _FROM_PARALLEL_MODE:
            return _FROM_PARALLEL_MODE[ctx.parallel_mode]
        if self.use_parallel is False:  # it overrides parallel.parallel_mode, as MindFormers'
            raise ValueError(f"{self.source}: use_parallel: false runs stand-alone whatever "
                             "parallel.parallel_mode says, and plans nothing; set use_parallel: "
                             f"true, or give a mode ({list(PLAN_MODES)}).")
        raise ValueError(f"{self.source}: parallel_mode is {ctx.parallel_mode!r}, which plans "
                         "nothing; set parallel.parallel_mode to auto_parallel (2), "
                         "semi_auto_parallel (1) or data_parallel (0), or give a mode "
                         f"({list(PLAN_MODES)}).")

    def tensor_parallel(self, mode: str) -> int:
        """Megatron's model parallel degree in semi_auto (parallel_config.model_parallel);
        1 otherwise."""
        return self.context.parallel_config.get("model_parallel", 1) if mode == "semi_auto" else 1

    def hardware_name(self, hardware: str | None = None) -> str:
        """The profile to plan for: `hardware`, else the config's, else the context's, else cpu."""
        if hardware is not None:  # "" too: load_profile names it
            return hardware
        return self.hardware or self.context.hardware or "cpu"

    def mesh_axes(self, devices: int | None = None, mode: str | None = None
                  ) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """(axis sizes, axis names) of the mesh to plan over.

        Args:
          devices: plan for this many devices instead of the config's count. The config's mesh
            shape is kept when its size matches; else the count is factored into at most three
            axes (mesh.planning_shape: 64 -> (4, 4, 4), 16 -> (2, 2, 4)).
          mode: the planning mode (default `plan_mode()`); semi_auto with model_parallel k > 1
            plans over (devices / k, k) named ("dp", "mp").

        Returns:
          The sizes and names, outermost first.
        """
        mode = self.plan_mode(mode)
        n = self.device_count() if devices is None else _device_count("devices", devices)
        mp = self.tensor_parallel(mode)
        if mp > 1:
            return self._dp_mp_axes(n, mp, devices is None)
        if mode == "semi_auto" and devices is None:
            self._check_degrees(n, 1)
        if self.mesh.shape and math.prod(self.mesh.shape) == n:
            return self.mesh.shape, self.mesh.names or _default_names(len(self.mesh.shape))
        from jaxpar.mesh import planning_shape  # (jax is imported only when needed)

        sizes = planning_shape(n)
        return sizes, _default_names(len(sizes))

    def device_count(self) -> int:
        """The devices the config names: mesh, else context device_num, else the semi-auto
        degrees' product, else every device jax sees."""
        pc = self.context.parallel_config
        if self.mesh.size:
            return self.mesh.size
        if self.context.device_num:
            return self.context.device_num
        if self.context.parallel_mode in _FROM_PARALLEL_MODE and "data_parallel" in pc:
            return pc["data_parallel"] * pc.get("model_parallel", 1)
        import jax
        return len(jax.devices())

    def _check_degrees(self, n: int, mp: int) -> None:
        """semi_auto's parallel_config degrees must multiply to the mesh's device count."""
        dp = self.context.parallel_config.get("data_parallel")
        if dp is not None and dp * mp != n:
            raise ValueError(f"{self.source}: parallel_config data_parallel={dp} x "
                             f"model_parallel={mp} is {dp * mp} devices, but the mesh has {n}; "
                             "make them agree.")

    def _dp_mp_axes(self, n: int, mp: int, from_config: bool
                    ) -> tuple[tuple[int, ...], tuple[str, ...]]:
        if n % mp:
            raise ValueError(f"{self.source}: parallel_config.model_parallel={mp} does not divide "
                             f"{n} devices; use a device count that is a multiple of {mp}.")
        if from_config:
            self._check_degrees(n, mp)
        if self.mesh.shape and self.mesh.shape != (n // mp, mp) and from_config:
            raise ValueError(f"{self.source}: mesh shape {list(self.mesh.shape)} is not "
                             f"(data_parallel, model_parallel) = [{n // mp}, {mp}]; semi_auto "
                             "with model_parallel plans over that mesh: give mesh: "
                             f"{{devices: {n}}} or leave mesh out.")
        return (n // mp, mp), ("dp", TP_AXIS)


# ---- loading ------------------------------------------------------------------------------------

def load_run_config(path: str | Path) -> RunConfig:
    """Read and check a run config YAML file.

    Args:
      path: the file, e.g. "configs/gpt_small_auto_parallel.yaml".

    Returns:
      The RunConfig; any unknown key or bad value is a ValueError naming the file and the key.

    Example:
      >>> run = load_run_config("configs/mlp_data_parallel.yaml")
      >>> run.model.name, run.plan_mode()
      ('mlp', 'data_parallel')
    """
    path = Path(path)
    data = read_yaml(path, f"run config {str(path)!r}", "configs/gpt_small_auto_parallel.yaml")
    return run_config_from_mapping(data, str(path))


def run_config_from_mapping(data: Any, where: str = "<run config>") -> RunConfig:
    """A RunConfig from a mapping of the YAML keys (see the module docstring).

    Args:
      data: the mapping, e.g. {"model": {"name": "mlp", "sizes": [32, 64, 10]}}.
      where: what it came from (a file name), put before every error message.

    Returns:
      The checked RunConfig.

    Example:
      >>> run_config_from_mapping({"model": {"name": "gpt", "layers": 1}}).model.config.layers
      1
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: a run config is a mapping with keys {list(TOP_KEYS)}, got "
                         f"{data!r}.")
    for key in data:
        if key not in TOP_KEYS:
            raise ValueError(f"{where}: unknown key {key!r}.{_close(key, TOP_KEYS)} Known keys: "
                             f"{list(TOP_KEYS)}.")
    if "model" not in data:
        raise ValueError(f"{where}: no 'model:' block; name a model, e.g. model: {{name: gpt, "
                         f"layers: 2}} (models: {list(MODELS)}).")
    context = context_from_mapping({k: data[k] for k in _CONTEXT_KEYS if k in data}, where)
    run = RunConfig(model=_model(data["model"], where), train=_train(data.get("train"), where),
                    mesh=_mesh(data.get("mesh"), where),
                    hardware=_hardware(data.get("hardware"), where), context=context,
                    source=where, use_parallel=data.get("use_parallel"))
    _check_counts(run)
    if context.pipeline_stages > 1:  # before tracing: AutoParallel would refuse it there
        raise ValueError(f"{where}: pipeline_stages={context.pipeline_stages} "
                         "(parallel_config.pipeline_stage): pipeline parallelism is not in this "
                         "version of jaxpar; use 1, and data/tensor/optimizer parallel over the "
                         "whole mesh.")
    return run


def _model(block: Any, where: str) -> ModelSpec:
    block = _block(block, "model", where)
    name = block.pop("name", None)
    if name not in MODELS:
        raise ValueError(f"{where}: model.name={name!r}: must be one of {list(MODELS)}.")
    if name == "mlp":
        return ModelSpec(name, _mlp_config(block, where))
    return ModelSpec(name, _gpt_config(name, block, where))


def _gpt_config(name: str, block: dict, where: str):
    import jax.numpy as jnp

    from jaxpar.models.gpt import GPTConfig

    _known(block, GPTConfig, f"model ({name})", where)
    if "scan_layers" in block:
        _bool(block["scan_layers"], "model.scan_layers", where)
        if name == "nnx_gpt" and block["scan_layers"]:
            raise ValueError(f"{where}: model.scan_layers=true: nnx_gpt keeps its layers as a "
                             "list; use scan_layers: false or model name gpt.")
    if "dtype" in block:
        try:
            block["dtype"] = jnp.dtype(block["dtype"])
        except TypeError:
            raise ValueError(f"{where}: model.dtype={block['dtype']!r}: not a dtype; use e.g. "
                             "float32 or bfloat16.") from None
        if block["dtype"].name not in MODEL_DTYPES:  # a training step differentiates it
            raise ValueError(f"{where}: model.dtype={block['dtype'].name!r}: the model's "
                             f"parameters and activations need one of {list(MODEL_DTYPES)}.")
    try:
        return GPTConfig(**block)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where}: model: {err}") from None


def _mlp_config(block: dict, where: str) -> MLPConfig:
    _known(block, MLPConfig, "model (mlp)", where)
    sizes = block.get("sizes", MLPConfig.sizes)
    if not isinstance(sizes, list | tuple) or len(sizes) < 2 or not all(
            _is_int(n) and n >= 1 for n in sizes):
        raise ValueError(f"{where}: model.sizes={sizes!r}: give at least two positive ints, "
                         "input width first and output width last, e.g. [1024, 4096, 1024].")
    activation = block.get("activation", "relu")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{where}: model.activation={activation!r}: must be one of "
                         f"{list(ACTIVATIONS)}.")
    bias = _bool(block.get("bias", True), "model.bias", where)
    return MLPConfig(tuple(int(n) for n in sizes), bias, activation)


def _train(block: Any, where: str) -> TrainConfig:
    block = _block(block, "train", where)
    _known(block, TrainConfig, "train", where)
    out = TrainConfig(**block)
    _positive_int(f"{where}: train.batch_size", out.batch_size)
    if out.optimizer not in OPTIMIZERS:
        raise ValueError(f"{where}: train.optimizer={out.optimizer!r}: must be one of "
                         f"{list(OPTIMIZERS)}.{_close(out.optimizer, OPTIMIZERS)}")
    lr = out.learning_rate
    if not _is_real(lr) or not lr > 0 or not is_finite(lr):
        hint = " (YAML reads 1e-3 as text; write 1.0e-3.)" if _numeric_text(lr) else ""
        raise ValueError(f"{where}: train.learning_rate={lr!r}: must be a finite number > 0."
                         f"{hint}")
    return out


def _mesh(value: Any, where: str) -> MeshConfig:
    if value is None:
        return MeshConfig()
    if _is_int(value):
        return MeshConfig(devices=_device_count(f"{where}: mesh", value))
    if isinstance(value, list | tuple):
        return MeshConfig(shape=_shape(value, "mesh", where))
    block = _block(value, "mesh", where)
    _known(block, MeshConfig, "mesh", where)
    devices = block.get("devices")
    shape = _shape(block["shape"], "mesh.shape", where) if "shape" in block else None
    names = _names(block.get("names"), shape, where)
    if devices is not None:
        _device_count(f"{where}: mesh.devices", devices)
        if shape and math.prod(shape) != devices:
            raise ValueError(f"{where}: mesh.shape {list(shape)} holds {math.prod(shape)} "
                             f"devices, not mesh.devices={devices}.")
    return MeshConfig(devices, shape, names)


def _shape(value: Any, key: str, where: str) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not value or not all(
            _is_int(n) and n >= 1 for n in value):
        raise ValueError(f"{where}: {key}={value!r}: give a list of positive axis sizes, e.g. "
                         "[4, 2].")
    _device_count(f"{where}: {key}'s device count", math.prod(value))
    return tuple(int(n) for n in value)


def _names(value: Any, shape: tuple[int, ...] | None, where: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    ok = isinstance(value, list | tuple) and all(isinstance(n, str) and n for n in value)
    if not ok or len(set(value)) != len(value) or shape is None or len(value) != len(shape):
        raise ValueError(f"{where}: mesh.names={value!r}: give one distinct name per axis of "
                         "mesh.shape, e.g. shape: [4, 2] with names: [dp, tp].")
    return tuple(value)


def _hardware(value: Any, where: str) -> str | None:
    if value is None:
        return None
    from jaxpar.cost.hardware import load_profile

    if not isinstance(value, str):
        raise ValueError(f"{where}: hardware={value!r}: give a profile name such as "
                         "h100-nvlink or a YAML path.")
    beside = Path(where).parent / value  # a relative path: from the config's folder, where
    if not Path(value).is_absolute() and Path(where).is_file() and beside.is_file():
        value = str(beside)  # it is (it was read from the working directory only)
    try:
        load_profile(value)
    except (ValueError, TypeError, OSError) as err:
        raise ValueError(f"{where}: {err}") from None
    return value


def _check_counts(run: RunConfig) -> None:
    n, ctx = run.mesh.size, run.context
    if n and ctx.device_num and n != ctx.device_num:
        raise ValueError(f"{run.source}: the mesh has {n} devices but parallel.device_num is "
                         f"{ctx.device_num}; give the count once.")
    if run.hardware and ctx.hardware and run.hardware != ctx.hardware:
        raise ValueError(f"{run.source}: hardware={run.hardware!r} but parallel.hardware="
                         f"{ctx.hardware!r}; give the profile once.")


# ---- small checks -------------------------------------------------------------------------------

def _block(value: Any, key: str, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: {key}: expected a mapping of keys, got {value!r}.")
    return dict(value)


def _known(block: Mapping, cls: type, key: str, where: str) -> None:
    known = [f.name for f in fields(cls)]
    for sub in block:
        if sub not in known:
            raise ValueError(f"{where}: {key}: unknown key {sub!r}.{_close(sub, known)} Known "
                             f"keys: {known}.")


def _close(word: Any, known) -> str:
    close = difflib.get_close_matches(str(word), list(known), n=3)
    return f" Did you mean {' or '.join(map(repr, close))}?" if close else ""


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _numeric_text(value: Any) -> bool:
    """Whether value is a number YAML read as text (PyYAML reads 1e-3, without a dot, so)."""
    if not isinstance(value, str):
        return False
    try:
        float(value)
    except ValueError:
        return False
    return True


def _positive_int(key: str, value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{key}={value!r}: must be a positive int.")
    return int(value)


def _device_count(key: str, value: Any) -> int:
    """A device count: a positive int of at most MAX_DEVICES (MindSpore's device_num range)."""
    n = _positive_int(key, value)
    if n > MAX_DEVICES:
        raise ValueError(f"{key}={value!r}: at most {MAX_DEVICES} devices (MindSpore's "
                         "device_num range).")
    return n


def _bool(value: Any, key: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {key}={value!r}: must be true or false.")
    return value


def _check_mode(mode: Any) -> str:
    if mode not in PLAN_MODES:
        raise ValueError(f"mode={mode!r}: must be one of {list(PLAN_MODES)}.")
    return mode


def _default_names(n: int) -> tuple[str, ...]:
    return tuple(f"d{i}" for i in range(n))


# ---- the model's training step ------------------------------------------------------------------

@dataclass(frozen=True)
class Problem:
    """A model's training step and its arguments as ShapeDtypeStructs.

    `step(params, opt_state, *batch) -> (params, opt_state, loss)`; `paths` and `shapes` list
    every argument leaf (paths as `jaxpar.shard` names them, e.g. "params/wte", "tokens").
    """

    step: Callable
    args: tuple
    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    owners: tuple[int, ...]  # the positional argument each leaf belongs to


def optimizer(train: TrainConfig):
    """The optax transformation `train` names (optax's default hyper-parameters)."""
    import optax
    return {"adam": optax.adam, "adamw": optax.adamw, "sgd": optax.sgd}[train.optimizer](
        train.learning_rate)


def build_problem(run: RunConfig) -> Problem:
    """The config's model as an abstract training step (no parameter memory is allocated).

    Example:
      >>> p = build_problem(load_run_config("configs/mlp_data_parallel.yaml"))
      >>> p.paths[:2]
      ('params/0/b', 'params/0/w')
    """
    import jax
    import jax.numpy as jnp

    from jaxpar.api import leaf_owners
    from jaxpar.ir import arg_paths

    dtype = getattr(run.model.config, "dtype", None)
    if dtype is not None and jnp.dtype(dtype).itemsize == 8 and not jax.config.jax_enable_x64:
        # JAX would make every array float32 (with a warning each) and the plan's figures
        # would be float32's under a float64 heading
        raise ValueError(f"model.dtype={jnp.dtype(dtype).name!r} needs JAX's 64-bit mode, which "
                         "is off: run with JAX_ENABLE_X64=1 (or jax.config.update("
                         "'jax_enable_x64', True) first), or use float32.")
    step, args = _BUILDERS[run.model.name](run.model.config, run.train)
    paths = tuple(arg_paths(step, args))
    leaves = jax.tree_util.tree_leaves(args)
    owners = tuple(leaf_owners(args))
    return Problem(step, args, paths, tuple(tuple(x.shape) for x in leaves), owners)


def _gpt_problem(cfg, train: TrainConfig):
    from jaxpar.models.gpt import abstract_train_step
    return abstract_train_step(cfg, train.batch_size, optimizer(train))


def _nnx_gpt_problem(cfg, train: TrainConfig):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxpar.models.nnx_gpt import NNXGPT, make_functional_step

    step, init = make_functional_step(cfg, optimizer(train))
    _, params, opt_state = jax.eval_shape(lambda: init(NNXGPT(cfg, rngs=nnx.Rngs(0))))
    tok = jax.ShapeDtypeStruct((train.batch_size, cfg.seq), jnp.int32)
    return step, (params, opt_state, tok, tok)


def _mlp_problem(cfg: MLPConfig, train: TrainConfig):
    import jax
    import jax.numpy as jnp

    from jaxpar.models.mlp import init_mlp, make_train_step

    act = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "tanh": jnp.tanh, "none": None}
    tx = optimizer(train)
    params = jax.eval_shape(lambda: init_mlp(jax.random.key(0), cfg.sizes, cfg.bias))
    x = jax.ShapeDtypeStruct((train.batch_size, cfg.sizes[0]), jnp.float32)
    y = jax.ShapeDtypeStruct((train.batch_size, cfg.sizes[-1]), jnp.float32)
    return make_train_step(tx, act[cfg.activation]), (params, jax.eval_shape(tx.init, params),
                                                      x, y)


_BUILDERS = {"gpt": _gpt_problem, "nnx_gpt": _nnx_gpt_problem, "mlp": _mlp_problem}


# ---- hand-written tensor parallel layouts -------------------------------------------------------

# Megatron-LM's layout of the GPT: column-parallel qkv and first MLP matmul (their biases cut
# alike), row-parallel output projections, vocab-parallel embedding (also the tied output
# projection); layer norms, wpe and the row-parallel biases replicated.
_MEGATRON_GPT = {"wqkv": (None, 0), "bqkv": (0,), "w1": (None, 0), "b1": (0,),
                 "wo": (0, None), "w2": (0, None), "wte": (0, None)}


def tensor_parallel_specs(model: str, paths, axis: str = TP_AXIS,
                          shapes: Sequence[tuple[int, ...]] | None = None) -> dict[str, Any]:
    """Megatron-style PartitionSpecs over mesh axis `axis` for a reference model's parameters.

    Args:
      model: "gpt", "nnx_gpt" (Megatron's GPT layout) or "mlp" (layers alternate column- and
        row-parallel, so each pair needs one all-reduce).
      paths: parameter leaf paths as `jaxpar.shard` names them ("params/blocks/0/attn/wqkv",
        nnx: ".../wqkv/value", mlp: "params/0/w").
      axis: the mesh axis to cut over.
      shapes: each path's shape, where a parameter may be stacked (`scan_layers`: the
        layers' weights in one array, the layer dimension first): the layout then applies to
        its trailing dimensions. None: no parameter is stacked.

    Returns:
      {path: PartitionSpec} for every path (P() for the replicated ones).

    Example:
      >>> tensor_parallel_specs("mlp", ["params/0/w", "params/1/w"], "tp")
      {'params/0/w': PartitionSpec(None, 'tp'), 'params/1/w': PartitionSpec('tp', None)}
    """
    from jax.sharding import PartitionSpec as P

    if model not in MODELS:
        raise ValueError(f"tensor_parallel_specs(model={model!r}): must be one of {list(MODELS)}.")
    paths = list(paths)
    if shapes is not None and len(shapes) != len(paths):
        raise ValueError(f"tensor_parallel_specs: {len(shapes)} shapes for {len(paths)} "
                         "paths; give one shape per path, or shapes=None.")
    out = {}
    for k, path in enumerate(paths):
        dims = _mlp_dims(path) if model == "mlp" else _MEGATRON_GPT.get(_leaf_name(path), ())
        stacked = max(len(shapes[k]) - len(dims), 0) if shapes is not None and dims else 0
        out[path] = P(*(None,) * stacked, *(axis if d == 0 else None for d in dims))
    return out


def _check_model_parallel(run: RunConfig, mp: int, specs: dict[str, Any],
                          shapes: dict[str, tuple[int, ...]]) -> None:
    """A ValueError naming parallel_config.model_parallel when it does not divide a dimension
    Megatron's layout cuts over it (the parameter_plan it makes is the config's, not the
    user's: its own error named a parameter_plan nobody wrote), or a GPT's heads (the
    column cut of the fused qkv projection would split a head between devices)."""
    heads = getattr(run.model.config, "heads", None) if run.model.name != "mlp" else None
    if heads is not None and heads % mp:
        raise ValueError(
            f"{run.source}: parallel_config.model_parallel={mp} does not divide model.heads="
            f"{heads}: Megatron's layout gives each device whole heads; use a model_parallel "
            "that divides the heads (and 3 x d_model, the MLP width and vocab), or change "
            "them.")
    for path, spec in specs.items():
        for dim, entry in enumerate(spec):
            if entry is not None and shapes[path][dim] % mp:
                raise ValueError(
                    f"{run.source}: parallel_config.model_parallel={mp} does not divide dim "
                    f"{dim} of {path} (shape {shapes[path]}), which Megatron's layout cuts "
                    f"over it; use a model_parallel that divides the model's cut dimensions "
                    "(heads, 3 x d_model, the MLP width and vocab for a GPT), or change them.")


def _leaf_name(path: str) -> str:
    parts = [p for p in path.split("/") if p != "value"]  # nnx: ".../wqkv/value"
    return parts[-1]


def _mlp_dims(path: str) -> tuple:
    match = re.search(r"(\d+)/(w|b)$", path)
    if match is None:
        return ()
    layer, kind = int(match.group(1)), match.group(2)
    if layer % 2 == 0:  # column-parallel: the output features
        return (None, 0) if kind == "w" else (0,)
    return (0, None) if kind == "w" else ()  # row-parallel; its bias follows the all-reduce


# ---- planning -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlannedRun:
    """What `plan_run` made: the plan and how it was asked for."""

    plan: Any                 # jaxpar.Plan
    mode: str                 # the planning mode (PLAN_MODES)
    sizes: tuple[int, ...]    # the mesh's axis sizes and names
    names: tuple[str, ...]
    hardware: str
    problem: Problem
    model: ModelSpec
    seconds: float            # planning wall time


def plan_run(run: RunConfig, mode: str | None = None, devices: int | None = None,
             hardware: str | None = None) -> PlannedRun:
    """Plan the config's training step over an AbstractMesh: no devices used, nothing run.

    The step goes through `jaxpar.AutoParallel` with the config's context, so what is fixed
    before the search (the batch per the dataset strategy, replicated parameters in semi_auto,
    the parallel optimizer's second round) is what a training run gets. semi_auto with
    parallel_config.model_parallel k > 1 fixes Megatron's layout of the weights over the "mp"
    axis and the batch over "dp".

    Args:
      run: the run config.
      mode: a planning mode (PLAN_MODES) instead of the config's.
      devices: plan for this many devices instead of the config's (see `RunConfig.mesh_axes`);
        may exceed the devices of this machine.
      hardware: a hardware profile instead of the config's.

    Returns:
      A PlannedRun with the Plan (`.plan.cost`, `.plan.explain()`, `.plan.save(path)`).

    Example:
      >>> planned = plan_run(load_run_config("configs/gpt_small_auto_parallel.yaml"), devices=64)
      >>> planned.plan.layout, planned.plan.cost.total_s
    """
    from jax.sharding import AbstractMesh, AxisType

    mode = run.plan_mode(mode)
    sizes, names = run.mesh_axes(devices, mode)
    hw = run.hardware_name(hardware)
    mesh = AbstractMesh(sizes, names, axis_types=(AxisType.Auto,) * len(sizes))
    problem = build_problem(run)
    start = time.perf_counter()
    mp = run.tensor_parallel(mode)
    params = [(p, shape) for p, shape, owner in zip(problem.paths, problem.shapes,
                                                    problem.owners, strict=True) if owner == 0]
    megatron = tensor_parallel_specs(run.model.name, [p for p, _ in params],
                                     shapes=[shape for _, shape in params]) if mp > 1 else None
    if megatron:
        _check_model_parallel(run, mp, megatron, dict(zip(problem.paths, problem.shapes,
                                                          strict=True)))
    try:
        plan, hw = _planned(run, problem, mode, mesh, hw, megatron, mp, sizes, names)
    except ValueError as err:  # what the config set (a budget, a strategy file, a shard size)
        # named with the file it is in
        if str(err).startswith(f"{run.source}:"):
            raise
        raise ValueError(f"{run.source}: {err}") from None
    return PlannedRun(plan, mode, sizes, names, hw, problem, run.model,
                      time.perf_counter() - start)


def _planned(run: RunConfig, problem, mode: str, mesh, hw: str, megatron, mp: int,
             sizes: tuple, names: tuple) -> tuple:
    """plan_run's plan and the hardware its costs are priced under."""
    from jax.sharding import PartitionSpec as P

    from jaxpar.auto_parallel import AutoParallel

    net = AutoParallel(problem.step, "semi_auto" if mode == "data_parallel" else mode,
                       mesh=mesh, hardware=hw, donate_argnums=(0, 1), context=run.context,
                       parameter_plan=megatron)
    ctx = run.context
    if mp > 1 and not ctx.full_batch and ctx.dataset_strategy == "data_parallel":
        data = tuple(a for a in names if a != TP_AXIS)
        ways = math.prod(n for n, a in zip(sizes, names, strict=True) if a in data)
        batches = [shape[0] for shape, owner in zip(problem.shapes, problem.owners,
                                                    strict=True) if owner >= 2]
        if any(b % ways for b in batches):
            warnings.warn(f"{run.source}: the batch of {batches[0]} does not divide over the "
                          f"{ways} data-parallel devices ({' x '.join(data)}) beside "
                          f"model_parallel={mp}, so every device computes the whole batch; use "
                          f"a batch divisible by {ways}, or a device count that makes it so.",
                          stacklevel=2)
        net.dataset_strategy(tuple(P(data) if b % ways == 0 else P() for b in batches))
    plan = net.plan(*problem.args)
    saved = ctx.strategy_ckpt_load_file
    if saved and (plan.hardware != hw or plan.search_mode != net.search_mode):
        warnings.warn(f"{run.source}: the plan comes from strategy_ckpt_load_file={saved!r} "
                      f"as it was saved ({plan.search_mode}, priced under {plan.hardware}); "
                      f"the search mode and hardware asked for ({net.search_mode}, {hw}) do "
                      "not plan it again: take strategy_ckpt_load_file out to plan anew.",
                      stacklevel=2)
        hw = plan.hardware  # what its costs are priced under, reported as such
    return plan, hw
