"""`jaxpar.shard`: MindSpore's functional shard() on jax.jit shardings.

shard(fn, in_strategy, ...) returns a ShardedFunction. Calling it (or .plan/.lower) validates the
strategies against the arguments, traces fn, plans every op by the chosen search, and runs the
replayed program under jax.jit with the planned shardings. Plans and compiled programs are
cached per input signature (pytree structure, shapes, dtypes, weak typing). Arguments are
pytrees of arrays or ShapeDtypeStructs; Python scalars become weakly typed 0-d arrays and
keyword arguments are placed by fn's signature, as under jax.jit. Called on tracers (inside
jax.jit, grad, vmap) the program is one more jitted call in the caller's trace.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import json
import logging
import numbers
import os
import types
import warnings
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core
from jax._src import mesh as jax_mesh
from jax._src.interpreters.batching import BatchTracer
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from jaxpar import progress
from jaxpar.analysis import compiled_bytes
from jaxpar.context import (
    ParallelContext,
    check_mem_coeff,
    check_memory_budget,
    current_context,
)
from jaxpar.cost.hardware import load_profile
from jaxpar.cost.manual import off_mesh
from jaxpar.cost.model import CostModel
from jaxpar.distributed import broadcast_bytes, check_joined, digest, gather_rows
from jaxpar.ir import arg_paths, build_graph, trace
from jaxpar.ir.trace import jax_cannot_hold
from jaxpar.lower.jit import build_callable, placeable, tracer_consts
from jaxpar.mesh import abstract_mesh, make_mesh, mesh_devices, planning_shape
from jaxpar.plan import Plan, as_run, build_plan
from jaxpar.search import paused_gc
from jaxpar.search.copies import moved_note
from jaxpar.search.dynamic import NotFound
from jaxpar.search.exact import dynamic_programming
from jaxpar.search.propagation import GraphIndex, out_spec
from jaxpar.search.regions import LOOPS
from jaxpar.search.semi import sharding_propagation
from jaxpar.spec import MeshInfo, Spec

log = logging.getLogger(__name__)

SEARCH_MODES = ("sharding_propagation", "recursive_programming", "dynamic_programming")
AUTOMATIC_MODES = ("recursive_programming", "dynamic_programming")  # heavy ops use every device
LEVELS = (0, 1, 2)


@dataclass(frozen=True)
class ShardOptions:
    in_strategy: Any
    out_strategy: Any
    parameter_plan: dict | None
    level: int
    mesh: Mesh
    search_mode: str
    hardware: Any
    memory_budget: float | None
    mem_coeff: float
    donate_argnums: tuple[int, ...]
    fp32_communication: bool = False


@dataclass
class _Compiled:
    """A plan and its jitted program, built on first use (`.plan()` needs none)."""

    plan: Plan
    build: Any  # build(traced) -> lower.jit.build_callable's function
    _jitted: Any = None
    _traced: Any = None
    shardings: tuple | None = None  # the inputs' NamedShardings, made on the first call
    called: bool = False  # the first call compiles
    agreed: bool = False  # several processes: they hold one plan (_agreed), checked once
    donate: tuple[int, ...] = ()  # the leaves whose buffers a call hands over
    # (value, NamedSharding) of each constant that is a tracer (lower.jit.tracer_consts): the
    # traced program takes them after the inputs, and every call is then a traced one.
    lifted: tuple = ()

    @property
    def jitted(self):
        if self._jitted is None:
            self._jitted = self.build(False)
        return self._jitted

    @property
    def traced(self):
        """The program for tracer inputs (build_callable's `traced`)."""
        if self._traced is None:
            self._traced = self.build(True)
        return self._traced


def shard(fn, in_strategy=None, out_strategy=None, parameter_plan=None, device=None, level=0, *,
          mesh: Mesh | None = None, search_mode: str | None = None, hardware=None,
          memory_budget: float | str | None = None, mem_coeff: float | None = None,
          donate_argnums: int | tuple[int, ...] = (),
          fp32_communication: bool = False) -> ShardedFunction:
    """Shard `fn` over a device mesh, MindSpore style.

    Settings left None come from the parallel context (`set_auto_parallel_context`), read
    now, as MindSpore's shard reads it: its search_mode when its parallel_mode is
    "auto_parallel" (else sharding_propagation), a mesh of its device_num devices (of a
    larger cluster: plans only), its hardware, mem_coeff and memory_budget; its
    pipeline_stages above 1 is a NotImplementedError (no pipeline parallelism yet).

    Args:
      fn: the function to shard; it takes arrays and pytrees of them (keyword arguments are
        placed by its signature, as positional ones).
      in_strategy: None, or one entry per positional argument: a tuple of split counts per
        dimension (`(4, 2)`), a `PartitionSpec`, a `Layout(...)` mapping, a pytree prefix of
        these for pytree arguments, or None to let jaxpar decide.
      out_strategy: None (outputs as the plan leaves them) or entries like in_strategy per output.
      parameter_plan: {parameter path: strategy}, e.g. {"params/blocks/0/w": (1, 8)}.
      device: "CPU", "GPU", "TPU" or None (default backend); used when `mesh` is None.
      level: 0 maximise compute/communication ratio, 1 minimise memory, 2 maximise speed.
        "Memory" in the objective (level 1, mem_coeff) is the bytes per device each op reads
        and writes, summed over the ops: weighing it cuts tensors further, which need not
        lower the peak of what is live at once (that is memory_budget's to bound).
      mesh: the mesh to use; default `make_mesh(<the context's device_num or all devices>)`.
      search_mode: "sharding_propagation" (default: from the fixed strategies outward, op by
        op; then refined with the exact objective, a training step's tail, its gradient
        reductions and optimizer, solved again exactly, then each mesh axis solved again
        exactly with the others held; with no weight fixed, also from the best plans using
        the axes together), "recursive_programming" (SAPP: main
        ops cut axis by axis, then propagation; fast) or "dynamic_programming" (the exact
        optimum of the cost model: chain DP or an ILP; stopped at its time limit with no
        memory_budget, recursive_programming's plan where that scores lower). The two
        automatic modes spread every
        matmul/conv over all devices the shapes allow.
      hardware: a hardware profile name (`h100-nvlink`, `tpu-v5e`, `cpu`, ...) or YAML path.
      memory_budget: bytes per device the plan must fit in, or "hardware" for the profile's
        memory per device. dynamic_programming keeps the plan's modelled peak within it
        (or says no plan fits);
        recursive_programming honours it as far as it can; every mode checks the final plan.
        It bounds the plan's modelled peak of live values; the first call also reads XLA's
        memory analysis of the compiled program and warns when that holds more.
      mem_coeff: weight of per-device memory against time in the objective (MindSpore's,
        default the context's, 0.1): larger favours model parallel plans that cut weights,
        smaller data parallel, 0 time alone.
      donate_argnums: positional arguments whose buffers the call may reuse.
      fp32_communication: reduce bf16/f16 partial sums (a matmul's or a sum's result cut
        along its reduction) in float32, then cast back: the collectives move f32 bytes.

    Returns:
      A ShardedFunction: call it like fn; `.plan(*args)` and `.lower(*args)` as well.

    Example:
      >>> f = jaxpar.shard(dense_relu, in_strategy=((4, 2), None, None))
      >>> y = f(x, w, b)
      >>> print(f.plan(x, w, b).explain())
    """
    ctx = current_context()
    if ctx.pipeline_stages > 1:  # AutoParallel refuses it too (auto_parallel._no_pipeline)
        raise NotImplementedError(
            f"shard: the parallel context has pipeline_stages={ctx.pipeline_stages}; pipeline "
            "parallelism is not in this version of jaxpar, and shard plans one program over "
            "the whole mesh. Set set_auto_parallel_context(pipeline_stages=1) and use data/"
            "tensor/optimizer parallel over all the devices.")
    if search_mode is None and ctx.parallel_mode == "auto_parallel":
        search_mode = ctx.search_mode
    if mesh is None and ctx.device_num is not None:
        mesh = context_mesh(ctx, device)
    hardware = ctx.hardware if hardware is None else hardware
    memory_budget = ctx.memory_budget if memory_budget is None else memory_budget
    mem_coeff = ctx.mem_coeff if mem_coeff is None else mem_coeff
    return sharded(fn, in_strategy, out_strategy, parameter_plan, device, level, mesh=mesh,
                   search_mode=search_mode, hardware=hardware, memory_budget=memory_budget,
                   mem_coeff=mem_coeff, donate_argnums=donate_argnums,
                   fp32_communication=fp32_communication)


def context_mesh(ctx: ParallelContext, device: str | None = None) -> Mesh | AbstractMesh:
    """The mesh of the context's device_num devices of `device`'s platform (all of them when
    it gives none); more than there are here: an AbstractMesh of that size (a larger
    cluster's, to plan for; it runs nothing), in at most three axes as `jaxpar plan
    --devices` lays it out (mesh.planning_shape)."""
    here = len(mesh_devices(device))
    n = ctx.device_num or here
    return abstract_mesh(planning_shape(n)) if n > here else make_mesh(n, device=device)


def sharded(fn, in_strategy=None, out_strategy=None, parameter_plan=None, device=None, level=0,
            *, mesh: Mesh | AbstractMesh | None = None, search_mode: str | None = None,
            hardware=None, memory_budget: float | str | None = None, mem_coeff: float = 0.1,
            donate_argnums: int | tuple[int, ...] = (),
            fp32_communication: bool = False, caller: str = "shard") -> ShardedFunction:
    """shard() with every setting as given: None is jaxpar's default, not the parallel
    context's (AutoParallel resolves its settings from its own context first). `caller`: the
    call its errors name (AutoParallel checks its settings here too)."""
    if not callable(fn):
        raise TypeError(f"{caller}(fn={fn!r}): fn must be callable (a function of arrays).")
    opts = _options(in_strategy, out_strategy, parameter_plan, device, level, mesh, search_mode,
                    hardware, memory_budget, mem_coeff, donate_argnums, caller)
    if not isinstance(fp32_communication, bool):
        raise TypeError(f"{caller}(fp32_communication={fp32_communication!r}): must be a bool.")
    return ShardedFunction(fn, replace(opts, fp32_communication=fp32_communication))


def _options(in_strategy, out_strategy, parameter_plan, device, level, mesh, search_mode,
             hardware, memory_budget, mem_coeff, donate_argnums, caller: str) -> ShardOptions:
    if isinstance(level, bool) or not isinstance(level, numbers.Integral) or \
            level not in LEVELS:  # (an array's `in` compares elementwise: typed first)
        raise ValueError(f"{caller}(level={level!r}): level must be the int 0 (maximise compute/"
                         "communication ratio), 1 (minimise memory) or 2 (maximise speed).")
    level = int(level)  # numpy's ints hash as ints, but print and serialise as their own
    mode = "sharding_propagation" if search_mode is None else search_mode
    if not isinstance(mode, str) or mode not in SEARCH_MODES:
        raise ValueError(f"{caller}(search_mode={search_mode!r}): this version of jaxpar supports "
                         f"{list(SEARCH_MODES)}.")
    if device is not None and device not in ("CPU", "GPU", "TPU"):
        raise ValueError(f"{caller}(device={device!r}): use 'CPU', 'GPU', 'TPU' or None for JAX's "
                         "default backend (Ascend is MindSpore's; jaxpar runs on JAX backends).")
    if mesh is not None and not isinstance(mesh, Mesh | AbstractMesh):
        raise TypeError(f"{caller}(mesh={mesh!r}): pass a jax.sharding.Mesh, e.g. "
                        "jaxpar.make_mesh(8), an AbstractMesh (plans only, any size), or None "
                        "for all devices.")
    check_mesh(mesh, f"{caller}(mesh=...)")
    memory_budget = check_memory_budget(memory_budget, caller)
    if memory_budget == "hardware":  # the profile's memory
        memory_budget = load_profile(hardware).memory_bytes
    mem_coeff = check_mem_coeff(mem_coeff, caller)
    if parameter_plan is not None and not isinstance(parameter_plan, dict):
        raise TypeError(f"{caller}(parameter_plan={parameter_plan!r}): must be a dict mapping "
                        "parameter paths to strategies, e.g. {'params/w': (1, 8)}.")
    def whole(i) -> bool:  # an int, numpy's too (level takes them), not a bool
        return isinstance(i, numbers.Integral) and not isinstance(i, bool | np.bool_)

    donate = (donate_argnums,) if whole(donate_argnums) else donate_argnums
    if not isinstance(donate, tuple | list) or not all(whole(i) for i in donate):
        raise TypeError(f"{caller}(donate_argnums={donate_argnums!r}): give an int or a tuple of "
                        "ints, the positions of the arguments whose buffers a call may reuse, "
                        "e.g. (0, 1).")
    profile = load_profile(hardware)  # unknown profiles fail here, before any tracing
    if isinstance(mesh, Mesh):  # devices to run on (an AbstractMesh only plans)
        check_joined("shard")  # a launched rank that never called jaxpar.init()
    if mesh is None:  # mesh_devices: a ValueError naming the platforms here if `device` is
        mesh = make_mesh(len(mesh_devices(device)), device=device)  # not among them
    info = MeshInfo.of(mesh)
    profile.devices_in_node(info)  # a node count that does not split the mesh
    unknown = profile.unknown_axes(info)
    if unknown:  # a calibrated profile used on a mesh whose axes are named otherwise
        given = str(hardware) if isinstance(hardware, str | os.PathLike) else profile.name
        warnings.warn(f"{caller}(hardware={given!r}): the profile's measured links are "
                      f"for axes {list(unknown)}, which the mesh {info.names} has none of: "
                      "their figures price nothing, and the mesh's axes without a measured "
                      "link take the profile's intra/inter links. Name the mesh's axes as the "
                      "profile does, or calibrate on this mesh.", UserWarning, stacklevel=3)
    budget = None if memory_budget is None else float(memory_budget)  # 2**64: no int64
    return ShardOptions(in_strategy, out_strategy, parameter_plan, level, mesh, mode, hardware,
                        budget, float(mem_coeff), tuple(int(i) for i in donate))


def check_mesh(mesh, where: str) -> None:
    """A ValueError or TypeError, before anything is traced, for a Mesh or AbstractMesh built
    by hand that jaxpar cannot plan on (None: none given, nothing to check): axis names that
    are not strings or repeat (a spec names its axes), an axis of no devices, a device listed
    twice (JAX's own check fails with a bare AssertionError when the program is placed);
    then check_auto_axes."""
    if mesh is None:
        return
    names, sizes = tuple(mesh.axis_names), tuple(mesh.axis_sizes)
    fix = (f"jaxpar.make_mesh({sizes}, {tuple(f'd{i}' for i in range(len(sizes)))}) builds "
           "one")
    odd = [n for n in names if not isinstance(n, str)]
    if odd:
        raise TypeError(f"{where}: the mesh's axis names {names} must be strings (a strategy's "
                        f"specs name its axes), not {odd[0]!r}; {fix}.")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{where}: the mesh's axis names {names} repeat {twice[0]!r}; each axis "
                         f"needs a name of its own; {fix}.")
    empty = [n for n, k in zip(names, sizes, strict=True) if k < 1]
    if empty:
        raise ValueError(f"{where}: the mesh's axes {dict(zip(names, sizes, strict=True))} "
                         f"hold no devices along {empty[0]!r}; every axis "
                         "holds one device or more (jaxpar.make_mesh(8), say).")
    if isinstance(mesh, Mesh):
        seen: set[int] = set()
        for d in mesh.devices.flat:
            if d.id in seen:
                raise ValueError(f"{where}: the mesh lists device {d} more than once; each "
                                 "device may appear once. Build the mesh from distinct devices, "
                                 f"e.g. jaxpar.make_mesh({mesh.devices.size}).")
            seen.add(d.id)
    check_auto_axes(mesh, where)


