"""`jaxpar.AutoParallel`: MindSpore's AutoParallel for JAX training steps and Flax nnx modules.

AutoParallel(network, parallel_mode) wraps a function (typically a training step
`step(params, opt_state, *batch) -> (params, opt_state, loss)`), a function some of whose
arguments are Flax nnx objects (`step(model, optimizer, *batch)`, also in a tuple, list or
dict, updated in place as under `nnx.jit`), or an nnx Module (its `__call__`). Calling it
plans the program for these argument shapes (once per signature), compiles it and runs it;
`.plan(*args)` and `.lower(*args)` work as for `jaxpar.shard`.

How the four modes fix the arguments before the search (`batch` = the arguments that are not
carried state: not returned in their own place, not nnx objects; see `batch_argnums`):

  semi_auto             batch per the dataset strategy (default "data_parallel": the batch
                        dimension over every device), every parameter replicated unless
                        `parameter_plan` says otherwise, the user's own sharding constraints
                        kept; sharding propagation plans the rest. Data parallel by default.
  sharding_propagation  the same fixed inputs, propagated outward.
  recursive_programming and dynamic_programming
                        nothing fixed but what the user fixed (parameter_plan, an explicit
                        `dataset_strategy(...)`), the search decides the rest.

Then, when optimizer parallel is on (`hsdp` or the context's enable_parallel_optimizer),
a second round cuts optimizer state (and at level3 the parameters) further over the axes each
parameter's plan leaves unused (`jaxpar.train.optimizer_parallel`).

Defaults come from the parallel context at construction (`set_auto_parallel_context`):
device_num (the mesh size), mem_coeff, memory_budget, hardware, dataset_strategy/full_batch,
enable_parallel_optimizer and parallel_optimizer_config, gradient_fp32_sync,
strategy_ckpt_load_file/save_file and pipeline_stages.
"""

from __future__ import annotations

import inspect
import json
import numbers
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxpar import strategy as strat
from jaxpar.api import (
    ShardedFunction,
    _name,
    array_arguments,
    carried_pairs,
    check_mesh,
    context_mesh,
    leaf_owners,
    optimizer_followers,
    positional_arguments,
    sharded,
    signature,
    trace_settings,
)
from jaxpar.context import ParallelContext, current_context
from jaxpar.ir import arg_paths
from jaxpar.ir.trace import arg_names, shape_only
from jaxpar.plan import Plan, check_writable, load_plans, save_plans
from jaxpar.spec import MeshInfo, Spec
from jaxpar.train.data import batch_spec
from jaxpar.train.optimizer_parallel import (
    check_hsdp_args,
    check_shard_size,
    optimizer_parallel_specs,
)

PARALLEL_MODES = ("semi_auto", "sharding_propagation", "recursive_programming",
                  "dynamic_programming")
_SEARCH = {"semi_auto": "sharding_propagation"}
_SEEDED = ("semi_auto", "sharding_propagation")  # modes that fix the batch and parameters
SCHEDULERS = ("1f1b", "gpipe")
PARAM_FILE_FORMAT = "jaxpar-param-strategy"