def check_auto_axes(mesh, where: str) -> None:
    """A ValueError unless every axis of `mesh` (None: none given) is AxisType.Auto: jaxpar
    chooses every sharding itself, as jit does on Auto axes; Explicit axes (jax.make_mesh's
    default) put shardings in the arrays' types, and their arrays do not mix with Auto ones."""
    if not _all_auto(mesh):
        names, types = tuple(mesh.axis_names), mesh.axis_types
        raise ValueError(
            f"{where}: the mesh's axes {names} are {tuple(t.name for t in types)}; jaxpar "
            "chooses the shardings itself and needs Auto axes (jax.make_mesh makes Explicit "
            f"ones by default). Use jaxpar.make_mesh({tuple(mesh.axis_sizes)}, {names}) or "
            f"jax.make_mesh(..., axis_types=(AxisType.Auto,) * {len(names)}).")


class ShardedFunction:
    """fn sharded by jaxpar; see `shard`."""

    def __init__(self, fn, opts: ShardOptions, pinned: Plan | list[Plan] | None = None,
                 strict: bool = True):
        self.fn, self.opts, self._pinned = fn, opts, pinned
        # pinned: the plan (with_plan), or plans each program takes the one made for it from
        # (_loaded). strict: a pinned plan must follow the strategies given to shard
        # (with_plan); an AutoParallel loading a strategy file fixes its own defaults and
        # checks the file so.
        self._strict = strict
        self._cache: dict[Any, _Compiled] = {}
        functools.update_wrapper(self, fn, updated=())  # fn's name and doc, as jax.jit keeps

    def __get__(self, instance, owner=None):
        """As a method, `instance` is the first argument (as jax.jit does): `self` is then one
        more argument, a pytree of arrays, or the error names it."""
        return self if instance is None else types.MethodType(self, instance)

    @property
    def mesh(self) -> Mesh | AbstractMesh:
        return self.opts.mesh

    def __call__(self, *args, **kwargs):
        ambient = jax.sharding.get_abstract_mesh()
        manual = [n for n, t in zip(ambient.axis_names, ambient.axis_types, strict=True)
                  if t == AxisType.Manual]
        if manual:
            raise ValueError(
                f"{_name(self.fn)}: called inside jax.shard_map (manual axes {tuple(manual)}), "
                "where each device runs its own shard; a jaxpar function places its program "
                "over the whole mesh itself. Call it outside the shard_map, or call the plain "
                "function inside it.")
        foreign = not ambient.empty and ambient != _abstract(self.mesh)
        if foreign:  # traced values typed on the caller's mesh first (see _onto)
            args, kwargs = jax.tree_util.tree_map(_replicated_here, (args, kwargs))
        with _on_own_mesh(self.mesh, ambient):
            out = self._call(args, kwargs, ambient if foreign else None)
        if foreign and any(isinstance(y, jax.core.Tracer)
                           for y in jax.tree_util.tree_leaves(out)):
            # Traced under the caller's jax.set_mesh over another mesh: the results, laid out
            # on the plan's mesh, are handed back replicated on the caller's, where its next
            # ops (typed on that mesh) can read them.
            out = jax.tree_util.tree_map(lambda y: jax.sharding.reshard(y, PartitionSpec()),
                                         out)
        return out

    def _call(self, args: tuple, kwargs: dict, caller: AbstractMesh | None = None):
        """The call, on the plan's mesh; `caller`: the caller's mesh context where it is
        another mesh (jax.set_mesh), on which the traced arguments are typed already."""
        foreign = caller is not None
        self._check_concrete("call")
        args = positional_arguments(self.fn, args, kwargs)
        leaves, tree = jax.tree_util.tree_flatten(args)
        args, leaves = array_arguments(self.fn, args, leaves, tree)
        shapes = [i for i, x in enumerate(leaves) if type(x) is jax.ShapeDtypeStruct]
        if shapes:
            path = arg_paths(self.fn, args)[shapes[0]]
            raise TypeError(f"{_name(self.fn)}({path}=ShapeDtypeStruct): a call needs arrays; "
                            "shapes alone are for .plan(...) and .lower(...).")
        c = self._compiled(args, leaves, tree)
        if not c.agreed and jax.process_count() > 1:  # before placing: it needs them alike
            c = self._agreed(c, args, leaves, tree)
        if c.shardings is None:
            c.shardings = tuple(NamedSharding(self.mesh, s.to_pspec())
                                for s in c.plan.flat_in_specs)
        if c.lifted or "tracer" in _kinds(leaves):
            # Inside jax.jit, grad, vmap...: the program is one more jitted call in the
            # caller's trace, its operands (and the tracers fn captured) constrained to the
            # plan's specs inside it.
            lifted = c.lifted
            with jax.sharding.use_abstract_mesh(caller) if foreign else \
                    contextlib.nullcontext():  # read as the caller's mesh lays them out
                _check_mapped_axes(self.fn, self.mesh, [*leaves, *(x for x, _ in lifted)])
                if foreign:  # typed on the caller's mesh, as the arguments are
                    lifted = [(_replicated_here(x), s) for x, s in lifted]
            flat = [_onto(x, s, foreign) for x, s in
                    [*zip(leaves, c.shardings, strict=True), *lifted]]
            try:
                out = c.traced(*flat)
            except ValueError as err:
                if "spmd_axis_name" not in str(err):
                    raise
                raise ValueError(
                    f"{_name(self.fn)}: called under jax.vmap(spmd_axis_name=...), which "
                    "shards the mapped dim over a mesh axis the plan already uses. Drop "
                    "spmd_axis_name (jaxpar places the program itself), or plan the batched "
                    "function: jaxpar.shard(jax.vmap(fn)).") from err
            return jax.tree_util.tree_unflatten(c.plan.out_tree, list(out))
        if c.donate:  # before placing: placed replicas of one array may share its buffer
            _check_not_deleted(self.fn, args, leaves, c.donate)
            leaves = _own_buffers(leaves, c.donate)
        flat = [_placed(x, s) for x, s in zip(leaves, c.shardings, strict=True)]
        if c.called:
            out = c.jitted(*flat)
        else:
            budget = self.opts.memory_budget
            shapes = None if budget is None else [  # donated arrays are gone after the call
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                if isinstance(x, jax.Array) else x for x in flat]
            with progress.activity(f"compiling {_name(self.fn)} (first call)"):
                out = c.jitted(*flat)
            c.called = True
            if budget is not None:
                _check_compiled_memory(c, shapes, budget, _name(self.fn))
        return jax.tree_util.tree_unflatten(c.plan.out_tree, list(out))

    def plan(self, *args, **kwargs) -> Plan:
        """The plan for these arguments (arrays, ShapeDtypeStructs or Python scalars); nothing
        runs. With several processes it is this process's own; the first call (or lower())
        makes every process take process 0's, should they differ."""
        args = positional_arguments(self.fn, args, kwargs)
        with _on_own_mesh(self.mesh):
            return self._compiled(array_arguments(self.fn, args)[0]).plan

    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """The lowered program (call `.compile()` on it). As jax.jit(f).lower(...)'s, it
        takes the function's arguments, positionally, in their structure (pytrees) and
        returns its outputs in theirs; its arguments' leaves are laid out as the plan says
        and donated as donate_argnums says."""
        self._check_concrete("lower")
        args = array_arguments(self.fn, positional_arguments(self.fn, args, kwargs))[0]
        with _on_own_mesh(self.mesh):
            c = self._compiled(args)
            leaves, tree = jax.tree_util.tree_flatten(args)
            if not c.agreed and jax.process_count() > 1:  # its program runs on every process
                c = self._agreed(c, args, leaves, tree)
            flat = [jax.ShapeDtypeStruct(x.shape, x.dtype,
                                         sharding=NamedSharding(self.mesh, s.to_pspec()))
                    for x, s in zip(leaves, c.plan.flat_in_specs, strict=True)]
            jitted, out_tree = c.jitted, c.plan.out_tree

            def program(*given):  # the flat program, called in the function's structure
                return jax.tree_util.tree_unflatten(
                    out_tree, jitted(*jax.tree_util.tree_leaves(given)))
            donate = tuple(sorted(self._donated(len(args))))
            outs = jax.tree_util.tree_unflatten(out_tree, [
                NamedSharding(self.mesh, s.to_pspec()) for s in c.plan.flat_out_specs])
            return jax.jit(program, out_shardings=outs, donate_argnums=donate).lower(
                *jax.tree_util.tree_unflatten(tree, flat))

    def with_plan(self, plan: Plan) -> ShardedFunction:
        """This function pinned to a saved plan (checked against the program and mesh)."""
        if not isinstance(plan, Plan):
            raise TypeError(f"with_plan(plan={plan!r}): pass a jaxpar.Plan (Plan.load(path)).")
        return ShardedFunction(self.fn, self.opts, plan)

    def _loaded(self, plans: list[Plan]) -> ShardedFunction:
        """with_plan for AutoParallel's strategy files: each program takes the plan of
        `plans` made for it (its fingerprint and mesh; else the first, which is then refused
        saying what differs), not held to this function's strategies (its semi_auto defaults
        fix what a saved plan may have cut)."""
        return ShardedFunction(self.fn, self.opts, plans, strict=False)

    def _agreed(self, c: _Compiled, args: tuple, leaves: list, tree) -> _Compiled:
        """`c`, or process 0's plan where this process planned otherwise (several processes;
        every one calls this before the first run, traced or not). Each plans on its own, and
        a search stopped by its time limit stops elsewhere on a busier machine: programs
        compiled from two plans fail inside their first collective, or hang. Process 0's
        plan, sent as its file, is then every process's (the program and mesh are alike:
        checked by the shapes)."""
        apart = _check_processes_agree(c.plan, leaves, _name(self.fn))
        if apart:
            text = broadcast_bytes(json.dumps(c.plan.to_json()).encode()
                                   if jax.process_index() == 0 else b"")
            if jax.process_index() in apart:
                warnings.warn(
                    f"{_name(self.fn)}: this process (process {jax.process_index()}) planned "
                    "it otherwise than process 0 (its shard() options, such as in_strategy, "
                    "differ from process 0's, or a search stopped by its time limit at "
                    "another point on a busier machine); it runs process 0's plan, as every "
                    "process must. To plan once, save a plan (plan.save) and load it on "
                    "every process (with_plan).", UserWarning, stacklevel=4)
                theirs = ShardedFunction(self.fn, self.opts, Plan.from_json(json.loads(text)),
                                         self._strict)
                c = theirs._compiled(args, leaves, tree)
                self._cache[self._key(leaves, tree)] = c
        c.agreed = True
        return c

    @staticmethod
    def _key(leaves: list, tree) -> tuple:
        return (tree, signature(leaves), trace_settings())

    def _compiled(self, args: tuple, leaves: list | None = None, tree=None) -> _Compiled:
        if leaves is None:
            leaves, tree = jax.tree_util.tree_flatten(args)
        key = self._key(leaves, tree)
        if key not in self._cache:
            with progress.activity(f"planning {_name(self.fn)}"), paused_gc():
                self._cache[key] = self._build(args)
        return self._cache[key]

    def _build(self, args: tuple) -> _Compiled:
        from jaxpar import strategy as strat

        o, mesh = self.opts, self.opts.mesh
        donated = self._donated(len(args))  # checked before anything is traced
        fixed = strat.parse_in_strategy(o.in_strategy, args, mesh)
        paths = arg_paths(self.fn, args)
        shapes = [tuple(x.shape) for x in jax.tree_util.tree_leaves(args)]
        for i, spec in strat.parse_parameter_plan(o.parameter_plan, paths, shapes, mesh).items():
            fixed[i] = _merge(fixed[i], spec, paths[i])
        for i, j in optimizer_followers(paths, shapes).items():
            if fixed[i] is None and fixed[j] is not None:
                fixed[i] = fixed[j]  # optimizer state follows its parameter's fixed strategy
        with progress.stage("tracing"):
            traced = trace(self.fn, args, mesh)
        _refuse_ordered_effects(self.fn, traced.closed_jaxpr, mesh.size)
        out_shapes = jax.tree_util.tree_unflatten(
            traced.out_tree, [jax.ShapeDtypeStruct(tuple(v.aval.shape), v.aval.dtype)
                              for v in traced.closed_jaxpr.jaxpr.outvars])
        out_fixed = strat.parse_out_strategy(o.out_strategy, out_shapes, mesh)
        with progress.stage("building the op graph"):
            graph = build_graph(traced.closed_jaxpr, traced.in_paths)
        donate = tuple(i for i, owner in enumerate(leaf_owners(args)) if owner in donated)
        graph.donated = frozenset(graph.inputs[i] for i in donate)  # (outputs go back in them)
        _check_devices(self.fn, graph, mesh)
        profile = load_profile(o.hardware)
        model = CostModel(MeshInfo.of(mesh), profile, o.level, o.mem_coeff,
                          recompute_heavy=o.search_mode not in AUTOMATIC_MODES,
                          search_bodies=True,  # sharding_propagation too (regions.py)
                          fp32_communication=o.fp32_communication)
        if self._pinned is not None:
            pinned = self._pinned if isinstance(self._pinned, Plan) else next(
                (p for p in self._pinned
                 if p.fingerprint == traced.fingerprint and p.mesh == model.mesh),
                self._pinned[0])
            pinned.check_matches(traced.fingerprint, model.mesh)
            pinned.check_structure(traced.in_tree, traced.out_tree)
            pinned.check_fits(graph)
            if self._strict:
                _check_pinned(pinned, fixed, out_fixed, paths)
            as_run(pinned, graph, model, traced)  # edited by hand: priced again
            _check_budget(pinned, o.memory_budget, pinned=True)  # a saved plan answers to it
            return self._finish(graph, pinned, donate, traced)
        fixed_in = {graph.inputs[i]: s for i, s in enumerate(fixed) if s}
        fixed_out = {i: s for i, s in enumerate(out_fixed) if s}
        unsure: dict[int, list[int]] = {}
        ties = [(i, j) for i, j in carried_pairs(args, out_shapes, unsure)
                if out_fixed[j] is None]
        # Shared by the searches below (each prices a thing once); dynamic_programming
        # builds its own tables and reads none.
        index = None if o.search_mode == "dynamic_programming" else GraphIndex(graph)
        carried = [(graph.inputs[i], j) for i, j in ties]
        kept = None if o.search_mode in AUTOMATIC_MODES else _kept(fixed_in, carried)
        gp, notes, decisions = self._search(graph, model, fixed_in, fixed_out, carried, index,
                                            kept)
        if ties:  # each carried output takes the spec of the input it replaces (every search
            # priced it coming back so: a ZeRO-style gather at the end of the step)
            fixed_out |= {j: gp.specs[graph.inputs[i]] for i, j in ties}
            notes.append(f"carried state: {len(ties)} outputs keep the sharding of the input "
                         "they replace, so the step can be called in a loop without resharding")
        for i, js in unsure.items():
            where = "key" if isinstance(out_shapes, dict) else "element"
            named = [repr(sorted(out_shapes)[j]) if isinstance(out_shapes, dict) else str(j)
                     for j in js]
            notes.append(
                f"argument {i} is not tied as carried state: returned {where}s "
                f"{', '.join(named)} share its structure, shapes and dtypes (gradients returned "
                "beside parameters?), so none is known to be it. Its layout out may differ "
                "from its layout in (a loop reshards it every call, and its donated buffers go "
                f"unused); to tie it, return it as element {i} of a returned tuple (its "
                "argument's place)")
        foreign = off_mesh(graph, model.mesh)
        if foreign:
            notes.append(f"shard_map over another mesh than the plan's ({', '.join(foreign)}): "
                         "runs replicated here, and what it moves is not in the predicted "
                         "collectives; give it the plan's mesh (axis names and sizes)")
        in_specs = [gp.specs[v] for v in graph.inputs]
        out_specs = [fixed_out.get(j) or out_spec(graph, gp, v)
                     for j, v in enumerate(graph.outputs)]
        placed = placeable(graph, out_specs)  # results with no elements come back whole
        if any(a != b for a, b in zip(out_specs, placed, strict=True)):
            notes.append("outputs with no elements come back replicated (XLA returns them whole "
                         "on every device; they hold no bytes), whatever out_strategy or the "
                         "plan cut")
        out_specs = placed
        # Weights, for the layout report: the carried state of a step that differentiates (a
        # training step's parameters and optimizer state); else a first argument of several
        # arrays (`apply(params, *batch)`, Flax's order); else all but the first (`f(x, w,
        # b)`). Without derivatives what comes back in an argument's place is an activation
        # as often as not (`layer(x, w) -> x + tanh(x @ w)`, a scan's carry) or a cache (a
        # decode step's), and the weights are the arguments beside it.
        first = len(jax.tree_util.tree_leaves(args[0])) if args else 0
        weights = {graph.inputs[i] for i, _ in ties} if ties and graph.differentiates else \
            set(graph.inputs[:first]) if first > 1 else set(graph.inputs[first:])
        with progress.stage("building the plan"):
            plan = build_plan(graph, gp, model, traced, in_specs, out_specs, o.search_mode,
                              profile.name, weights)
        plan.notes, plan.decisions = notes, decisions
        plan.objective = f"level {o.level}, mem_coeff {o.mem_coeff:g}" + (
            "" if o.memory_budget is None else
            f", memory_budget {o.memory_budget:.0f} bytes per device")
        _check_budget(plan, o.memory_budget)
        return self._finish(graph, plan, donate, traced)

    def _search(self, graph, model, fixed_in, fixed_out, ties, index: GraphIndex | None,
                kept: dict[int, frozenset[str]] | None = None):
        """(GraphPlan, notes, decisions) from the chosen search mode; ties: (input value,
        output position) pairs of carried state (the automatic searches price them); index:
        the graph's GraphIndex, shared by the searches of one build (None: each its own);
        kept: for sharding propagation, the axes each fixed input is read on as laid out
        (_kept)."""
        mode = self.opts.search_mode
        with progress.stage(f"searching ({mode})"):
            return self._run_search(mode, graph, model, fixed_in, fixed_out, ties, index, kept)

    def _run_search(self, mode, graph, model, fixed_in, fixed_out, ties, index, kept=None):
        """_search's work, under its progress stage."""
        if mode == "dynamic_programming":
            try:
                gp, sol = dynamic_programming(graph, model, fixed_in, fixed_out,
                                              self.opts.memory_budget, ties=ties)
            except NotFound as err:  # none found in time: the walk's under the budget, if any
                return _walk_within(err, graph, model, fixed_in, fixed_out, ties, index,
                                    self.opts.memory_budget)
            verdict = "optimal" if sol.optimal else f"stopped at gap {sol.gap:.1%}"
            over = [what for what, holds in (
                ("whose matmuls and convolutions are cut as far as their shapes allow",
                 not model.recompute_heavy),  # Alpa's rule (cost/model.py)
                ("whose repeated layers agree", sol.repeats_tied),  # exact.repeats: tied
                ("of its loops' and conds' bodies it tried",  # a few each: regions.py
                 any(op.regions for op in graph.ops)),
                ("whose step-tail reductions are " + " and ".join(  # exact's tail solved
                    f"{kind}s over {'+'.join(axes)}" for kind, axes in sol.tail_groups) +
                 " only", bool(sol.tail_groups))) if holds]
            if over:
                verdict += " over the plans " + (" and ".join(over) if len(over) < 3 else
                                                  ", ".join(over[:-1]) + " and " + over[-1])
            if sol.refitted:
                verdict += (", for a budget lowered by what its first plans held over the one "
                            "given (its live sets miss what two choices make together)")
            if sol.moved:
                verdict += f", {moved_note(sol.moved)}"
            # How the solver got there goes to the debug log; the note names it only where the
            # plan depends on it (stopped at the time limit): an optimum's plan file and Plan
            # equality stay the same from run to run.
            log.debug("dynamic_programming: %s by %s in %.2f s", verdict, sol.method,
                      sol.seconds)
            notes = [f"dynamic_programming: {verdict}" +
                     ("" if sol.optimal else f" ({sol.method}, {sol.seconds:.2f} s)")]
            if self.opts.memory_budget is not None:
                gp = _within_budget(gp, notes, graph, model, fixed_in, fixed_out, ties, index,
                                    self.opts.memory_budget, sol.refitted, sol.optimal)
            loops = any(op.name in LOOPS for op in graph.ops)
            if (loops or not sol.optimal) and self.opts.memory_budget is None:
                gp = _or_walk(gp, notes, graph, model, fixed_in, fixed_out, ties, index,
                              "had when it stopped" if not sol.optimal else
                              "found over the loop bodies it tried")
            return gp, notes, []
        if mode == "recursive_programming":
            from jaxpar.search.recursive import recursive_programming
            notes: list[str] = []
            gp, decisions = recursive_programming(graph, model, fixed_in, fixed_out,
                                                  self.opts.memory_budget, ties, index, notes)
            return gp, notes, decisions
        gp, notes = sharding_propagation(graph, model, fixed_in, fixed_out, ties, index, kept,
                                         self.opts.memory_budget)
        return gp, notes, []

    def _finish(self, graph, plan: Plan, donate: tuple[int, ...], traced) -> _Compiled:
        """The compiled function of `plan`; donate: the argument leaves whose buffers a call
        hands over."""
        if plan.in_tree is None:  # a loaded plan: bound to these arguments' structure (its
            plan.in_tree, plan.out_tree = traced.in_tree, traced.out_tree  # own was checked)
        lifted = tracer_consts(graph)
        source = _source(traced.closed_jaxpr, [graph.consts[v] for v in lifted])
        specs = plan.graph_plan.specs
        consts = tuple((graph.consts[v], NamedSharding(self.mesh, specs[v].to_pspec()
                                                       if v in specs else PartitionSpec()))
                       for v in lifted)
        return _Compiled(plan, lambda traced: build_callable(
            graph, plan.graph_plan, self.mesh, plan.flat_in_specs, plan.flat_out_specs, donate,
            self.opts.fp32_communication, traced, source, lifted if traced else ()),
            donate=donate, lifted=consts)

    def _donated(self, n_args: int) -> set[int]:
        """The positions donate_argnums names among n_args arguments (negative ones count
        from the end, as for jax.jit); one naming none is a ValueError."""
        given = self.opts.donate_argnums
        bad = [i for i in given if not -n_args <= i < n_args]
        if bad:
            raise ValueError(f"shard(donate_argnums={given}): {_name(self.fn)} is called with "
                             f"{n_args} positional argument(s), so {bad} name(s) none; give "
                             f"positions from 0 to {n_args - 1}, or negative ones counting "
                             "from the end.")
        return {i % n_args for i in given}

    def _check_concrete(self, what: str) -> None:
        if isinstance(self.mesh, AbstractMesh):
            raise ValueError(f"cannot {what} a function sharded over an AbstractMesh of "
                             f"{self.mesh.size} devices: it only plans (`.plan(...)`). Shard it "
                             "over a Mesh of real devices (jaxpar.make_mesh) to run it.")



def _source(closed_jaxpr, lifted: list):
    """The traced program as a function of its flat inputs, then values for the constants
    `lifted` (tracers it captured, which a traced call passes as arguments), returning its
    flat outputs: evaluated eqn by eqn, its custom_jvp and custom_vjp calls keep their rules
    (lower.jit.build_callable's `source`)."""
    def source(*flat):
        n = len(flat) - len(lifted)
        given = {id(x): value for x, value in zip(lifted, flat[n:], strict=True)}
        consts = [given.get(id(c), c) for c in closed_jaxpr.consts]
        return jax_core.eval_jaxpr(closed_jaxpr.jaxpr, consts, *flat[:n])
    return source


def _refuse_ordered_effects(fn, closed_jaxpr, devices: int) -> None:
    """A ValueError naming the ordered effects JAX cannot run on more than one device
    (`jax.debug.print(..., ordered=True)`), before planning; JAX's own error came from inside
    its lowering, at the first call."""
    from jax._src import effects  # JAX's registry of ordered effects (as pxla checks them)

    if devices < 2:
        return
    found = effects.shardable_ordered_effects.filter_not_in(
        effects.ordered_effects.filter_in(closed_jaxpr.effects))
    if found:
        kinds = sorted({type(e).__name__ for e in found})
        raise ValueError(
            f"{_name(fn)}: it has ordered effects ({', '.join(kinds)}), which JAX cannot run "
            f"on more than one device, and the plan's mesh has {devices}. Drop ordered=True "
            "(jax.debug.print(..., ordered=True) prints in program order on one device only), "
            "or run it with jax.jit on one device.")