class StrategyFileError(KeyError, ValueError):
    """A strategy-file path MindSpore refuses with KeyError (not absolute, not .json); also a
    ValueError, so either except clause catches it."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass
class _Options:
    """What the methods set; read when a signature is first planned."""

    dataset_strategy: Any = None          # None: the mode's default (module docstring)
    hsdp: tuple[int, int, str] | None = None  # (shard_size, threshold KB, level)
    # What set hsdp and load_operator_file, as errors name them ({}: the settings, the path)
    hsdp_by: str = "hsdp({})"
    load_by: str = "load_operator_strategy_file({!r})"
    save_by: str = "save_operator_strategy_file"
    gradients_mean: bool = False
    fp32_communication: bool = True
    load_operator_file: str = ""
    save_operator_file: str = ""
    load_param_file: str = ""
    save_param_file: str = ""
    comm_fusion: dict = field(default_factory=dict)
    init_in_compile: bool = True
    pipeline: dict = field(default_factory=lambda: {"stages": 1})


class AutoParallel:
    """Plan, compile and run `network` over a device mesh, MindSpore style.

    Args:
      network: a function of arrays/pytrees (a training step, a forward pass), a function some
        of whose arguments are nnx objects or tuples, lists or dicts holding them (updated in
        place, as `nnx.jit` does), or an nnx Module (its `__call__`; its state is the first
        argument, named "model").
      parallel_mode: "semi_auto", "sharding_propagation", "recursive_programming" or
        "dynamic_programming" (see the module docstring). None (the default): the context's,
        as MindSpore reads it: its search_mode under parallel_mode "auto_parallel", else
        semi_auto.
      mesh: the device mesh; default `make_mesh(device_num)` from the context (all devices);
        a device_num above this machine's devices gives `abstract_mesh(device_num)`: the
        network is planned for that cluster (`.plan`, strategy files) and cannot run here.
        An AbstractMesh plans for any number of devices (`.plan` only; calls refuse).
      parameter_plan: {parameter path: strategy}; an unknown path is an error listing the
        closest known paths.
      hardware, level, mem_coeff, memory_budget: as for `jaxpar.shard`; None takes the context's.
      batch_argnums: positions of the data arguments (dataset_strategy applies to them),
        counted in the network's own arguments (`train_step(model, optimizer, x, y)`: x is
        2; an nnx Module's: its call's). None: the arguments that are neither carried state
        nor nnx objects; for a function with no carried state, every argument but the first
        (`apply(params, *batch)`).
      donate_argnums: arguments whose buffers a call may reuse, counted so too (nnx objects'
        state always is: it is replaced in place).
      context: the ParallelContext to read defaults from; default the current one
        (`set_auto_parallel_context`).

    The arguments but `context` are attributes of the same names; one set later
    (`net.mesh = jaxpar.make_mesh(4)`) is checked as here, and the next call plans again.

    Example:
      >>> net = jaxpar.AutoParallel(train_step, parallel_mode="recursive_programming")
      >>> net.hsdp(optimizer_level="level1")
      >>> params, opt_state, loss = net(params, opt_state, tokens, targets)
      >>> print(net.plan(params, opt_state, tokens, targets).explain())
    """

    def __init__(self, network, parallel_mode: str | None = None, *,
                 mesh: Mesh | AbstractMesh | None = None, parameter_plan: dict | None = None,
                 hardware=None, level: int = 0, mem_coeff: float | None = None,
                 memory_budget=None, batch_argnums: int | tuple[int, ...] | None = None,
                 donate_argnums: int | tuple[int, ...] = (),
                 context: ParallelContext | None = None):
        _check_network(network)
        if parallel_mode is not None:
            _check_mode(parallel_mode, " or None for the context's")
        if context is not None and not isinstance(context, ParallelContext):
            raise TypeError(f"AutoParallel(context={context!r}): pass a jaxpar.ParallelContext "
                            "or None for the current one.")
        ctx = context if context is not None else current_context()
        if parallel_mode is None:
            parallel_mode = ctx.search_mode if ctx.parallel_mode == "auto_parallel" else \
                "semi_auto"
        self.network, self.parallel_mode, self.context = network, parallel_mode, ctx
        self.mesh = _checked_mesh(mesh if mesh is not None else context_mesh(ctx))
        self.parameter_plan = _checked_parameter_plan(parameter_plan)
        self._param_files: dict[str, str] = {}  # parameter_plan keys a param strategy file
                                                # gave -> that file
        self.hardware = hardware if hardware is not None else (ctx.hardware or "cpu")
        self.level = level
        self.mem_coeff = ctx.mem_coeff if mem_coeff is None else mem_coeff
        self.memory_budget = ctx.memory_budget if memory_budget is None else memory_budget
        self.batch_argnums = _argnums("batch_argnums", batch_argnums)
        self.donate_argnums = _argnums("donate_argnums", donate_argnums) or ()
        self._opts = _options_from_context(ctx)
        if self._opts.hsdp is not None:  # the context's shard size, checked for this mesh now
            check_shard_size(self._opts.hsdp[0], MeshInfo.of(self.mesh),
                             "parallel_optimizer_config['optimizer_weight_shard_size']")
        self._functions: dict[Any, _Program] = {}
        self._check_now()
        k = ctx.grad_accumulation_step
        built = getattr(network, "grad_accumulation_step", None)
        if k > 1 and built is None:
            warnings.warn(
                f"set_auto_parallel_context(grad_accumulation_step={k}) does not change "
                f"AutoParallel({_name(network)}): it runs the step as written. Build the step "
                "with jaxpar.make_train_step(loss_fn, optimizer), which reads the key and "
                f"accumulates the gradients of {k} microbatches.", stacklevel=2)
        elif built is not None and k != 1 and built != k:  # read when the step was built
            warnings.warn(
                f"set_auto_parallel_context(grad_accumulation_step={k}) does not change "
                f"AutoParallel({_name(network)}): the step was built by make_train_step with "
                f"grad_accumulation_step={built} (the context's when it was built) and runs "
                f"so. Build it after setting the context, or pass grad_accumulation_step={k} "
                "to make_train_step.", stacklevel=2)
        pc = ctx.parallel_config
        dp, mp = pc.get("data_parallel"), pc.get("model_parallel", 1)
        if parallel_mode == "semi_auto" and not self.parameter_plan and (
                mp > 1 or dp not in (None, self.mesh.size)):
            warnings.warn(
                f"The parallel context's parallel_config={pc} does not lay out "
                f"AutoParallel({_name(network)}): data_parallel and model_parallel are read by "
                "`jaxpar plan`'s run configs, which know their model's weights (Megatron "
                "layouts). Here semi_auto places the batch per the dataset strategy over the "
                f"mesh's {self.mesh.size} devices and replicates every parameter that "
                "parameter_plan does not cut: give the model parallel layout there, or let the "
                "search choose (parallel_mode='auto_parallel').", stacklevel=2)

    def __setattr__(self, name: str, value) -> None:
        """A setting changed after construction (`net.mesh = jaxpar.make_mesh(4)`) is checked
        as the constructor checks it, and the programs planned before are dropped: the next
        call plans again."""
        if name in _SETTINGS and "_functions" in self.__dict__:
            value = self._checked(name, value)
            self._functions.clear()
        super().__setattr__(name, value)

    def _checked(self, name: str, value):
        if name == "network":
            _check_network(value)
        elif name == "parallel_mode":
            _check_mode(value, "")
        elif name == "mesh":  # None: the context's, as the constructor takes it
            value = _checked_mesh(value if value is not None else context_mesh(self.context))
            if self._opts.hsdp is not None:
                check_shard_size(self._opts.hsdp[0], MeshInfo.of(value))  # names hsdp's
        elif name == "parameter_plan":
            value = _checked_parameter_plan(value)
            self._param_files.clear()
        elif name in ("batch_argnums", "donate_argnums"):
            value = _argnums(name, value) or (None if name == "batch_argnums" else ())
        elif name in ("hardware", "level", "mem_coeff", "memory_budget"):
            self._check_settings(**{name: value})
        return value

    # -- calling ---------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        program, flat = self._program(positional_arguments(self.network, args, kwargs))
        out = program.sharded(*flat)
        return program.unwrap(out, program.changed())

    def plan(self, *args, **kwargs) -> Plan:
        """The plan for these arguments (arrays, ShapeDtypeStructs or nnx objects)."""
        program, flat = self._program(positional_arguments(self.network, args, kwargs))
        return program.sharded.plan(*flat)

    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """The lowered program for these arguments (call `.compile()` on it)."""
        program, flat = self._program(positional_arguments(self.network, args, kwargs))
        return program.sharded.lower(*flat)

    # -- MindSpore's methods -------------------------------------------------------------------
    def hsdp(self, shard_size: int = -1, threshold: int = 64,
             optimizer_level: str = "level1") -> None:
        """Optimizer parallel: level1 cuts optimizer state over the data-parallel replicas of
        each parameter, level2 also its gradient (a reduce-scatter), level3 also the parameter
        (FSDP). threshold: KB under which tensors stay as planned; shard_size: the group size
        (-1: every data-parallel axis). See `jaxpar.train.optimizer_parallel`."""
        check_hsdp_args(shard_size, threshold, optimizer_level)
        check_shard_size(shard_size, MeshInfo.of(self.mesh))
        self._set(hsdp=(shard_size, threshold, optimizer_level), hsdp_by="hsdp({})")

    def dataset_strategy(self, config) -> None:
        """How the data arguments are cut: "data_parallel" (batch dim over every device),
        "full_batch" (replicated: each process feeds the whole batch), or a tuple with one
        strategy per data leaf (split counts, e.g. ((8, 1), (8,)), or PartitionSpecs)."""
        if isinstance(config, str):
            if config not in ("data_parallel", "full_batch"):
                raise ValueError(f"dataset_strategy(config={config!r}): a str config must be "
                                 "'data_parallel' or 'full_batch'.")
        elif isinstance(config, tuple | list):
            if not config:
                raise ValueError("dataset_strategy(config=()): give one strategy per data "
                                 "input, e.g. ((8, 1), (8,)).")
            for i, entry in enumerate(config):
                _check_dataset_entry(i, entry)
            config = tuple(tuple(e) if isinstance(e, list) else e for e in config)
        else:
            raise TypeError(f"dataset_strategy(config={config!r}): must be 'data_parallel', "
                            "'full_batch' or a tuple of strategies, one per data input.")
        self._set(dataset_strategy=config)

    def save_operator_strategy_file(self, file_path: str) -> None:
        """Save the plans made from now on (and any made already) as JSON at file_path, an
        absolute .json path: one per input signature the network is called with, the file
        rewritten with all of them as each is made. `load_operator_strategy_file` reproduces
        the same programs."""
        path = _strategy_path("save_operator_strategy_file", file_path)
        # now, not at the first call: a call that plans raised, the next ran without a file
        check_writable(path, "save_operator_strategy_file: file_path")
        self._opts.save_operator_file = path
        self._opts.save_by = "save_operator_strategy_file"
        self._save_operator_plans()

    def load_operator_strategy_file(self, file_path: str) -> None:
        """Use the plans saved at file_path (absolute .json) instead of searching: for each
        input signature, the plan made for it. A file with no plan for the program being
        built (another function, shapes or mesh), or not a jaxpar plan, is refused when the
        program is built."""
        path = _strategy_path("load_operator_strategy_file", file_path)
        if not Path(path).is_file():
            raise ValueError(f"load_operator_strategy_file(file_path={path!r}): no such file.")
        self._set(load_operator_file=path, load_by="load_operator_strategy_file({!r})")

    def save_param_strategy_file(self, file_path: str) -> None:
        """Save the planned strategy of every parameter (carried state) as JSON at file_path:
        {path: PartitionSpec entries} with the mesh; `load_param_strategy_file` reads it back as
        a parameter_plan."""
        if not isinstance(file_path, str):
            raise TypeError(f"save_param_strategy_file(file_path={file_path!r}): must be a str.")
        check_writable(os.path.abspath(file_path), "save_param_strategy_file: file_path")
        self._opts.save_param_file = os.path.abspath(file_path)
        for program in self._functions.values():
            program.save_param_file(self._opts.save_param_file)

    def load_param_strategy_file(self, file_path: str) -> None:
        """Fix parameters to the strategies a param strategy file holds (same mesh)."""
        if not isinstance(file_path, str):
            raise TypeError(f"load_param_strategy_file(file_path={file_path!r}): must be a str.")
        entries = read_param_strategy_file(file_path, MeshInfo.of(self.mesh))
        self.parameter_plan.update(entries)
        self._param_files.update(dict.fromkeys(entries, os.path.abspath(file_path)))
        self._functions.clear()

    def enable_gradients_mean(self) -> None:
        """Gradients are the mean over data-parallel replicas (MindSpore's gradients_mean).
        A jaxpar program is the global computation, so a mean loss already gives mean
        gradients; this is recorded for steps built with `jaxpar.train.make_train_step`
        (`AutoParallel.gradients_mean`)."""
        self._set(gradients_mean=True)

    @property
    def gradients_mean(self) -> bool:
        return self._opts.gradients_mean

    @property
    def search_mode(self) -> str:
        """The jaxpar search mode `parallel_mode` plans with (semi_auto: sharding_propagation
        from the fixed batch and parameters)."""
        return _SEARCH.get(self.parallel_mode, self.parallel_mode)

    def enable_fp32_communication(self) -> None:
        """Reduce bf16/f16 partial sums in float32 (see `jaxpar.shard(fp32_communication)`)."""
        self._set(fp32_communication=True)

    def disable_gradient_fp32_sync(self) -> None:
        """Reduce 16-bit partial sums in their own dtype (half the bytes)."""
        self._set(fp32_communication=False)

    def comm_fusion(self, config: dict) -> None:
        """MindSpore's communication fusion config, checked and recorded. XLA's own combiner
        passes fuse collectives in every jaxpar program; this config does not tune them yet."""
        if not isinstance(config, dict):
            raise TypeError(f"comm_fusion(config={config!r}): must be a dict such as "
                            "{'allreduce': {'mode': 'auto', 'config': None}}.")
        try:
            checked = ParallelContext(comm_fusion=config).comm_fusion
        except (TypeError, ValueError) as err:  # its words name the context's setter
            raise type(err)(str(err).replace("set_auto_parallel_context(comm_fusion",
                                             "AutoParallel.comm_fusion(config")) from None
        self._opts.comm_fusion = checked

    def no_init_parameters_in_compile(self) -> None:
        """Plan and compile without parameter values: jaxpar never needs them (`.plan` and
        `.lower` take ShapeDtypeStructs), so this only records the request."""
        self._opts.init_in_compile = False

    def pipeline(self, stages: int = 1, output_broadcast: bool = False,
                 interleave: bool = False, scheduler: str = "1f1b") -> None:
        """Pipeline parallel settings, checked as MindSpore does. Only stages=1 runs in this
        version: more stages raise NotImplementedError."""
        if isinstance(stages, bool) or not isinstance(stages, int):
            raise TypeError(f"pipeline(stages={stages!r}): must be an int.")
        if stages <= 0:
            raise ValueError(f"pipeline(stages={stages}): must be > 0.")
        for name, value in (("output_broadcast", output_broadcast), ("interleave", interleave)):
            if not isinstance(value, bool):
                raise TypeError(f"pipeline({name}={value!r}): must be a bool.")
        if not isinstance(scheduler, str):
            raise TypeError(f"pipeline(scheduler={scheduler!r}): must be a str.")
        if scheduler not in SCHEDULERS:
            raise ValueError(f"pipeline(scheduler={scheduler!r}): must be one of "
                             f"{list(SCHEDULERS)}.")
        _no_pipeline(stages)
        self._set(pipeline={"stages": stages, "output_broadcast": output_broadcast,
                            "interleave": interleave, "scheduler": scheduler})

    # -- internals -----------------------------------------------------------------------------
    def _set(self, **changes) -> None:
        for key, value in changes.items():
            setattr(self._opts, key, value)
        self._functions.clear()  # plans depend on these: plan again

    def _check_now(self) -> None:
        _no_pipeline(self.context.pipeline_stages)
        self._check_settings()

    def _check_settings(self, **changed) -> None:
        """shard()'s checks of level, mem_coeff, memory_budget and hardware (before any
        tracing), of these settings with `changed` in place of theirs, naming AutoParallel."""
        settings = {"level": self.level, "hardware": self.hardware, "mem_coeff": self.mem_coeff,
                    "memory_budget": self.memory_budget} | changed
        sharded(self.network, mesh=self.mesh, caller="AutoParallel", **settings)

    def _program(self, args: tuple) -> tuple[_Program, tuple]:
        pure, flat_args, unwrap = _purify(self.network, args)
        leaves, tree = jax.tree_util.tree_flatten(flat_args)
        flat_args, leaves = array_arguments(pure, flat_args, leaves, tree)
        key = (tree, signature(leaves), trace_settings(), getattr(pure, "graphdefs", None))
        if key not in self._functions:
            program = self._build(pure, flat_args, unwrap)
            program.pure = pure  # traced once; it records what its calls change
            # saved before it is kept: where the file cannot be written, every call says so
            # (kept first, the next call ran the program and saved nothing)
            self._save_operator_plans(program)
            self._functions[key] = program
        program = self._functions[key]
        program.unwrap = unwrap
        return program, flat_args

    def _build(self, pure, args: tuple, unwrap) -> _Program:
        o = self._opts
        paths = arg_paths(pure, args)
        shapes = [tuple(x.shape) for x in jax.tree_util.tree_leaves(args)]
        n_state = getattr(pure, "n_state", 0)
        user = getattr(pure, "jaxpar_args", None) or _UserArgs(
            arg_names(pure, len(args)), {i: i for i in range(len(args))}, frozenset())
        donate = tuple(range(n_state)) + tuple(  # (an nnx object's state is donated anyway)
            user.place[i] for i in self._positions("donate_argnums", user)
            if i not in user.objects)
        owner = leaf_owners(args)
        # From shapes alone: an array placed on Explicit axes would type the trace with its
        # sharding (JAX refused the step's ops there; jaxpar.shard moves such arguments).
        if n_state:  # nnx objects hold the state: the other arguments are data (a block's
            # input was paired with its output of the same shape, and its batch held whole)
            carried = {i for i, o in enumerate(owner) if o < n_state}
        else:
            carried = {i for i, _ in carried_pairs(args, jax.eval_shape(
                pure, *jax.tree_util.tree_map(shape_only, args)))}
        state = set(range(n_state)) | {owner[i] for i in carried}
        fixed = self._fixed(args, paths, shapes, self._batch_positions(args, user, state))
        sharded = self._shard(pure, fixed, donate)
        note = None if o.hsdp is None else _hsdp_note(*o.hsdp)
        if o.load_operator_file:
            sharded = sharded._loaded(_load_plans(o.load_operator_file, o.load_by))
            _check_loaded(sharded, args, o.load_operator_file, o.load_by)
            loaded = sharded.plan(*args)
            made = [n for n in loaded.notes if n.startswith(_HSDP_NOTE)]
            if o.hsdp is not None and made and note not in made:
                hsdp = o.hsdp_by.format(f"shard_size={o.hsdp[0]}, threshold={o.hsdp[1]}, "
                                        f"optimizer_level={o.hsdp[2]!r}")
                raise ValueError(
                    f"{hsdp} and {o.load_by.format(o.load_operator_file)}: the plan was saved "
                    f"under other optimizer parallel settings ({made[0][len(_HSDP_NOTE):]}), "
                    "and a loaded plan is used as it is. Set them as they were when the plan "
                    "was saved, or drop one of the two.")
            if o.hsdp is not None and not made and self._optimizer_parallel(
                    loaded, paths, shapes, args, carried):
                hsdp = o.hsdp_by.format(f"optimizer_level={o.hsdp[2]!r}")
                raise ValueError(
                    f"{hsdp} and {o.load_by.format(o.load_operator_file)}: the loaded plan does "
                    "not cut the optimizer state as optimizer parallel asks, and a loaded plan "
                    "is used as it is. Save the plan with it on, or drop one of the two.")
        elif o.hsdp is not None:
            first = sharded.plan(*args)
            more = self._optimizer_parallel(first, paths, shapes, args, carried)
            if more:
                if o.hsdp[2] != "level3":  # ZeRO-1/2: the parameters keep their plan (searched
                    # again with only their state fixed, they were cut to match it: FSDP)
                    params = set(optimizer_followers(paths, shapes).values())
                    more = {**{i: first.flat_in_specs[i] for i in params
                               if paths[i] not in fixed}, **more}
                fixed = {**fixed, **{paths[i]: s.to_pspec() for i, s in more.items()}}
                sharded = self._shard(pure, fixed, donate)
        state_leaves = [i for i in range(len(owner)) if owner[i] < n_state or i in carried]
        program = _Program(sharded, unwrap, paths, n_state, state_leaves, note)
        if o.save_operator_file:
            program.plan_for(args)  # made now: _program saves every signature's plan
        if o.save_param_file:
            program.save_param_file(o.save_param_file, args)
        return program

    def _save_operator_plans(self, new: _Program | None = None) -> None:
        """Every signature's plan made so far (and `new`'s, a program not kept yet) into the
        operator strategy file, if one is set (save_plans: one plan as Plan.save writes it,
        several in one file)."""
        path = self._opts.save_operator_file
        if not path:
            return
        plans = [p for program in [*self._functions.values(), *([new] if new else [])]
                 if (p := program.plan_for(None)) is not None]
        if plans:
            save_plans(plans, path, self._opts.save_by)

    def _optimizer_parallel(self, plan: Plan, paths: list[str], shapes: list[tuple],
                            args: tuple, carried: set[int]) -> dict[int, Spec]:
        """{leaf: spec} hsdp adds to `plan` (optimizer_parallel_specs; empty: none); carried:
        the leaves the step returns in place (its parameters, at level3, with or without
        optimizer state)."""
        o = self._opts
        sizes = [x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(args)]
        follows = optimizer_followers(paths, shapes)
        return optimizer_parallel_specs(plan.flat_in_specs, shapes, sizes, follows,
                                        MeshInfo.of(self.mesh), o.hsdp[2], o.hsdp[1], o.hsdp[0],
                                        params=carried - set(follows))

    def _shard(self, pure, fixed: dict[str, Any], donate: tuple[int, ...]) -> ShardedFunction:
        with warnings.catch_warnings():  # _check_settings warned of these settings already
            warnings.simplefilter("ignore", UserWarning)
            return sharded(pure, parameter_plan=fixed or None, level=self.level, mesh=self.mesh,
                           search_mode=self.search_mode,
                           hardware=self.hardware, memory_budget=self.memory_budget,
                           mem_coeff=self.mem_coeff, donate_argnums=donate,
                           fp32_communication=self._opts.fp32_communication,
                           caller="AutoParallel")

    def _fixed(self, args: tuple, paths: list[str], shapes: list[tuple],
               batch: set[int]) -> dict[str, Any]:
        """{exact leaf path: strategy} for every leaf fixed before the search; batch: the
        positions of the data arguments."""
        mesh = self.mesh
        try:
            planned = strat.parse_parameter_plan(self.parameter_plan, paths, shapes, mesh)
        except ValueError as err:  # a key from a param strategy file: said so
            key = next((k for k in self._param_files
                        if str(err).startswith(f"parameter_plan[{k!r}] matches no parameter")),
                       None)
            if key is None:
                raise
            saved = list(dict.fromkeys(k.split("/")[0] for k in self._param_files))
            names = list(dict.fromkeys(p.split("/")[0] for p in paths))
            raise ValueError(
                f"load_param_strategy_file({self._param_files[key]!r}): its entry {key!r} "
                f"matches no parameter of {_name(self.network)}. The file's paths begin with "
                f"the names of the arguments of the step that saved it "
                f"({', '.join(map(repr, saved))}); this one's are {', '.join(map(repr, names))}. "
                "Load it into a step whose arguments are named alike.") from None
        fixed = {paths[i]: s.to_pspec() for i, s in planned.items()}
        owner = leaf_owners(args)
        config = self._dataset_config()
        if config is not None:
            leaves = [i for i in range(len(paths)) if owner[i] in batch]
            if config == "data_parallel":  # a raw PRNG key (uint32[2]) is no batch: whole
                dtypes = [getattr(x, "dtype", None) for x in jax.tree_util.tree_leaves(args)]
                keys = [i for i in leaves if shapes[i] == (2,) and dtypes[i] == np.uint32]
                fixed.update((paths[i], PartitionSpec()) for i in keys if paths[i] not in fixed)
                leaves = [i for i in leaves if i not in keys]
            flat = jax.tree_util.tree_leaves(args)
            for i, spec in zip(leaves, _dataset_specs(config, [shapes[i] for i in leaves], mesh,
                                                      [paths[i] for i in leaves],
                                                      [flat[i] for i in leaves]), strict=True):
                if spec is not None and paths[i] not in fixed:
                    fixed[paths[i]] = spec
        if self.parallel_mode in _SEEDED:
            follows = optimizer_followers(paths, shapes)
            for i, path in enumerate(paths):  # parameters replicated unless planned
                if owner[i] not in batch and i not in follows and path not in fixed:
                    fixed[path] = PartitionSpec()
        return fixed

    def _dataset_config(self):
        """The dataset strategy in force for this mode (None: the search decides). The
        context's applies in every mode, but its default ("data_parallel") not in the
        searching ones on one process: there the search decides how to cut the batch."""
        if self._opts.dataset_strategy is not None:
            return self._opts.dataset_strategy
        config = "full_batch" if self.context.full_batch else self.context.dataset_strategy
        if self.parallel_mode in _SEEDED or jax.process_count() > 1 or \
                config != "data_parallel":
            return config
        return None

    def _positions(self, name: str, user: _UserArgs) -> tuple[int, ...]:
        """batch_argnums or donate_argnums (positions in the network's own arguments), each
        naming an argument; a ValueError names those that do not."""
        given = getattr(self, name) or ()
        bad = [i for i in given if i >= len(user.names)]
        if bad:
            raise ValueError(
                f"AutoParallel({name}={given}): {_name(self.network)} is called with "
                f"{len(user.names)} positional argument(s) ({', '.join(user.names)}), so {bad} "
                f"name(s) none; give positions from 0 to {len(user.names) - 1}.")
        return tuple(given)

    def _batch_positions(self, args: tuple, user: _UserArgs, state: set[int]) -> set[int]:
        """Positions of the data arguments: batch_argnums (in the network's own arguments),
        else those that are not state (nnx objects, carried), else all but the first."""
        if self.batch_argnums is not None:
            positions = self._positions("batch_argnums", user)
            objects = [i for i in positions if i in user.objects]
            if objects:
                raise ValueError(
                    f"AutoParallel(batch_argnums={self.batch_argnums}): "
                    f"{', '.join(user.names[i] for i in objects)} (position(s) {objects}) "
                    "is an nnx object, whose state is carried, not data; name the batch's "
                    "arguments.")
            return {user.place[i] for i in positions}
        if state:
            return {i for i in range(len(args)) if i not in state}
        return set(range(1, len(args)))


@dataclass
class _Program:
    """One planned signature: the sharded function and how to give results back."""

    sharded: ShardedFunction
    unwrap: Any
    paths: list[str]
    n_state: int
    state_leaves: list[int]
    note: str | None = None  # what the plans say of how they were made (hsdp's settings)
    pure: Any = None  # the function traced for this signature (_purify's)

    def changed(self):
        """Per group of nnx objects, whether the traced call changes their state (_changed);
        all True before it is traced."""
        return getattr(self.pure, "changed", None)

    def plan_for(self, args: tuple | None) -> Plan | None:
        """The plan for args, or (None) the one already made, if any."""
        if args is not None:
            plan = self.sharded.plan(*args)
        else:
            made = [c.plan for c in self.sharded._cache.values()]
            plan = made[0] if made else None
        if plan is not None and self.note and self.note not in plan.notes:
            plan.notes.append(self.note)  # saved with it: a reload knows hsdp made it
        return plan

    def save_param_file(self, path: str, args: tuple | None = None) -> None:
        plan = self.plan_for(args)
        if plan is None:
            return
        params = {self.paths[i]: plan.flat_in_specs[i].to_json() for i in self.state_leaves}
        mesh = {"names": list(plan.mesh.names), "sizes": list(plan.mesh.sizes)}
        Path(path).write_text(json.dumps({"format": PARAM_FILE_FORMAT, "mesh": mesh,
                                          "parameters": params}, indent=1))


def read_param_strategy_file(file_path: str, mesh: MeshInfo) -> dict[str, PartitionSpec]:
    """{parameter path: PartitionSpec} from a file `save_param_strategy_file` wrote."""
    try:
        data = json.loads(Path(file_path).read_text())
        if data.get("format") != PARAM_FILE_FORMAT:
            raise ValueError("not a jaxpar parameter strategy file")
        saved = MeshInfo(tuple(data["mesh"]["names"]), tuple(data["mesh"]["sizes"]))
        specs = {k: Spec.from_json(v).to_pspec() for k, v in data["parameters"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"load_param_strategy_file(file_path={file_path!r}): cannot read a "
                         f"parameter strategy file ({err}).") from None
    if saved != mesh:
        raise ValueError(f"load_param_strategy_file(file_path={file_path!r}): saved for mesh "
                         f"{saved.describe()}, not {mesh.describe()}.")
    return specs


# -- nnx objects ---------------------------------------------------------------------------------
def _purify(network, args: tuple):
    """(pure function, its arguments, unwrap): nnx objects (and the tuples, lists and dicts
    holding them: _holds_nnx) become their state, passed first and returned first (so they
    are carried state), and put back into the objects on return.
    Objects that share variables (one object passed twice, a teacher holding the student's
    layer) are split together, as nnx.jit does: a shared variable is one leaf, updated once.
    `pure.graphdefs` holds the objects' static structure (a module's train/eval mode among
    it): a program is planned per graphdef, as nnx.jit traces per graphdef."""
    from flax import nnx

    if isinstance(network, nnx.Module):
        return _module_call(network, args)
    objects = [i for i, a in enumerate(args) if _holds_nnx(a)]
    if not objects:
        return network, args, lambda out, changed=None: out
    names = arg_names(network, len(args))
    groups = [objects] if _shared([args[i] for i in objects]) else [[i] for i in objects]

    def node(g: list[int], of) -> Any:
        """The group's graph node: its one object, or {argument name: object}."""
        return of(g[0]) if len(g) == 1 else {names[i]: of(i) for i in g}

    graphdefs, states = zip(*(nnx.split(node(g, args.__getitem__)) for g in groups),
                            strict=True)
    others = [i for i in range(len(args)) if i not in objects]

    def pure(*xs):
        given = [jax.tree_util.tree_leaves(x) for x in xs[:len(groups)]]  # before nnx.merge,
        rebuilt = list(args)                         # whose Variables the call may update
        for g, gd, st in zip(groups, graphdefs, xs[:len(groups)], strict=True):
            live = nnx.merge(gd, st)
            for i in g:
                rebuilt[i] = live if len(g) == 1 else live[names[i]]
        for i, x in zip(others, xs[len(groups):], strict=True):
            rebuilt[i] = x
        out = network(*rebuilt)
        new = [nnx.state(node(g, rebuilt.__getitem__)) for g in groups]
        pure.changed = [_changed(old, st) for old, st in zip(given, new, strict=True)]
        return (*new, out)

    _sign(pure, ["_and_".join(names[i] for i in g) for g in groups] + [names[i] for i in others])
    pure.n_state, pure.graphdefs = len(groups), graphdefs
    pure.jaxpar_args = _UserArgs(names, {i: len(groups) + k for k, i in enumerate(others)},
                          frozenset(objects))

    def unwrap(out, changed=None):
        flags = [True] * len(groups) if changed is None else changed
        for g, new, flag in zip(groups, out[:len(groups)], flags, strict=True):
            obj = node(g, args.__getitem__)
            if flag or _donated(obj):
                nnx.update(obj, new)
        return out[len(groups)]

    return pure, (*states, *(args[i] for i in others)), unwrap


def _holds_nnx(arg) -> bool:
    """Whether an argument is an nnx object or a tuple, list or dict holding one (`(model,
    optimizer)`): split, carried and updated in place alike, as nnx.jit does (such objects in
    a container were traced as plain pytrees, and their new state dropped). The Variables of
    an nnx.State (functional nnx: `step(params, opt_state, ...)`) are no objects: a State is
    carried as a pytree."""
    from flax import nnx

    if nnx.graph.is_graph_node(arg):
        return True
    return any(nnx.graph.is_graph_node(x) and not isinstance(x, nnx.Variable) for x in
               jax.tree_util.tree_leaves(arg, is_leaf=nnx.graph.is_graph_node))


@dataclass(frozen=True)
class _UserArgs:
    """The arguments as the user passed them to a network holding nnx objects: their names,
    where each that is no nnx object sits among the pure function's (after the objects'
    states), and which are nnx objects. batch_argnums and donate_argnums count these."""

    names: list[str]
    place: dict[int, int]
    objects: frozenset[int]


def _shared(objects: list) -> bool:
    """Whether a variable (or a whole object) is reachable from two of the nnx objects."""
    from flax import nnx

    if len({id(o) for o in objects}) < len(objects):
        return True
    seen: set[int] = set()
    for obj in objects:
        mine = {id(v) for _, v in nnx.iter_graph(obj) if isinstance(v, nnx.Variable)}
        if mine & seen:
            return True
        seen |= mine
    return False


def _module_call(module, args: tuple):
    from flax import nnx

    graphdef, state = nnx.split(module)

    def pure(model, *xs):
        given = jax.tree_util.tree_leaves(model)  # before nnx.merge, whose Variables (the
        live = nnx.merge(graphdef, model)         # state's own) the call may update
        out = live(*xs)
        new = nnx.state(live)
        pure.changed = [_changed(given, new)]
        return new, out

    _sign(pure, ["model"] + [f"arg{i}" for i in range(len(args))])
    pure.n_state, pure.graphdefs = 1, (graphdef,)
    pure.jaxpar_args = _UserArgs([f"arg{i}" for i in range(len(args))],
                          {i: 1 + i for i in range(len(args))}, frozenset())

    def unwrap(out, changed=None):
        if changed is None or changed[0] or _donated(module):
            nnx.update(module, out[0])
        return out[1]

    return pure, (state, *args), unwrap


def _changed(old: list, new) -> bool:
    """Whether a traced call changed an object's state (BatchNorm statistics, an RNG count):
    `old`, the state's leaves as given (read before nnx.merge, which hands the call the
    state's own Variables); a variable it left alone hands back the very tracer it was given.
    Unchanged state is written back only where the call donated the old arrays: inside a
    caller's jax.jit or grad (nothing donated) nnx refuses to change an object made outside
    the trace (a forward pass changes nothing and plain nnx runs it so; changed state there
    is refused by nnx, as without jaxpar)."""
    leaves = jax.tree_util.tree_leaves(new)
    return len(old) != len(leaves) or any(x is not y for x, y in zip(old, leaves, strict=True))


def _donated(obj) -> bool:
    """Whether the call handed over the object's arrays (a direct call donates its state)."""
    from flax import nnx

    return any(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
               and x.is_deleted() for x in jax.tree_util.tree_leaves(nnx.state(obj)))


def _sign(fn, names: list[str]) -> None:
    """Give fn positional parameters with these names (leaf paths start with them)."""
    fn.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY) for n in names])