def _or_walk(gp, notes: list[str], graph, model, fixed_in, fixed_out, ties, index,
             why: str = "had when it stopped"):
    """recursive_programming's plan instead of dynamic_programming's where it scores lower,
    for an exact search stopped at its time limit with a gap (an 8-layer MLP Adam step, d 512,
    on 8 devices: the exact search's incumbent after 29 s scored 1.27x the walk's, found in
    0.9 s), or one over a program with loops, whose bodies are a few plans each: the walk
    solves them again for the plans around them it finds (a scanned 4-layer Adam MLP step,
    d 1024, batch 16: the exact search's plan scored 1.23x the walk's). Unbudgeted searches
    only: under a budget _within_budget compares the walk's plan under it."""
    from jaxpar.search.recursive import recursive_programming
    from jaxpar.search.resolve import objective

    walk, _ = recursive_programming(graph, model, fixed_in, fixed_out, None, ties, index)
    exact, other = (objective(graph, model, p, fixed_out, ties) for p in (gp, walk))
    if other >= exact * (1 - 1e-9):
        return gp
    notes.append(f"dynamic_programming: recursive_programming's plan scores {other:.6g}, less "
                 f"than the {exact:.6g} of the plan the exact search {why}: kept instead")
    return walk


def _walk_within(err: ValueError, graph, model, fixed_in, fixed_out, ties, index,
                 budget: float) -> tuple:
    """dynamic_programming found no plan under the budget within its time limit, and none is
    proven impossible (`err`, dynamic.NotFound): recursive_programming's plan under the budget,
    with a note saying so, or `err` again where that search finds none either (a ViT step at
    0.3 of its optimum's peak: the exact search's least-memory assignment held 58,028 bytes
    for a budget of 36,288, and the walk's plan holds 31,976)."""
    from jaxpar.search.recursive import recursive_programming

    try:
        gp, _ = recursive_programming(graph, model, fixed_in, fixed_out, budget, ties, index)
    except ValueError:
        raise err from None
    return gp, [f"dynamic_programming: {str(err).rstrip('.')}; recursive_programming's plan "
                "under the budget: kept instead"], []


def _within_budget(gp, notes: list[str], graph, model, fixed_in, fixed_out, ties, index,
                   budget: float, refitted: bool = False, optimal: bool = True):
    """dynamic_programming's plan, or recursive_programming's under the budget where that one
    fits and this one does not, or (refitted, or not `optimal`: stopped at its time limit)
    scores lower. The exact search's live sets miss what two choices make together (a
    carried output made in another layout than its free input comes in: both held at its
    end; one made in a donated argument's buffer in another layout), so its optimum can end a
    few percent over a budget a plan meets. It then solves again for lower budgets
    (exact._refit), and its answer is the optimum for one of those, short of the time its
    first solve took: the memory_budget benchmark's MoE at 0.3 of the optimum's peak scored
    14.2x the optimum's objective so, the walk's plan 6.0x. Under a budget the exact search
    often stops at its limit, and its plan then is what it had found (a 1-layer GPT step at
    0.4 of the optimum's peak: stopped at a gap of 73%, its plan modelled 1.885 ms where the
    walk's under the budget modelled 1.377 ms)."""
    from jaxpar.plan import search_peak
    from jaxpar.search.recursive import recursive_programming
    from jaxpar.search.resolve import objective

    def peak(p) -> float:
        return search_peak(graph, p, model.mesh, fixed_out, ties)

    exact = peak(gp)
    if exact <= budget and optimal and not refitted:
        return gp
    try:
        walk, _ = recursive_programming(graph, model, fixed_in, fixed_out, budget, ties, index)
    except ValueError:  # none of its plans fits either: the budget check says so
        return gp
    held = peak(walk)
    if held > budget:
        return gp
    if exact <= budget:
        scores = [objective(graph, model, p, fixed_out, ties) for p in (gp, walk)]
        if scores[1] >= scores[0] * (1 - 1e-9):
            return gp
        what = "solved again for a lower budget" if refitted else \
            "the exact search had when it stopped"
        notes.append(f"dynamic_programming: recursive_programming's plan under the budget "
                     f"scores {scores[1]:.6g}, less than the {scores[0]:.6g} of the plan "
                     f"{what}: kept instead")
        return walk
    notes.append(f"dynamic_programming: its plan holds {exact:.0f} bytes per device at its "
                 f"peak, over the budget (its live sets miss what two choices make together: a "
                 f"carried output's copy made in another layout than its input); "
                 f"recursive_programming's plan under the budget holds {held:.0f}: kept "
                 "instead")
    return walk


def _check_processes_agree(plan: Plan, leaves: list, name: str) -> list[int]:
    """The processes whose plan differs from process 0's (called by all of them before the
    first run: a small all-gather), after a ValueError unless every process passes arguments
    of the same shapes and dtypes: arguments of other shapes made one global array of two
    shapes (silently, or the first collective died inside gloo) where their plans' specs
    agreed."""
    shapes = [(tuple(x.shape), str(x.dtype)) for x in leaves]
    every = gather_rows(np.concatenate([digest(repr(shapes).encode()),
                                        digest(_plan_text(plan).encode())]))
    half = every.shape[1] // 2
    for part, what in ((slice(None, half), "shapes"), (slice(half, None), "plans")):
        apart = [i for i in range(len(every)) if not (every[i, part] == every[0, part]).all()]
        if not apart:
            continue
        if what == "shapes":
            passed = ", ".join(f"{p} {shape} {dtype}" for p, (shape, dtype) in
                               zip(plan.in_paths, shapes, strict=True))
            raise ValueError(
                f"{name}: the processes passed arguments of other shapes or dtypes (processes "
                f"{apart} differ from process 0; process {jax.process_index()} passed "
                f"{passed}). Every process passes the whole arrays, alike in shape and dtype "
                "(each fills its own devices from them); a batch each process loads for "
                "itself goes through jaxpar.shard_batch.")
        return apart
    return []


def _plan_text(plan: Plan) -> str:
    """The strategies and specs a plan gives, as text (loop bodies' included), for
    _check_processes_agree: all the lowering reads (it constrains constants and loop bodies'
    values to their specs too)."""
    def strategies(gp) -> list:
        return [[(i, str(c.strategy.ins), str(c.strategy.outs), str(c.strategy.partial),
                  [strategies(b) for b in c.regions]) for i, c in sorted(gp.choices.items())],
                [(v, str(s)) for v, s in sorted(gp.specs.items())]]
    return repr((list(map(str, plan.flat_in_specs)), list(map(str, plan.flat_out_specs)),
                 strategies(plan.graph_plan)))


def _kept(fixed_in: dict[int, Spec], carried: list[tuple[int, int]]) -> dict[int, frozenset]:
    """The mesh axes on which sharding propagation reads each fixed input as laid out
    (MindSpore's semi-auto rule: a weight's layout is the strategy of the op using it; see
    search/propagation.py): for carried state (weights, optimizer state: what a step returns
    updated), the axes of its fixed spec that the batch's (the other fixed inputs') do not
    include. A weight cut on an axis the batch is cut on too (FSDP, hsdp's level3) is stored cut
    and gathered for use: its readers read it whole on those axes (an empty set here), but
    for the optimizer, which updates it as stored. The batch, like everything else, goes where
    propagation prices it best (keeping it, and a function's weights without carried state,
    made the reference programs' plans 8 to 22% dearer)."""
    state = {v for v, _ in carried}
    batch = {a for v, s in fixed_in.items() if v not in state for a in s.axes()}
    return {v: frozenset(s.axes()) - batch for v, s in fixed_in.items() if v in state}


def _check_pinned(plan: Plan, fixed: list, out_fixed: list, paths: list[str]) -> None:
    """A ValueError where in_strategy, out_strategy or parameter_plan lays out an input or
    output otherwise than the pinned plan (with_plan) does: the plan would win silently."""
    sides = (("input", fixed, plan.flat_in_specs, paths),
             ("output", out_fixed, plan.flat_out_specs,
              [f"out[{j}]" for j in range(len(out_fixed))]))
    for side, asked, planned, names in sides:
        for name, want, spec in zip(names, asked, planned, strict=True):
            if want is not None and want.resolved().dims != spec.resolved().dims:
                raise ValueError(
                    f"with_plan: the plan lays out {side} {name} as {spec}, but the strategy "
                    f"given to shard asks for {want}. Drop that strategy (the plan holds its "
                    "own), or plan again with it.")


def _name(fn) -> str:
    """fn's name for the progress line (a partial or callable object: its type's)."""
    return getattr(fn, "__name__", type(fn).__name__)


def positional_arguments(fn, args: tuple, kwargs: dict) -> tuple:
    """args followed by the keyword arguments that name fn's next positional parameters, in
    the signature's order (`f(x, w=w)` is `f(x, w)`: in_strategy counts positions). A keyword
    fn cannot take by position (keyword-only, **kwargs, after a parameter left to its
    default) is a TypeError saying how to pass it."""
    if not kwargs:
        return args
    name = _name(fn)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise TypeError(f"{name}(...) got keyword arguments {sorted(kwargs)}, but its "
                        "signature cannot be read to place them; pass them by position.") \
            from None
    params = sig.parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(k for k in kwargs if k not in params or
                         params[k].kind is params[k].POSITIONAL_ONLY)
        if unknown:  # named first, as Python does (bind would report a missing one first)
            close = [m for k in unknown for m in difflib.get_close_matches(k, params, n=1)]
            guess = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            raise TypeError(f"{name}(...) got unexpected keyword argument(s) {unknown}{guess}; "
                            f"its signature is {sig}.")
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{name}(...): {e}") from None
    out, left = list(args), dict(kwargs)
    for p in list(sig.parameters.values())[len(args):]:
        if p.kind is not p.POSITIONAL_OR_KEYWORD or p.name not in left:
            break
        out.append(left.pop(p.name))
    if left:
        raise TypeError(f"{name}(...): {_unplaceable(fn, sig, sorted(left), len(out))}")
    return tuple(out)