# -- helpers -------------------------------------------------------------------------------------
def _placed(x, spec: PartitionSpec, mesh: Mesh | AbstractMesh) -> bool:
    """Whether x is an array laid out on `mesh` as `spec` says already (shard_batch placed it,
    and warned of a batch the devices do not divide)."""
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding) or not isinstance(mesh, Mesh):
        return False
    try:
        return sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)
    except (TypeError, ValueError):
        return False


def _dataset_specs(config, shapes: list[tuple], mesh: Mesh | AbstractMesh,
                   paths: list[str] | None = None, leaves: list | None = None) -> list:
    """A PartitionSpec (or None) per data leaf (at `paths`; the arrays themselves, where
    given, as `leaves`) under a dataset strategy."""
    if config == "full_batch":
        return [PartitionSpec() for _ in shapes]
    if config == "data_parallel":
        specs, seen = [], set()  # batch sizes warned about: once each a call, not per input
        for k, shape in enumerate(shapes):
            spec = batch_spec(shape, mesh, warn=False) if shape else None
            if shape and shape[0] not in seen and not _placed(
                    leaves[k] if leaves else None, spec or PartitionSpec(), mesh):
                batch_spec(shape, mesh)  # warns of a batch the devices do not divide (as
                # shard_batch did already where it placed the array so)
            specs.append(spec)
            seen.update(shape[:1])
        return specs
    if len(config) != len(shapes):
        named = f" ({', '.join(paths)})" if paths else ""
        raise ValueError(f"dataset_strategy({config!r}): {len(config)} strategies for "
                         f"{len(shapes)} data inputs{named}; give one each. The data inputs "
                         "are the arguments not returned as carried state (nor nnx objects); "
                         "AutoParallel(batch_argnums=...) names them instead.")
    dummies = tuple(jax.ShapeDtypeStruct(shape, "float32") for shape in shapes)
    try:
        specs = strat.parse_in_strategy(tuple(config), dummies, mesh)
    except (TypeError, ValueError) as err:  # its words name in_strategy, which was not given
        raise type(err)(str(err).replace("in_strategy", "dataset_strategy")) from None
    return [None if spec is None else spec.to_pspec() for spec in specs]