def _unplaceable(fn, sig: inspect.Signature, names: list[str], placed: int) -> str:
    """Why keyword arguments `names` cannot be passed by position after the `placed` first
    parameters of fn's signature `sig`, and what works."""
    params, name = sig.parameters, _name(fn)
    how = "jaxpar passes arguments by position (in_strategy counts them so)"
    through = ("call it through a function that takes them by position (`lambda x, w: "
               f"{name}(x, w=w)`)")
    extra = [k for k in names if k not in params]
    if extra:
        var = next(p.name for p in params.values() if p.kind is p.VAR_KEYWORD)
        return (f"keyword argument(s) {extra} go to **{var} in {name}'s signature {sig}, and "
                f"{how}: give the function parameters of those names, or {through}.")
    if not any(params[k].kind is params[k].KEYWORD_ONLY for k in names):
        skipped = [p.name for p in list(params.values())[placed:] if p.name not in names]
        return (f"keyword argument(s) {names} follow parameters not given ({skipped}) in "
                f"{name}'s signature {sig}, and {how}: give every parameter before them too.")
    said = f"keyword argument(s) {names} are keyword-only in {name}'s signature {sig}"
    if isinstance(fn, functools.partial) and _bound_in_the_middle(fn):
        return (f"{said}: functools.partial bound {_bound_in_the_middle(fn)} by keyword, which "
                f"makes the parameters after them keyword-only, and {how}. Bind them in a "
                f"lambda that takes the others by position instead: `{_as_lambda(fn)}`.")
    return f"{said}, and {how}: {through}, or bind a setting (not data) into it with " \
        "functools.partial."


def _bound_in_the_middle(fn: functools.partial) -> list[str]:
    """The parameters a partial binds by keyword that its function takes by position too."""
    try:
        params = inspect.signature(fn.func).parameters
    except (TypeError, ValueError):
        return []
    return [k for k in fn.keywords if k in params and
            params[k].kind is params[k].POSITIONAL_OR_KEYWORD]


def _as_lambda(fn: functools.partial) -> str:
    """The partial as a lambda of the parameters it leaves, each bound one in its place
    (`lambda x, w, b: layer(x, 4, w, b)`; a bound value that is not a Python scalar shows
    as its parameter's name)."""
    params = [p.name for p in inspect.signature(fn.func).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    bound = dict(zip(params, fn.args, strict=False)) | {
        k: v for k, v in fn.keywords.items() if k in params}
    shown = [repr(bound[k]) if isinstance(bound.get(k), bool | int | float | str) else k
             for k in params]
    free = [k for k in params if k not in bound]
    return f"lambda {', '.join(free)}: {_name(fn.func)}({', '.join(shown)})"


_KINDS: dict[type, str] = {bool: "scalar", int: "scalar", float: "scalar", complex: "scalar"}


def _kind(x) -> str:
    """A leaf's kind: "array" (an array, numpy scalar or ShapeDtypeStruct), "tracer" (an
    array inside a transformation), "scalar" (a Python number) or "other"; remembered per
    type, as the checks behind it are slow and a call asks for every leaf."""
    t = type(x)
    kind = _KINDS.get(t)
    if kind is None:
        kind = _KINDS[t] = ("tracer" if isinstance(x, jax.core.Tracer) else
                            "array" if hasattr(x, "shape") and hasattr(x, "dtype") else
                            "scalar" if isinstance(x, bool | int | float | complex) else
                            "other")
    return kind


def _kinds(leaves: list) -> set[str]:
    """The _kind of each leaf, as a set (known types looked up at C speed)."""
    kinds = set(map(_KINDS.get, map(type, leaves)))
    return {_kind(x) for x in leaves} if None in kinds else kinds


def array_arguments(fn, args: tuple, leaves: list | None = None, tree=None
                    ) -> tuple[tuple, list]:
    """(args, their leaves) with each Python scalar leaf (bool, int, float, complex) made a 0-d
    array, weakly typed as jax.jit traces it (`x * 2.0` stays bfloat16); arrays, tracers, numpy
    scalars and ShapeDtypeStructs pass as they are. Any other leaf is a TypeError naming its
    path."""
    if leaves is None:
        leaves, tree = jax.tree_util.tree_flatten(args)
    for k, x in enumerate(leaves):  # numpy arrays JAX cannot hold: named before tracing
        if jax_cannot_hold(x):
            what = "jax.ShapeDtypeStruct" if isinstance(x, jax.ShapeDtypeStruct) else \
                "numpy array"
            if x.dtype == jax.dtypes.float0:
                raise TypeError(
                    f"argument {arg_paths(fn, args)[k]} is a {what} of dtype float0 (the "
                    "zero tangent jax.grad(..., allow_int=True) gives an integer input), which "
                    "holds no data and which jaxpar cannot place on its mesh. Leave it out of "
                    "the call (tree_map it to None, say), or bind it into the function.")
            raise TypeError(f"argument {arg_paths(fn, args)[k]} is a {what} of dtype "
                            f"{x.dtype}, which JAX cannot hold; convert it to a numeric or "
                            "bool dtype (np.asarray(x, dtype=np.float32), say).")
    if _kinds(leaves) <= {"array", "tracer"}:
        return args, leaves
    paths = arg_paths(fn, args)
    out = []
    for x, path in zip(leaves, paths, strict=True):
        kind = _kind(x)
        if kind == "scalar":
            try:
                x = jnp.asarray(x)
            except OverflowError:
                raise ValueError(f"argument {path}={x!r}: a Python int too large for "
                                 f"{jnp.asarray(0).dtype}. Pass an array of a wider dtype "
                                 "(with jax_enable_x64) or a smaller number.") from None
        elif kind == "other":
            raise TypeError(f"argument {path}={x!r} (a {type(x).__name__}): jaxpar "
                            "takes arrays, jax.ShapeDtypeStructs and Python scalars. Pass it "
                            "as an array, or bind it into the function (functools.partial) "
                            "when it is a setting rather than data.")
        out.append(x)
    return jax.tree_util.tree_unflatten(tree, out), out


# JAX settings that change what a function traces to (jax.jit keys its cache on them too): a
# plan made under one is not the program under another (x64 makes int32 int64; the
# threefry_partitionable switch changes the random bits of one key).
_TRACE_SETTINGS = ("jax_enable_x64", "jax_threefry_partitionable", "jax_default_prng_impl",
                   "jax_default_matmul_precision", "jax_numpy_rank_promotion",
                   "jax_numpy_dtype_promotion", "jax_softmax_custom_jvp",
                   "jax_random_seed_offset")


def trace_settings() -> tuple:
    """The values of _TRACE_SETTINGS now (a `with jax.default_matmul_precision(...)` block's
    included): part of the key a sharded function caches its plans under."""
    return tuple(getattr(jax.config, name, None) for name in _TRACE_SETTINGS)


def signature(leaves: list) -> tuple:
    """What a plan depends on in the argument leaves: shapes, dtypes and weak typing (a weak
    float32 scalar times a bfloat16 array stays bfloat16; a float32 one promotes it). A numpy
    array's dtype as JAX holds it (float64 is float32 without jax_enable_x64: the same
    program as float32's, planned once, as jax.jit caches it)."""
    out = []
    for x in leaves:
        aval = getattr(x, "aval", None)  # jax arrays and tracers: one lookup
        out.append((aval.shape, aval.dtype, aval.weak_type) if aval is not None else
                   (tuple(x.shape),
                    jax.dtypes.canonicalize_dtype(x.dtype, allow_extended_dtype=True),
                    getattr(x, "weak_type", False)))
    return tuple(out)


def leaf_owners(args: tuple) -> list[int]:
    """The positional argument each flat leaf of `args` belongs to."""
    return [k for k, a in enumerate(args) for _ in jax.tree_util.tree_leaves(a)]


def carried_pairs(args: tuple, out_shapes, unsure: dict | None = None
                  ) -> list[tuple[int, int]]:
    """(input leaf, output leaf) pairs of state a step returns in place of its input.

    When the function returns a tuple whose k-th element has the structure, shapes and dtypes
    of its k-th argument (params in, params out; optimizer state in, optimizer state out), the
    leaves of the two are paired; so are the leaves of a function that returns just its new
    first argument (`sgd_step(params, batch) -> params`). An argument left unpaired is then
    paired with the one element of the returned tuple, list or dict (`(loss, params,
    opt_state)`, `{"params": ..., "opt_state": ..., "loss": ...}`) that has its structure,
    where that element has no other such argument: the state is then laid out alike in and
    out as well (it was planned freely, and moved back before every next call). An argument of
    one array after an argument left unpaired is not paired so: a batch of per-example weights
    `(B,)` or a learning rate beside a per-example or scalar loss is data, not state. `unsure`,
    given a dict, gets {argument: [returned elements]} for each argument left unpaired that
    several elements match, or whose one element another argument matches too (a step
    returning `(loss, grads, params, opt_state)`: its grads have the params' structure).
    """
    if args and _same_structure(args[0], out_shapes):
        return [(k, k) for k in range(len(jax.tree_util.tree_leaves(args[0])))]
    if isinstance(out_shapes, dict):
        keys = sorted(out_shapes)  # jax flattens a dict's values in sorted key order
        elements = [out_shapes[k] for k in keys]
    elif isinstance(out_shapes, tuple | list):
        elements = list(out_shapes)
    else:
        return []
    sizes = [len(jax.tree_util.tree_leaves(x)) for x in args]
    starts_in = np.cumsum([0, *sizes])
    starts_out = np.cumsum([0, *(len(jax.tree_util.tree_leaves(x)) for x in elements)])
    paired: dict[int, int] = {}  # argument -> returned element
    if not isinstance(out_shapes, dict):
        paired = {i: i for i, (arg, out) in enumerate(zip(args, elements, strict=False))
                  if _same_structure(arg, out)}
    free = [j for j in range(len(elements)) if j not in paired.values()]
    alike = {i: [j for j in free if _same_structure(arg, elements[j])]
             for i, arg in enumerate(args) if i not in paired}
    data = [i for i, js in alike.items() if not js]  # matched by nothing returned
    alike = {i: js for i, js in alike.items()
             if sizes[i] > 1 or not any(d < i for d in data)}
    for i, js in alike.items():
        if len(js) == 1 and sum(js[0] in other for other in alike.values()) == 1:
            paired[i] = js[0]
        elif js and unsure is not None:
            unsure[i] = js
    return sorted((int(starts_in[i]) + k, int(starts_out[j]) + k)
                  for i, j in paired.items() for k in range(sizes[i]))


def optimizer_followers(paths: list[str], shapes: list[tuple]) -> dict[int, int]:
    """{leaf: parameter leaf} for optimizer-state leaves that belong to a parameter.

    Leaf i follows leaf j when both have one shape and i's path ends with j's below a shorter
    prefix, the longest such match winning:
    - j in another argument, its path below the argument name: `opt_state/0/mu/blocks/0/w`
      follows `params/blocks/0/w` (optax keeps one such leaf per parameter and moment);
    - or, in one argument, i's prefix mirrors j's: for more than half the leaves below j's
      prefix, one of that shape lies at the same path below i's. A flax TrainState holds
      `state/params/Dense_0/kernel` and `state/opt_state/0/mu/Dense_0/kernel`; two
      parameters of one shape at different depths (`params/w`, `params/block/w`) follow
      nothing, and nor does a parameter that others follow, or one whose branch of the
      argument is not mostly copies of j's: `params/blocks/0/ln1/scale` mirrors
      `params/ln_f/scale` by path and shape, and followed it (hsdp's level1 cut every
      block's LayerNorm), but its optimizer state follows it, and the blocks hold matmuls.
    """
    parts = [path.split("/") for path in paths]
    leaves = {(path, tuple(shape)) for path, shape in zip(paths, shapes, strict=True)}
    # (suffix, shape) -> (leaf, how many path components come before the suffix)
    ends: dict[tuple[str, tuple], list[tuple[int, int]]] = {}
    for j, (names, shape) in enumerate(zip(parts, shapes, strict=True)):
        for start in range(1, len(names)):
            ends.setdefault(("/".join(names[start:]), tuple(shape)), []).append((j, start))
    below: dict[str, list[tuple[str, tuple]]] = {}  # prefix -> (rest of path, shape) per leaf
    mirrors: dict[tuple[str, str], bool] = {}

    def mirrored(mine: str, theirs: str) -> bool:
        """Whether prefix `mine` holds, for more than half of the leaves below `theirs`, a
        leaf of that shape at the same path below it."""
        key = (mine, theirs)
        if key not in mirrors:
            if not below:
                for names, shape in zip(parts, shapes, strict=True):
                    for start in range(1, len(names)):
                        below.setdefault("/".join(names[:start]), []).append(
                            ("/".join(names[start:]), tuple(shape)))
            rests = below.get(theirs, [])
            hits = sum((f"{mine}/{rest}", shape) in leaves for rest, shape in rests)
            mirrors[key] = 2 * hits > len(rests)
        return mirrors[key]

    def holds_copies(mine: list[str], theirs: list[str]) -> bool:
        """Whether the branch of their common ancestor that holds prefix `mine` is mostly
        copies of what lies below `theirs`: more than half of its leaves of rank 1 or more
        end, at that shape, as a leaf below `theirs` does. An optimizer's state is (its
        moments mirror the parameters; its step counts are scalars), a model's layers are not
        (each block's LayerNorm mirrors the final one, their matmuls nothing there). Called
        after mirrored(), which fills `below`."""
        common = next((k for k, (a, b) in enumerate(zip(mine, theirs, strict=False))
                       if a != b), min(len(mine), len(theirs)))
        key = ("/".join(mine[:common + 1]), "/".join(theirs))
        if key not in copies:
            there = set(below.get(key[1], []))
            ranked = [(rest.split("/"), shape) for rest, shape in below.get(key[0], []) if shape]
            hits = sum(any(("/".join(rest[k:]), shape) in there for k in range(len(rest)))
                       for rest, shape in ranked)
            copies[key] = 2 * hits > len(ranked)
        return copies[key]

    copies: dict[tuple[str, str], bool] = {}
    follows = {}
    for i, (names, shape) in enumerate(zip(parts, shapes, strict=True)):
        for start in range(1, len(names)):  # longest suffix first
            found = [j for j, at in ends.get(("/".join(names[start:]), tuple(shape)), [])
                     if at < start and j != i and (
                         (at == 1 and parts[j][0] != names[0]) or
                         (parts[j][0] == names[0] and
                          mirrored("/".join(names[:start]), "/".join(parts[j][:at])) and
                          holds_copies(names[:start], parts[j][:at])))]
            if found:
                follows[i] = found[0]
                break
    # A leaf that others follow is a parameter (optimizer state is kept for it), so it
    # follows nothing in its own argument.
    targets = set(follows.values())
    return {i: j for i, j in follows.items() if i not in targets or parts[j][0] != parts[i][0]}


def _check_devices(fn, graph, mesh: Mesh | AbstractMesh) -> None:
    """A ValueError where fn places values on devices other than the plan's mesh's, or on
    them in another order: a shard_map, with_sharding_constraint or device_put over such a
    mesh. JAX runs one program over one list of devices, and jaxpar's runs over its mesh's
    (it failed inside JAX: "Received incompatible devices for jitted computation"). The same
    devices in the same order under other axis names or another shape run (replicated)."""
    if not isinstance(mesh, Mesh):
        return  # an AbstractMesh only plans
    own = _device_ids(mesh)
    for _, op in graph.walk():
        meshes = [op.params.get("mesh"), getattr(op.params.get("sharding"), "mesh", None)]
        meshes += [getattr(d, "mesh", None) for d in op.params.get("devices", ()) or ()]
        for other in meshes:
            if not isinstance(other, Mesh):
                continue
            ids = _device_ids(other)
            if ids != own and op.name == "shard_map" and any(
                    str(n).startswith("_internal_pmap") for n in other.axis_names):
                raise ValueError(
                    f"{_name(fn)}: its jax.pmap maps over {len(ids)} devices {list(ids)}; the "
                    f"plan's mesh runs on devices {list(own)}, in that order, and JAX runs one "
                    f"program over one list of devices. Map over all {len(own)} (a leading "
                    "dimension of that size, or pmap(devices=...) of the plan's devices in its "
                    "order), or give jaxpar.shard(mesh=...) a mesh of the pmap's devices.")
            if ids != own:
                what = {"shard_map": "jax.shard_map", "sharding_constraint":
                        "with_sharding_constraint"}.get(op.name, op.name)
                raise ValueError(
                    f"{_name(fn)}: its {what} is over a mesh of devices {list(ids)}, in that "
                    f"order; the plan's mesh runs on devices {list(own)}, in that order, and "
                    "JAX runs one program over one list of devices. Build that mesh from the "
                    "plan's devices in the plan's order (jax.sharding.Mesh("
                    "f.mesh.devices.reshape(...), names)), or give jaxpar.shard(mesh=...) a "
                    "mesh of its devices in its order.")


def _same_structure(arg, out) -> bool:
    a_leaves, a_tree = jax.tree_util.tree_flatten(arg)
    o_leaves, o_tree = jax.tree_util.tree_flatten(out)
    return bool(a_leaves) and a_tree == o_tree and all(
        tuple(a.shape) == tuple(o.shape) and a.dtype == o.dtype
        for a, o in zip(a_leaves, o_leaves, strict=True))


def _on_own_mesh(mesh: Mesh | AbstractMesh, ambient: AbstractMesh | None = None):
    """A context in which jaxpar traces, compiles and runs on its own mesh. Under a user's
    jax.set_mesh over another mesh its programs would be traced against that one (on Explicit
    axes every sharding constraint becomes an assert, and the plan's axes are not there) and
    compiled over its devices in its order. No context when no other mesh is set: the common
    case costs nothing. Outside a trace the plan's mesh is set; inside one (where jax.set_mesh
    is refused) only its axes, which serves where the caller's mesh has the plan's devices in
    the plan's order and a ValueError says why elsewhere. ambient: the mesh context, where the
    caller has read it already."""
    ambient = jax.sharding.get_abstract_mesh() if ambient is None else ambient
    own = _abstract(mesh)
    held = jax_mesh.get_concrete_mesh()  # the mesh a jax.set_mesh holds (empty: none)
    theirs = () if held.empty else _device_ids(held)
    apart = isinstance(mesh, Mesh) and bool(theirs) and theirs != _device_ids(mesh)
    if (ambient.empty or ambient == own) and not apart:
        return contextlib.nullcontext()
    if isinstance(mesh, Mesh) and jax_core.trace_state_clean():
        return jax.set_mesh(mesh)
    resized = not ambient.empty and ambient.size != own.size
    if not (resized or apart):
        return jax.sharding.use_abstract_mesh(own)
    if resized:
        raise ValueError(
            f"a jaxpar function over {own.size} devices ({MeshInfo.of(own).describe()}) called "
            f"under jax.set_mesh over {ambient.size} ({MeshInfo.of(ambient).describe()})"
            + (" inside a transformation" if isinstance(mesh, Mesh) else "")
            + ": JAX cannot switch to a mesh of another size there. Call it outside the "
            "set_mesh block, or give jaxpar.shard(mesh=...) that mesh.")
    raise ValueError(
        f"a jaxpar function over devices {list(_device_ids(mesh))} called inside a "
        f"transformation under jax.set_mesh over devices {list(theirs)}, in that order: JAX "
        "traces the program over the devices of the mesh set there and cannot switch to "
        "another list of devices inside it. Call it outside the transformation (a direct call "
        "runs on its own mesh), set a mesh of the plan's devices in the plan's order, or give "
        "jaxpar.shard(mesh=...) a mesh of your mesh's devices in its order.")


def _device_ids(mesh: Mesh) -> tuple[int, ...]:
    """The ids of a mesh's devices in its order (the order JAX runs a program over them)."""
    return tuple(int(d.id) for d in mesh.devices.flat)


def _replicated_here(x):
    """A tracer typed replicated on the caller's mesh (the mesh context), so that its
    cotangent comes back typed so too, where the caller's next ops can read it; anything else
    as it is (vmap's tracers too: a sharding put on them would miss their batch dim)."""
    if isinstance(x, jax.core.Tracer) and not isinstance(x, BatchTracer):
        return jax.sharding.reshard(x, PartitionSpec())
    return x


def _abstract(mesh: Mesh | AbstractMesh) -> AbstractMesh:
    return mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh


def _placed(x, sharding: NamedSharding):
    """x, moved onto `sharding` first when it is a jax.Array laid out otherwise (jit refuses
    committed arguments whose sharding differs from in_shardings). With several processes a
    host value (numpy, scalars) is the global value, the same in every process: each process
    fills its own devices' pieces of it (jit takes no host values for sharded inputs there)."""
    if isinstance(x, jax.Array):
        if x.sharding == sharding or (x.sharding.is_equivalent_to(sharding, x.ndim)
                                      and not _explicit(x.sharding)):
            return x  # equality first: a step's own outputs pass without the longer check
        return jax.device_put(x, sharding)
    if jax.process_count() > 1:
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return x


def _onto(x, sharding: NamedSharding, foreign: bool = False):
    """A leaf for the program traced inside a caller's transformation, on the plan's mesh: a
    concrete array committed elsewhere (one device, another mesh) is moved as a direct call
    moves it, and so is a tracer typed with another mesh's sharding (its Explicit axes) or
    carrying an array on other devices (committed to one) under jvp, grad or vmap: jit and
    the sharding constraints on the plan's mesh refused both (an uncommitted one jit moves
    itself; moved here inside a loop under grad, its cotangent went back to one device inside
    the loop's transpose, beside operands on the mesh). `foreign`: traced under a caller's
    jax.set_mesh over another mesh, every tracer is moved, so that its cotangent goes back to
    the caller's mesh (it came back typed on the plan's, which the caller's next op refused).
    A tracer vmap batches is moved replicated: the plan's spec, put on it, would cut its batch
    dim instead of the dims it names (the program places it as planned)."""
    if not isinstance(x, jax.core.Tracer):
        return _placed(x, sharding)
    held, batched = _carried(x)
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if foreign or (mesh is not None and not mesh.empty and mesh != _abstract(sharding.mesh)) or (
            isinstance(held, jax.Array) and held.committed
            and held.sharding.device_set != sharding.device_set):
        return jax.device_put(x, NamedSharding(sharding.mesh, PartitionSpec()) if batched
                              else sharding)
    return x


def _carried(x) -> tuple[Any, bool]:
    """(the value under a tracer's layers: the concrete array, or None where a trace holds
    none (jit's); whether vmap batches it at some layer)."""
    layers = list(_layers(x))
    return layers[-1], any(isinstance(t, BatchTracer) for t in layers)


def _layers(x):
    """x and the values under it, layer by layer: the primal jvp and grad carry, the batched
    value vmap does, down to a concrete array (or None: a trace that holds no value, jit's)."""
    yield x
    while isinstance(x, jax.core.Tracer):
        x = x.val if isinstance(x, BatchTracer) else getattr(x, "primal", None)
        yield x


def _check_mapped_axes(fn, mesh: Mesh, leaves: list) -> None:
    """A ValueError where a jax.vmap around the call maps a dim that an Explicit mesh's axes
    cut (the mapped array placed so): vmap lays out that dim on those axes in every op it
    batches, the plan's sharding constraints included, and the plan's mesh lacks them (it
    failed inside JAX: "Resource axis: b ... is not found in mesh")."""
    for x in leaves:
        for t in _layers(x):
            if not isinstance(t, BatchTracer):
                continue
            data = getattr(t._trace, "axis_data", None)  # vmap's: its axis's size, mesh axes
            axes = getattr(data, "explicit_mesh_axis", None) or ()
            missing = [a for a in axes if a not in mesh.axis_names]
            if missing:
                raise ValueError(
                    f"{_name(fn)}: called under jax.vmap over a dim laid out on the Explicit "
                    f"mesh axes {missing}; vmap lays out the mapped dim on them in every op, "
                    f"and the plan's mesh ({MeshInfo.of(mesh).describe()}) has none of them. "
                    "Map over an array whose mapped dim is not cut (jax.sharding.reshard(xs, "
                    "P(None, ...))), or plan the batched function: jaxpar.shard(jax.vmap(fn)).")


def _explicit(sharding) -> bool:
    """Whether a sharding lies on a mesh with axes that are not Auto (an array placed on
    jax.make_mesh's default mesh): jit refuses it beside arrays on the plan's Auto mesh."""
    return not _all_auto(getattr(sharding, "mesh", None))


def _all_auto(mesh) -> bool:
    """Whether every axis of `mesh` is AxisType.Auto (True for None or a mesh without
    types)."""
    return all(t == AxisType.Auto for t in getattr(mesh, "axis_types", None) or ())


def _check_not_deleted(fn, args: tuple, leaves: list, donate: tuple[int, ...]) -> None:
    """A RuntimeError (JAX's kind, for a deleted array) where a leaf to donate was deleted:
    donated to an earlier call, its buffer reused. Passed again to a donating program laid out
    as it is (nothing moves it first), XLA crashed the process (a segmentation fault), as
    under jax.jit."""
    dead = [i for i in donate if isinstance(leaves[i], jax.Array) and leaves[i].is_deleted()]
    if dead:
        x, path = leaves[dead[0]], arg_paths(fn, args)[dead[0]]
        raise RuntimeError(
            f"{_name(fn)}({path}=...): the array ({x.dtype}{list(x.shape)}) has been deleted: "
            "it was donated to an earlier call (donate_argnums), which reused its buffer. Pass "
            "a new array, such as that call's result.")


def _own_buffers(flat: list, donate: tuple[int, ...]) -> list:
    """flat with each donated array that is passed elsewhere too (one array in two leaves of
    a donated pytree: tied weights) copied: a buffer donated and read again, or donated twice,
    breaks the call (XLA aborts the process on a multi-device program). Called on the leaves
    as given, before _placed: two leaves of one array on one device, each placed replicated
    on the mesh, are two arrays that share its buffer on that device."""
    given = set(donate)
    seen = {id(x) for i, x in enumerate(flat) if i not in given and isinstance(x, jax.Array)}
    out = list(flat)
    for i in donate:
        x = out[i]
        if not isinstance(x, jax.Array):
            continue
        if id(x) in seen:
            out[i] = jax.device_put(x, x.sharding, may_alias=False)
        seen.add(id(x))
    return out


def _merge(given: Spec | None, planned: Spec, path: str) -> Spec:
    if given is not None and given != planned:
        raise ValueError(f"parameter_plan[{path!r}]={planned} conflicts with in_strategy for the "
                         f"same leaf ({given}); give it in one place only.")
    return planned


def _check_compiled_memory(c: _Compiled, shapes: list, budget: float, name: str) -> None:
    """Warn when the compiled program holds more per device than `budget`, by XLA's memory
    analysis (arguments, results and temporaries, less what reuses donated arguments). The
    budget bounds the plan's modelled peak of live values (Alpa's definition); XLA's
    temporaries come on top: an operand's resharded copy while its op runs, a matmul's
    partial sum before its reduction. The first call compiled the program, so this lowering
    and compilation are cache hits."""
    try:
        compiled = c.jitted.lower(*shapes).compile()
        held = compiled_bytes(compiled)
    except Exception:  # noqa: BLE001 -- a backend without the analysis: nothing to compare
        return
    if held is None or held <= budget:
        return
    m = compiled.memory_analysis()
    warnings.warn(
        f"{name}: the compiled program holds {held:.0f} bytes per device (XLA's memory "
        f"analysis: arguments {m.argument_size_in_bytes}, results "
        f"{m.output_size_in_bytes}, temporaries {m.temp_size_in_bytes}), "
        f"{held / budget:.2f}x memory_budget={budget:.0f}. The plan keeps its modelled peak "
        f"of live values to the budget ({c.plan.cost.peak_memory_bytes:.0f} bytes); XLA's "
        "temporaries (resharded copies, partial sums before their reduction) come on top. "
        "Give a smaller budget to leave headroom.", stacklevel=4)  # the user's call


def _check_budget(plan: Plan, budget: float | None, pinned: bool = False) -> None:
    if budget is None or plan.cost.peak_memory_bytes <= budget:
        return
    if pinned:
        raise ValueError(
            f"memory_budget={budget:.0f} bytes per device: the plan given to with_plan (made "
            f"by {plan.search_mode}) needs {plan.cost.peak_memory_bytes:.0f} bytes at its "
            "peak. Plan again under the budget (without with_plan), or raise the budget.")
    raise ValueError(
        f"memory_budget={budget:.0f} bytes per device: the {plan.search_mode} plan needs "
        f"{plan.cost.peak_memory_bytes:.0f} bytes at its peak. Cut more dimensions in "
        "in_strategy/parameter_plan, use a larger mesh, or raise the budget"
        + (("; or let search_mode='dynamic_programming' (which keeps to a budget exactly) "
            "or 'recursive_programming' (which then searches exactly under it) choose the "
            "layouts: this mode searched again with larger mem_coeffs and kept the leanest "
            "plan it found.")
           if plan.search_mode == "sharding_propagation" else "."))