def _check_dataset_entry(i: int, entry) -> None:
    if isinstance(entry, PartitionSpec | strat.Layout):
        return
    if not isinstance(entry, tuple | list):
        raise TypeError(f"dataset_strategy(config[{i}]={entry!r}): each entry must be a tuple "
                        "of ints (split counts), a PartitionSpec or a Layout.")
    for n in entry:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"dataset_strategy(config[{i}]={entry!r}): split counts must be "
                            "ints.")
        if n <= 0:
            raise ValueError(f"dataset_strategy(config[{i}]={entry!r}): split counts must be "
                             "positive.")


def _strategy_path(method: str, file_path) -> str:
    if not isinstance(file_path, str):
        raise TypeError(f"{method}(file_path={file_path!r}): must be a str.")
    if not os.path.isabs(file_path):
        raise StrategyFileError(f"{method}(file_path={file_path!r}): must be an absolute path, "
                                f"e.g. {os.path.abspath(file_path)!r}.")
    if not file_path.endswith(".json"):
        raise StrategyFileError(f"{method}(file_path={file_path!r}): must end in .json.")
    return file_path


def _load_plans(path: str, by: str) -> list[Plan]:
    """load_plans, its errors naming the setting `by` (_Options.load_by) that gave `path`."""
    try:
        return load_plans(path)
    except ValueError as err:
        raise ValueError(f"{by.format(path)}: {err}") from None


_HSDP_NOTE = "made with hsdp: "


def _hsdp_note(shard_size: int, threshold: int, level: str) -> str:
    """The plan note that says under which hsdp settings AutoParallel made it."""
    return f"{_HSDP_NOTE}optimizer_level={level!r}, shard_size={shard_size}, " \
        f"threshold={threshold} KB"


def _check_loaded(sharded: ShardedFunction, args: tuple, path: str, by: str) -> None:
    try:
        sharded.plan(*args)
    except ValueError as err:
        raise ValueError(f"{by.format(path)}: {err}") from None


# What AutoParallel's programs are planned from: setting one after construction plans again.
_SETTINGS = frozenset({"network", "parallel_mode", "mesh", "parameter_plan", "hardware", "level",
                       "mem_coeff", "memory_budget", "batch_argnums", "donate_argnums"})


def _check_network(network) -> None:
    if not callable(network):
        raise TypeError(f"AutoParallel(network={network!r}): network must be a function or "
                        "a Flax nnx Module.")


def _check_mode(mode, none: str) -> None:
    if not isinstance(mode, str):
        raise TypeError(f"AutoParallel(parallel_mode={mode!r}): must be a str, one "
                        f"of {list(PARALLEL_MODES)}{none}.")
    if mode not in PARALLEL_MODES:
        raise ValueError(f"AutoParallel(parallel_mode={mode!r}): must be one of "
                         f"{list(PARALLEL_MODES)}.")


def _checked_mesh(mesh) -> Mesh | AbstractMesh:
    if not isinstance(mesh, Mesh | AbstractMesh):
        raise TypeError(f"AutoParallel(mesh={mesh!r}): pass a jax.sharding.Mesh, e.g. "
                        "jaxpar.make_mesh(8), or an AbstractMesh to plan only.")
    check_mesh(mesh, "AutoParallel(mesh=...)")
    return mesh


def _checked_parameter_plan(plan) -> dict:
    if plan is not None and not isinstance(plan, dict):
        raise TypeError(f"AutoParallel(parameter_plan={plan!r}): must be a dict "
                        "mapping parameter paths to strategies, e.g. {'params/w': (1, 8)}.")
    return dict(plan or {})


def _argnums(name: str, value) -> tuple[int, ...] | None:
    if value is None:
        return None
    value = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(value, tuple | list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value):
        raise TypeError(f"AutoParallel({name}={value!r}): must be an int >= 0 or a tuple of them.")
    return tuple(value)


def _no_pipeline(stages: int) -> None:
    if stages > 1:
        raise NotImplementedError(
            f"pipeline stages={stages}: pipeline parallelism is not in this version of jaxpar "
            "(stages=1 only). Use data/tensor/optimizer parallel over the whole mesh.")


def _options_from_context(ctx: ParallelContext) -> _Options:
    o = _Options(gradients_mean=ctx.gradients_mean, fp32_communication=ctx.gradient_fp32_sync,
                 comm_fusion=dict(ctx.comm_fusion))
    if ctx.enable_parallel_optimizer:
        cfg = ctx.parallel_optimizer_config
        o.hsdp = (cfg["optimizer_weight_shard_size"], cfg["parallel_optimizer_threshold"],
                  "level1")
        o.hsdp_by = ("set_auto_parallel_context(enable_parallel_optimizer=True, "
                     "parallel_optimizer_config giving {})")
    if ctx.strategy_ckpt_load_file:
        o.load_operator_file = ctx.strategy_ckpt_load_file
        o.load_by = "set_auto_parallel_context(strategy_ckpt_load_file={!r})"
    if ctx.strategy_ckpt_save_file:
        o.save_operator_file = ctx.strategy_ckpt_save_file
        o.save_by = "set_auto_parallel_context(strategy_ckpt_save_file)"
    return o
