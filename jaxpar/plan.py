"""Plan: what jaxpar chose for every op, what it costs, and how to read, save and check it.

A Plan holds the GraphPlan (a spec per value, a strategy per op, bodies of region ops nested)
and everything needed to show and lower it without searching again. It is saved as versioned
JSON keyed by the program's fingerprint and the mesh; loading it for another program or mesh
fails with a clear error.
"""

from __future__ import annotations

import io
import json
import math
import numbers
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from jaxpar.context import SEARCH_MODES, is_finite
from jaxpar.cost.comm import Collective
from jaxpar.cost.hardware import COLLECTIVE_KINDS
from jaxpar.cost.model import COMBINED_KINDS, OpCost
from jaxpar.ir.graph import body_operands
from jaxpar.rules.registry import OpInfo, candidates, is_local
from jaxpar.search.propagation import Choice, GraphPlan
from jaxpar.spec import MeshInfo, OpStrategy, Spec, axes_from_json

FORMAT_VERSION = 1


@dataclass(frozen=True)
class PlanCost:
    """Modeled totals per device."""

    compute_s: float
    comm_s: float
    comm_bytes: float
    peak_memory_bytes: float  # peak_memory: live values, and the outputs' end copies
    total_s: float


@dataclass(frozen=True)
class Row:
    """One line of `explain()`."""

    path: str
    op: str
    shapes: str
    chosen: str
    runner_up: str
    cost_s: float
    runner_cost_s: float | None
    note: str


class _OnDemand:
    """A Plan field that may be given as a zero-argument function, called on its first read.

    The fingerprint hashes the printed jaxpr and the rows label every op: for a 48-layer GPT
    step that is more time than the search, spent for a plan that is only run (nothing reads
    them but save, explain and a pinned plan's check)."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, obj, owner=None):
        if obj is None:  # dataclass asks for a default: there is none
            raise AttributeError(self.slot)
        value = obj.__dict__[self.slot]
        if callable(value):
            value = obj.__dict__[self.slot] = value()
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = value


@dataclass
class Plan:
    """A sharding plan for one program on one mesh. See `jaxpar.shard`.

    `fingerprint` and `rows` may be given as functions that make them (see _OnDemand)."""

    fingerprint: str = _OnDemand()
    mesh: MeshInfo
    graph_plan: GraphPlan
    flat_in_specs: list[Spec]   # one per argument leaf (in_specs: as PartitionSpecs, the tree)
    flat_out_specs: list[Spec]  # one per output leaf
    in_paths: list[str]
    out_paths: list[str]
    cost: PlanCost
    collectives: dict[str, dict[str, float]]
    rows: list[Row] = _OnDemand()
    search_mode: str = "sharding_propagation"
    hardware: str = "cpu"
    # The structures are no part of a plan's equality (the paths name the leaves): a loaded
    # plan holds them once bound, and PyTreeDef == None raises.
    in_tree: object = field(default=None, compare=False)
    out_tree: object = field(default=None, compare=False)
    notes: list[str] = field(default_factory=list)  # what the search reports (optimality, ...)
    layout: str = ""  # the logical mesh the plan uses, e.g. "dp4 x tp2" (see describe_layout)
    decisions: list[str] = field(default_factory=list)  # recursive_programming's decision log
    objective: str = ""  # what the search minimised: "level 0, mem_coeff 0.1" and any budget
    # A loaded plan's structures as its file holds them (_tree_to_json): shown by in_specs and
    # out_specs until the plan is bound to arguments, which give in_tree and out_tree.
    file_trees: tuple = field(default=(None, None), repr=False, compare=False)

    @property
    def in_specs(self):
        """The arguments' PartitionSpecs, in the structure of the arguments. A plan loaded from
        a file has it where the file holds it (tuples, lists, dicts with string keys, None)
        and once bound to arguments (with_plan and a call or .plan); a flat list otherwise (a
        NamedTuple's or dataclass's structure is not written)."""
        return _unflatten(self._tree(0), [s.to_pspec() for s in self.flat_in_specs])

    @property
    def out_specs(self):
        """The outputs' PartitionSpecs, in the structure of the outputs (see in_specs)."""
        return _unflatten(self._tree(1), [s.to_pspec() for s in self.flat_out_specs])

    def _tree(self, side: int):
        """The structure of the arguments (0) or outputs (1): the one bound, else the file's."""
        return (self.in_tree, self.out_tree)[side] or self.file_trees[side]

    def table(self) -> Table:
        """The per-op plan as a rich Table."""
        layout = f" as {self.layout}" if self.layout else ""
        t = Table(title=f"jaxpar plan ({self.search_mode}, {self.mesh.describe()}{layout}, "
                        f"{self.hardware})", show_lines=False)
        for col in ("#", "op", "shapes", "chosen", "runner-up", "cost", "next", "note"):
            t.add_column(col, overflow="fold")
        for r in self.rows:
            t.add_row(*(Text(c) for c in (r.path, r.op, r.shapes, r.chosen, r.runner_up,
                                           _fmt_s(r.cost_s), _fmt_s(r.runner_cost_s), r.note)))
        return t

    def explain(self, width: int = 160, decisions: bool = False) -> str:
        """The plan as text: one row per op (chosen spec, runner-up, modeled costs), totals;
        with decisions=True also the search's decision log (recursive_programming)."""
        if isinstance(width, bool) or not isinstance(width, numbers.Integral) or width < 1:
            raise ValueError(f"Plan.explain: width={width!r} must be a positive whole number of "
                             "columns (default 160).")
        if not isinstance(decisions, bool):
            raise TypeError(f"Plan.explain: decisions={decisions!r} must be True or False.")
        buf = io.StringIO()
        console = Console(file=buf, width=width, force_terminal=False, color_system=None,
                          markup=False, highlight=False)
        console.print(self.table())
        c = self.cost
        for label, paths, specs in (("inputs: ", self.in_paths, self.flat_in_specs),
                                    ("outputs:", self.out_paths, self.flat_out_specs)):
            pairs = zip(paths, specs, strict=True)
            console.print(f"{label} {', '.join(f'{p}={s}' for p, s in pairs)}")
        console.print(f"modeled per device: compute {_fmt_s(c.compute_s)}, communication "
                      f"{_fmt_s(c.comm_s)} ({_fmt_b(c.comm_bytes)}), peak memory "
                      f"{_fmt_b(c.peak_memory_bytes)}, total {_fmt_s(c.total_s)}")
        if self.layout:
            console.print(f"logical mesh: {self.layout}")
        if self.objective:
            console.print(f"searched for: {self.objective}")
        for note in self.notes:
            console.print(note)
        if self.decisions and decisions:
            console.print("decisions:")
            for line in self.decisions:
                console.print(f"  {line}")
        elif self.decisions:
            console.print(f"{len(self.decisions)} search decisions logged: "
                          "plan.explain(decisions=True) lists them")
        console.print("predicted collectives: " + (", ".join(
            f"{k} x{v['count']:g} {_fmt_b(v['bytes'])}" for k, v in self.collectives.items())
            or "none"))
        return buf.getvalue()

    def verify(self, compiled, rtol: float = 0.10):
        """Predicted vs measured collectives and output shardings of a compiled program."""
        if isinstance(rtol, bool) or not isinstance(rtol, numbers.Real) or \
                not is_finite(rtol) or rtol < 0:
            raise ValueError(f"Plan.verify: rtol={rtol!r} must be a finite number >= 0, the "
                             "relative tolerance on collective bytes (default 0.1).")
        from jaxpar.verify import verify_plan
        return verify_plan(self, compiled, rtol)

    def check_fits(self, graph, where: str = "plan") -> None:
        """A ValueError unless the plan's specs fit `graph`, the program it was made for
        (check_matches passed): every spec has its value's rank and cuts each dim into equal
        pieces, and every op's strategy has one spec per operand and result (loop bodies'
        plans likewise). A plan file edited by hand fails here, not inside jax.sharding."""
        problems = []

        def check(what: str, spec: Spec, shape) -> None:
            stray = [a for a in spec.axes() if a not in self.mesh.names]
            if stray:
                problems.append(f"{what} is {spec}, which names axes {stray} outside the "
                                f"mesh {self.mesh.describe()}")
            elif any(tuple(d) != self.mesh.order(d) for d in spec.dims):
                problems.append(f"{what} is {spec}, whose axes of one dim are out of the "
                                f"mesh's order {self.mesh.describe()}")
            elif spec.rank != len(shape):
                problems.append(f"{what} is {spec}, of rank {spec.rank}, for an array of "
                                f"shape {tuple(shape)}")
            elif not spec.fits(tuple(shape), self.mesh):
                problems.append(f"{what} is {spec}, which does not cut shape {tuple(shape)} "
                                f"into equal pieces on mesh {self.mesh.describe()}")

        for side, specs, values in (("in_specs", self.flat_in_specs, graph.inputs),
                                    ("out_specs", self.flat_out_specs, graph.outputs)):
            if len(specs) != len(values):
                problems.append(f"{side} holds {len(specs)} specs for {len(values)} arrays")
                continue
            for k, (spec, v) in enumerate(zip(specs, values, strict=True)):
                check(f"{side}[{k}]", spec, graph.shape(v))
                held = self.graph_plan.specs.get(v) if side == "in_specs" else None
                if held is not None and held.resolved() != spec.resolved():
                    problems.append(f"in_specs[{k}] is {spec} where the plan's ops read that "
                                    f"input as {held}")
        _check_graph_plan(graph, self.graph_plan, check, problems, "graph", self.mesh)
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise ValueError(f"{where} does not fit this program: {'; '.join(problems[:3])}"
                             f"{more}. The file was edited or is corrupt; plan again.")

    def check_matches(self, fingerprint: str, mesh: MeshInfo, where: str = "plan") -> None:
        if self.mesh != mesh:
            raise ValueError(f"{where} was made for mesh {self.mesh.describe()}, not "
                             f"{mesh.describe()}; plan again for this mesh.")
        if self.fingerprint != fingerprint:
            raise ValueError(f"{where} was made for another program (fingerprint "
                             f"{self.fingerprint}, this one is {fingerprint}): the function, "
                             "its argument shapes or dtypes differ. Plan again.")

    def check_structure(self, in_tree, out_tree, where: str = "plan") -> None:
        """A ValueError when the plan was made for arguments or outputs of another pytree
        structure: the same program over other dict keys, a list for a tuple (its specs go
        leaf by leaf in its own structure's order, and its results would come back in it).
        A structure the plan does not hold (a file that could not write a NamedTuple's) is
        not checked: binding takes these."""
        for known, here, what in ((self._tree(0), in_tree, "arguments"),
                                  (self._tree(1), out_tree, "outputs")):
            if known is not None and known != here:
                raise ValueError(
                    f"{where} was made for {what} of pytree structure {known}, not {here}: "
                    "the program is the same but its leaves are named or nested otherwise "
                    "(dict keys, a list for a tuple), and the plan's specs go leaf by leaf in "
                    f"its own structure. Pass {what} in the plan's structure, or plan again.")

    def save(self, path: str | Path) -> None:
        save_plans([self], path, "Plan.save")

    @staticmethod
    def load(path: str | Path) -> Plan:
        return _one_plan(_read_plan_file(path, "Plan.load"), path, "Plan.load")

    def to_json(self) -> dict:
        return {"format": "jaxpar-plan", "version": FORMAT_VERSION,
                "fingerprint": self.fingerprint,
                "mesh": {"names": list(self.mesh.names), "sizes": list(self.mesh.sizes)},
                "search_mode": self.search_mode, "hardware": self.hardware,
                "in_specs": [s.to_json() for s in self.flat_in_specs],
                "out_specs": [s.to_json() for s in self.flat_out_specs],
                "in_paths": self.in_paths, "out_paths": self.out_paths,
                "in_tree": _tree_to_json(self._tree(0)),
                "out_tree": _tree_to_json(self._tree(1)),
                "cost": asdict(self.cost), "collectives": self.collectives,
                "rows": [asdict(r) for r in self.rows], "notes": self.notes,
                "layout": self.layout, "decisions": self.decisions,
                "objective": self.objective, "graph": _graph_to_json(self.graph_plan)}

    @staticmethod
    def from_json(d: dict) -> Plan:
        """The Plan `to_json()` wrote (json.load of a plan file; Plan.load reads one). A
        TypeError for what is no dict, a ValueError naming the field that is malformed."""
        if not isinstance(d, dict):
            raise TypeError(f"Plan.from_json(d={type(d).__name__}): pass the dict "
                            "Plan.to_json() gives (json.load of a plan file), or read a file "
                            "with Plan.load(path).")
        try:
            return Plan._from_dict(d)
        except KeyError as err:
            raise ValueError(f"field {err.args[0]!r} is missing; a plan holds what "
                             "Plan.to_json() writes") from None
        except (TypeError, AttributeError) as err:
            raise ValueError(f"a field is malformed ({err}); a plan holds what "
                             "Plan.to_json() writes") from None

    @staticmethod
    def _from_dict(d: dict) -> Plan:
        if not isinstance(d["mesh"], dict):
            raise ValueError(f"field mesh: {{\"names\": [...], \"sizes\": [...]}} expected, not "
                             f"{d['mesh']!r}")
        names, sizes = d["mesh"]["names"], d["mesh"]["sizes"]
        if not isinstance(names, list) or not isinstance(sizes, list) or \
                len(names) != len(sizes) or len(set(map(str, names))) != len(names) or \
                not all(isinstance(n, str) for n in names) or \
                not all(type(k) is int and k > 0 for k in sizes):
            raise ValueError(f"field mesh: distinct axis names and as many whole sizes of 1 "
                             f"or more expected, not names={names!r}, sizes={sizes!r}")
        mesh = MeshInfo(tuple(names), tuple(sizes))
        specs = {}
        for side in ("in", "out"):
            if not isinstance(d[f"{side}_specs"], list):
                raise ValueError(f"field {side}_specs: a list of specs expected")
            try:
                specs[side] = [Spec.from_json(s) for s in d[f"{side}_specs"]]
            except ValueError as err:
                raise ValueError(f"field {side}_specs: {err}") from None
        for side, got in specs.items():  # what the program is lowered with: checked here, or
            paths = d[f"{side}_paths"]  # a stray axis ends inside jax.sharding
            if not isinstance(paths, list) or len(paths) != len(got) or \
                    not all(isinstance(p, str) for p in paths):
                raise ValueError(f"field {side}_paths: {len(got)} names expected")
            for spec in got:
                if not set(spec.axes()) <= set(mesh.names):
                    raise ValueError(f"field {side}_specs: {spec} uses axes outside the mesh "
                                     f"{mesh.describe()}")
        collectives = d["collectives"]
        if not isinstance(collectives, dict) or not all(
                k in COLLECTIVE_KINDS and isinstance(v, dict) and {"count", "bytes"} <= set(v)
                and _amount(v["count"]) and _amount(v["bytes"])
                for k, v in collectives.items()):
            raise ValueError(f"field collectives: {{kind: {{count: number, bytes: number}}}} "
                             f"expected, numbers of 0 or more and kinds among "
                             f"{', '.join(COLLECTIVE_KINDS)}")
        cost = d["cost"]
        if not isinstance(cost, dict) or set(cost) != set(PlanCost.__dataclass_fields__) or \
                not all(map(_amount, cost.values())):
            raise ValueError(f"field cost: a number of 0 or more for each of "
                             f"{', '.join(PlanCost.__dataclass_fields__)} expected")
        rows = d["rows"]
        if not isinstance(rows, list) or not all(
                isinstance(r, dict) and set(r) == set(Row.__dataclass_fields__) and
                _amount(r["cost_s"], False) and
                (r["runner_cost_s"] is None or _amount(r["runner_cost_s"], False)) and
                all(isinstance(r[k], str) for k in ("path", "op", "shapes", "chosen",
                                                    "runner_up", "note")) for r in rows):
            raise ValueError("field rows: a list of explain() rows expected")
        for key in ("notes", "decisions"):
            if not isinstance(d.get(key, []), list) or \
                    not all(isinstance(line, str) for line in d.get(key, [])):
                raise ValueError(f"field {key}: a list of strings expected")
        for key in ("search_mode", "hardware", "layout", "fingerprint", "objective"):
            if not isinstance(d.get(key, ""), str):
                raise ValueError(f"field {key}: a string expected")
        if d["search_mode"] not in SEARCH_MODES:
            raise ValueError(f"field search_mode: one of {list(SEARCH_MODES)} expected, not "
                             f"{d['search_mode']!r}")
        try:
            graph = _graph_from_json(d["graph"])
        except KeyError as err:
            raise ValueError(f"field graph: an entry lacks {err.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"field graph: {err}") from None
        stray = sorted(_graph_axes(graph) - set(mesh.names))
        if stray:
            raise ValueError(f"field graph: its specs name axes {stray} outside the mesh "
                             f"{mesh.describe()}")
        trees = []
        for side in ("in", "out"):
            try:  # written since this field was added; files without it load flat
                trees.append(_tree_from_json(d.get(f"{side}_tree"), len(specs[side])))
            except (TypeError, ValueError) as err:
                raise ValueError(f"field {side}_tree: {err}") from None
        return Plan(d["fingerprint"], mesh,
                    graph, specs["in"], specs["out"], d["in_paths"],
                    d["out_paths"], PlanCost(**cost), collectives, [Row(**r) for r in rows],
                    d["search_mode"], d["hardware"], notes=list(d.get("notes", [])),
                    layout=d.get("layout", ""), decisions=list(d.get("decisions", [])),
                    objective=d.get("objective", ""), file_trees=tuple(trees))


def _number(x, finite: bool = True) -> bool:
    """A JSON number (not a bool), finite unless `finite` is False (a runner-up no plan may
    take costs inf)."""
    return isinstance(x, int | float) and not isinstance(x, bool) and \
        (is_finite(x) or not finite)


def _amount(x, finite: bool = True) -> bool:
    """A _number of 0 or more: seconds, bytes, counts."""
    return _number(x, finite) and x >= 0


def _partial_sets(s: OpStrategy) -> tuple[frozenset[str], ...]:
    """The axes each result of `s` is left partial over, whatever their order."""
    return tuple(frozenset(p) for p in s.partial)


def _offered_partials(op, graph, s: OpStrategy, mesh: MeshInfo
                      ) -> set[tuple[frozenset[str], ...]]:
    """The partial axes the op's rule gives the strategies it offers with `s`'s operand and
    result specs: `s` is one of them where its own are among these; none where the rule
    offers no strategy with those specs (a layout edited by hand, priced again as it is:
    as_run)."""
    return {_partial_sets(c) for c in candidates(OpInfo.of(op, graph), mesh)
            if c.ins == s.ins and c.outs == s.outs}


def _partial_text(partial) -> str:
    """Each result's partial axes, as a plan's error names them: "[d0+d1] [-]"."""
    return " ".join(f"[{'+'.join(sorted(p)) or '-'}]" for p in partial)


def _check_graph_plan(graph, gp: GraphPlan, check, problems: list[str], where: str,
                      mesh: MeshInfo) -> None:
    """Plan.check_fits' work on one graph (a loop body's: recursively): `check(what, spec,
    shape)` for each value's spec and each op's strategy; what is missing goes to `problems`."""
    read = {v for op in graph.ops for v in op.inputs if isinstance(v, int)}
    read.update(v for v in graph.outputs  # (a constant returned unread is whole: out_spec)
                if isinstance(v, int) and v not in graph.consts)
    unplanned = sorted(read - set(gp.specs))
    if unplanned:  # the lowering reads each operand's and output's planned spec
        more = f" (and {len(unplanned) - 5} more)" if len(unplanned) > 5 else ""
        problems.append(f"{where}.specs has no spec for values {unplanned[:5]}{more}, which "
                        "ops read or the program returns")
    for v, spec in gp.specs.items():
        if not 0 <= v < len(graph.values):
            problems.append(f"{where}.specs names value {v}, which the program has not")
        else:
            check(f"{where}.specs[{v}]", spec, graph.shape(v))
    stray = sorted(x for x in gp.choices if not 0 <= x < len(graph.ops))
    if stray:  # ops the program has not: a choice of another program's, or a mistyped id
        problems.append(f"{where}.choices names ops {stray[:5]}, which the program has not "
                        f"(its ops are 0 to {len(graph.ops) - 1})")
    for op in graph.ops:
        choice = gp.choices.get(op.index)
        what = f"{where}.choices[{op.index}] ({op.name})"
        if choice is None:
            problems.append(f"{what} is missing")
            continue
        s = choice.strategy
        if len(s.ins) != len(op.inputs) or len(s.outs) != len(op.outputs) or \
                len(s.partial) != len(op.outputs):
            problems.append(f"{what} has {len(s.ins)} operand and {len(s.outs)} result "
                            f"specs for an op of {len(op.inputs)} operands and "
                            f"{len(op.outputs)} results")
            continue
        for i, (spec, v) in enumerate(zip(s.ins, op.inputs, strict=True)):
            check(f"{what} operand {i}", spec, graph.shape(v))
        for j, (spec, v) in enumerate(zip(s.outs, op.outputs, strict=True)):
            check(f"{what} result {j}", spec, graph.shape(v))
            held = gp.specs.get(v)
            if held is not None and held.resolved() != spec.resolved():
                # The program runs the values' specs; explain() shows the strategies. A search
                # keeps them one (checked on every program and mode of the suite's models).
                problems.append(f"{what} makes result {j} as {spec}, where {where}.specs[{v}] "
                                f"holds it as {held}")
        local = is_local(op.primitive)
        offered = _offered_partials(op, graph, s, mesh) if local or not op.regions else set()
        if local and _partial_sets(s) not in offered:
            # Bound per shard (registry.LOCAL): each device computes on its own block, so a
            # strategy the op's rule does not offer (top_k cut along its sorted dim) gives wrong
            # numbers; every other op is partitioned by XLA, which keeps any layout correct.
            problems.append(f"{what} takes {', '.join(map(str, s.ins))} to "
                            f"{', '.join(map(str, s.outs))}, which its rule does not offer: "
                            "the op runs per shard and would compute another result")
        elif offered and _partial_sets(s) not in offered:
            # Which results are partial sums, and over which axes, follows from the specs (a
            # matmul's contracted dim cut): the lowering and the cost read it, and explain()
            # shows the specs alone, so an edit to it alone went unseen.
            problems.append(f"{what} leaves its results partial over "
                            f"{_partial_text(s.partial)}, where with operands "
                            f"{', '.join(map(str, s.ins))} and results "
                            f"{', '.join(map(str, s.outs))} it leaves them partial over "
                            + " or ".join(sorted(_partial_text(p) for p in offered)))
        if op.regions and len(choice.regions) == len(op.regions):
            for r, (body, plan) in enumerate(zip(op.regions, choice.regions, strict=True)):
                _check_graph_plan(body, plan, check, problems, f"{what} body {r}", mesh)
        elif op.regions:
            problems.append(f"{what} plans {len(choice.regions)} bodies for an op of "
                            f"{len(op.regions)}")


def save_plans(plans: list[Plan], path: str | Path, where: str = "save_plans") -> None:
    """Several plans of one function (one per input signature) in one JSON file: one plan as
    Plan.save writes it, more as {"format": "jaxpar-plans", "plans": [...]}; load_plans
    reads both. `where` names the caller in errors."""
    check_writable(path, where)
    data = plans[0].to_json() if len(plans) == 1 else {
        "format": "jaxpar-plans", "version": FORMAT_VERSION,
        "plans": [p.to_json() for p in plans]}
    try:
        Path(path).write_text(json.dumps(data, indent=1))
    except OSError as err:
        what = "the plan" if len(plans) == 1 else "the plans"
        raise ValueError(f"{where}({str(path)!r}): cannot write {what} ({err}); pass a "
                         "path in a directory that exists and is writable.") from None


def load_plans(path: str | Path) -> list[Plan]:
    """The plans in a file save_plans (or Plan.save) wrote, in their order."""
    data = _read_plan_file(path, "load_plans")
    if not isinstance(data, dict) or data.get("format") != "jaxpar-plans":
        return [_one_plan(data, path, "load_plans")]
    _check_version(data, path, "load_plans")
    plans = data.get("plans")
    if not isinstance(plans, list) or not plans:
        raise ValueError(f"load_plans({str(path)!r}): corrupt plan file (no list of plans).")
    return [_one_plan(d, path, "load_plans") for d in plans]  # each checked as a plan file


def _read_plan_file(path, where: str):
    """The JSON in a plan file (a ValueError naming `where` when it cannot be read)."""
    _check_path(path, where)
    try:
        return json.loads(Path(path).read_text())
    except RecursionError:  # JSON nested deeper than Python's stack: no plan is
        why = "nested too deeply"
    except (OSError, UnicodeDecodeError, ValueError) as err:  # ValueError: JSONDecodeError,
        why = str(err)[:200]  # and ints of more digits than Python converts
    raise ValueError(f"{where}({str(path)!r}): cannot read a plan ({why}); pass a file "
                     "Plan.save or save_plans wrote.")


def _one_plan(data, path, where: str) -> Plan:
    """The plan of a single-plan file's JSON (Plan.save's format)."""
    if isinstance(data, dict) and data.get("format") == "jaxpar-plans":
        plans = data.get("plans")
        held = f"{len(plans)} plans" if isinstance(plans, list) else "plans"
        raise ValueError(f"{where}({str(path)!r}): this file holds {held}, "
                         "one per argument signature (an AutoParallel strategy file "
                         "written for several input shapes); load it with "
                         "jaxpar.plan.load_plans, or give the AutoParallel it was written by "
                         "load_operator_strategy_file.")
    if not isinstance(data, dict) or data.get("format") != "jaxpar-plan":
        raise ValueError(f"{where}({str(path)!r}): not a jaxpar plan file.")
    _check_version(data, path, where)
    return _from_json(data, path, where)


def _check_version(data: dict, path, where: str) -> None:
    if data.get("version") != FORMAT_VERSION:
        raise ValueError(f"{where}({str(path)!r}): format version {data.get('version')!r} "
                         f"is not {FORMAT_VERSION}; plan again with this jaxpar.")


def _from_json(d, path, where: str) -> Plan:
    try:
        return Plan.from_json(d)
    except (TypeError, ValueError) as err:  # from_json says what any other error meant
        raise ValueError(f"{where}({str(path)!r}): corrupt plan file ({err}).") from None


def _tree_to_json(tree):
    """A pytree structure of tuples, lists, dicts with string keys and None as JSON (a leaf is
    "*"), or None where it holds another node (a NamedTuple, a dataclass, a flax struct)."""
    import jax

    if tree is None:
        return None

    def encode(x):
        if x is _LEAF:
            return "*"
        if x is None:
            return {"none": None}
        if type(x) in (tuple, list):
            items = [encode(y) for y in x]
            return None if None in items else {type(x).__name__: items}
        if type(x) is dict and all(isinstance(k, str) for k in x):
            items = [[k, encode(v)] for k, v in x.items()]
            return None if any(v is None for _, v in items) else {"dict": items}
        return None

    return encode(jax.tree_util.tree_unflatten(tree, [_LEAF] * tree.num_leaves))


def _tree_from_json(obj, leaves: int):
    """The structure _tree_to_json wrote (None for none), checked to hold `leaves` leaves."""
    import jax

    if obj is None:
        return None

    def decode(x):
        if x == "*":
            return 0
        if not isinstance(x, dict) or len(x) != 1:
            raise ValueError(f"{x!r} is no pytree node")
        (kind, items), = x.items()
        if kind == "none" and items is None:
            return None
        if kind in ("tuple", "list") and isinstance(items, list):
            return (tuple if kind == "tuple" else list)(decode(y) for y in items)
        if kind == "dict" and isinstance(items, list) and all(
                isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], str) for kv in items):
            return {k: decode(v) for k, v in items}
        raise ValueError(f"{x!r} is no pytree node")

    tree = jax.tree_util.tree_structure(decode(obj))
    if tree.num_leaves != leaves:
        raise ValueError(f"{tree.num_leaves} leaves where the file has {leaves} specs")
    return tree


class _Leaf:
    """The marker of a leaf while a structure is written (never a user's value)."""


_LEAF = _Leaf()


def _unflatten(tree, leaves):
    import jax
    return leaves if tree is None else jax.tree_util.tree_unflatten(tree, leaves)


def _fmt_s(s: float | None) -> str:
    if s is None:
        return ""
    for unit, k in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= k:
            return f"{s / k:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


def _fmt_b(b: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= k:
            return f"{b / k:.3g} {unit}"
    return f"{b:.0f} B"


def _strategy_json(s: OpStrategy | None):
    if s is None:
        return None
    return {"ins": [x.to_json() for x in s.ins], "outs": [x.to_json() for x in s.outs],
            "partial": [list(p) for p in s.partial], "name": s.name}


def _strategy_from(d) -> OpStrategy | None:
    if d is None:
        return None
    if not all(isinstance(d[k], list) for k in ("ins", "outs", "partial")):
        raise ValueError(f"a strategy's ins, outs and partial are lists, not {d!r}")
    return OpStrategy(tuple(Spec.from_json(x) for x in d["ins"]),
                      tuple(Spec.from_json(x) for x in d["outs"]),
                      tuple(axes_from_json(p, d) for p in d["partial"]),
                      d["name"])


def _graph_to_json(gp: GraphPlan) -> dict:
    return {"specs": {str(v): s.to_json() for v, s in gp.specs.items()},
            "choices": {str(i): _choice_json(c) for i, c in gp.choices.items()}}


_CHOICE_COSTS = ("compute_s", "comm_s", "comm_bytes", "memory_bytes")  # a plan file's op costs


def _choice_json(c: Choice) -> dict:
    cost = {k: getattr(c.cost, k) for k in _CHOICE_COSTS}
    cost["collectives"] = [[x.kind, list(x.axes), x.bytes, x.count] for x in c.cost.collectives]
    return {"strategy": _strategy_json(c.strategy), "runner_up": _strategy_json(c.runner_up),
            "score": c.score, "runner_score": c.runner_score, "n": c.n_candidates,
            "has_rule": c.has_rule, "trips": c.trips, "cost": cost,
            "regions": [_graph_to_json(r) for r in c.regions]}


def _graph_from_json(d: dict) -> GraphPlan:
    if not isinstance(d, dict) or not isinstance(d.get("specs"), dict) or \
            not isinstance(d.get("choices"), dict):
        raise ValueError("{specs: {value: spec}, choices: {op: choice}} expected")
    return GraphPlan({int(v): Spec.from_json(s) for v, s in d["specs"].items()},
                     {int(i): _choice_from(i, c) for i, c in d["choices"].items()})


def _graph_axes(gp: GraphPlan) -> set[str]:
    """Every mesh axis a graph plan's specs and strategies name (loop bodies' included)."""
    found = {a for s in gp.specs.values() for a in s.axes()}
    for c in gp.choices.values():
        for s in (c.strategy, c.runner_up):
            if s is not None:
                found.update(a for sp in s.ins + s.outs for a in sp.axes())
                found.update(a for p in s.partial for a in p)
        found.update(a for col in c.cost.collectives for a in col.axes)
        for body in c.regions:
            found |= _graph_axes(body)
    return found


def _choice_from(op: str, d: dict) -> Choice:
    if d["strategy"] is None:  # (a runner-up may be missing: no other candidate)
        raise ValueError(f"op {op}'s strategy is missing")
    _check_choice(op, d)
    cost = dict(d["cost"])
    cols = tuple(Collective(k, tuple(a), b, n) for k, a, b, n in cost.pop("collectives"))
    return Choice(_strategy_from(d["strategy"]), OpCost(**cost, collectives=cols), d["score"],
                  _strategy_from(d["runner_up"]), d["runner_score"], d["n"], d["has_rule"],
                  tuple(_graph_from_json(r) for r in d["regions"]), d["trips"])


def _check_choice(op: str, d: dict) -> None:
    """What op `op`'s choice must hold for explain() and verify() to read it: seconds, bytes
    and counts as numbers of 0 or more (a runner-up's score may be inf), collectives of a kind
    jaxpar predicts, whole candidate and trip counts, has_rule a bool."""
    def check(ok: bool, key: str, value, expected: str) -> None:
        if not ok:
            raise ValueError(f"op {op}'s {key}: {expected} expected, not {value!r}")
    check(_amount(d["score"]), "score", d["score"], "a number of 0 or more")
    runner = d["runner_score"]
    check(runner is None or _amount(runner, False), "runner_score", runner,
          "a number of 0 or more (or null)")
    for key, least in (("n", 1), ("trips", 0)):
        check(type(d[key]) is int and d[key] >= least, key, d[key],
              f"a whole number of {least} or more")
    check(isinstance(d["has_rule"], bool), "has_rule", d["has_rule"], "true or false")
    cost = d["cost"]
    fields = (*_CHOICE_COSTS, "collectives")
    check(isinstance(cost, dict) and set(cost) == set(fields), "cost", cost,
          f"{{{', '.join(fields)}}}")
    for key in _CHOICE_COSTS:
        check(_amount(cost[key]), f"cost.{key}", cost[key], "a number of 0 or more")
    check(isinstance(cost["collectives"], list) and all(
        isinstance(c, list) and len(c) == 4 and c[0] in COLLECTIVE_KINDS and
        isinstance(c[1], list) and all(isinstance(a, str) for a in c[1]) and
        _amount(c[2]) and _amount(c[3]) for c in cost["collectives"]),
          "cost.collectives", cost["collectives"],
          f"[kind, [axis names], bytes, count] (kind one of {list(COLLECTIVE_KINDS)}, bytes and "
          "count numbers of 0 or more)")
    check(isinstance(d["regions"], list), "regions", d["regions"], "a list of loop bodies' plans")
    for key in ("strategy", "runner_up"):  # (a name explain() prints)
        s = d[key]
        check(s is None or isinstance(s, dict) and isinstance(s.get("name"), str),
              f"{key}.name", s.get("name") if isinstance(s, dict) else s, "a str")


def tail_latency(graph, gp: GraphPlan, model, ops=None,
                 sliced: dict[int, OpCost] | None = None) -> float:
    """Seconds to add to graph_cost's communication for the step's tail (OpGraph.tail_values:
    the gradient reductions), priced as XLA runs it: one latency per kind and device group,
    and one for each reduction waiting for another of its group (search.exact.tail_groups,
    tail_latency: a global norm's sum of squares for its gradient's all-reduce, which XLA
    does not combine with it), where graph_cost
    gives each reduction a share of one (a third of a latency for an Adam step's one combined
    gradient all-reduce). The groups are those of the collectives each op's cost holds: a
    partial sum reduce-scattered over some axes and all-reduced over others is two groups
    (exact._reductions, from the strategy alone, counts it one: its tables' coarser price).
    ops: the indices of the ops to count (None: all). sliced: the ops' costs as
    graph_cost(shared=True) took them (propagation.sliced_reductions: the reduce-scatters XLA
    makes of all-reduces whose every reader slices the result count as such); None: each
    op's own."""
    from jaxpar.search.exact import tail_latency as combined

    return combined(graph, model, tail_reductions(graph, gp, ops, sliced))


def tail_reductions(graph, gp: GraphPlan, ops=None, sliced: dict[int, OpCost] | None = None,
                    waits=None) -> dict[tuple, int]:
    """{(kind, axes, round): how many} of the all-reduces and reduce-scatters the step's tail
    ops run in plan `gp` (search.exact.tail_groups, `waits` passed on); ops and sliced as for
    tail_latency."""
    from jaxpar.search.exact import tail_groups

    costs, choices = sliced or {}, gp.choices

    def reductions(x: int) -> list | None:
        choice = choices.get(x)
        if choice is None:
            return None
        return [(c.kind, c.axes, c.count) for c in costs.get(x, choice.cost).collectives
                if c.kind in COMBINED_KINDS]

    return tail_groups(graph, reductions, ops, waits)


def build_plan(graph, gp: GraphPlan, model, traced, in_specs: list[Spec], out_specs: list[Spec],
               search_mode: str, hardware: str, weights: set[int] | None = None) -> Plan:
    """Assemble a Plan: totals, predicted collectives, peak memory and the explain rows.
    weights: the input values that are weights (for describe_layout)."""
    cost, collectives = _priced(graph, gp, model, out_specs)
    return Plan(lambda: traced.fingerprint, model.mesh, gp, in_specs, out_specs,
                list(traced.in_paths), list(traced.out_paths), cost, collectives,
                lambda: list(_rows(graph, gp, model)), search_mode, hardware, traced.in_tree,
                traced.out_tree, layout=describe_layout(graph, gp, model.mesh, weights))


def _priced(graph, gp: GraphPlan, model, out_specs: list[Spec]
            ) -> tuple[PlanCost, dict[str, dict[str, float]]]:
    """A plan's totals and predicted collectives (by kind) from its strategies and specs."""
    from jaxpar.search.propagation import graph_cost, sliced_reductions

    back = dict(enumerate(out_specs))
    sliced = sliced_reductions(graph, gp, model, back)
    total = graph_cost(graph, gp, model, back, shared=True, sliced=sliced)
    comm = total.comm_s + tail_latency(graph, gp, model, sliced=sliced)
    peak = peak_memory(graph, gp, model.mesh, dict(enumerate(out_specs)))
    return (PlanCost(total.compute_s, comm, total.comm_bytes, peak, total.compute_s + comm),
            _by_kind(total.collectives))


def as_run(plan: Plan, graph, model, traced) -> None:
    """Bring a plan pinned to a program (checked by check_fits) to what the program runs, in
    place, as binding it to the arguments' structure is. A plan file holds what explain()
    shows (rows, cost, predicted collectives) beside the strategies and specs the program
    runs; edited by hand, the two part. Where an op's strategy is not the one its row was
    saved with, that op is priced again under `model` (its runner-up, from a search that did
    not choose it, dropped) and the rows, cost and collectives are made again from the
    strategies, the plan's `hardware` then `model`'s profile, with a note naming the ops; a
    loop body's op keeps its saved price (a loop is priced as its search planned its bodies).
    Where every strategy is as saved but the file's predicted collectives are not those of
    the specs it runs (its out_specs edited: an output gathered that the saved cost never
    moved), the cost and collectives are made again, the rows kept, with a note. The peak is
    always counted again from the specs: a file's may be edited, and the arguments given to
    donate change it."""
    gp, out_specs = plan.graph_plan, dict(enumerate(plan.flat_out_specs))
    loaded = not callable(plan.__dict__.get("_rows"))  # else rows made from the strategies
    edited = []
    if loaded:
        saved = {r.path: r.chosen for r in plan.rows}
        edited = [path for path, label in _labels(graph, gp)
                  if saved.get(path, label) != label]
    if not edited:
        if not loaded:
            peak = peak_memory(graph, gp, model.mesh, out_specs)
        else:
            cost, collectives = _priced(graph, gp, model, plan.flat_out_specs)
            if not _same_collectives(collectives, plan.collectives):
                plan.cost, plan.collectives = cost, collectives
                plan.notes = [*plan.notes, "priced again: the file's predicted collectives are "
                              "not those of the specs it runs (its out_specs edited, or saved "
                              "under other settings); the cost and collectives are those of "
                              "the specs run"]
                return
            peak = cost.peak_memory_bytes  # counted by _priced from the specs, as below
        plan.cost = replace(plan.cost, peak_memory_bytes=peak)
        return
    choices = dict(gp.choices)
    for path in edited:
        if "." not in path:
            op, was = graph.ops[int(path)], gp.choices[int(path)]
            if op.regions:
                continue
            cost = model.op(OpInfo.of(op, graph), was.strategy, graph.op_latency_share(op))
            choices[op.index] = Choice(was.strategy, cost, model.score(cost), None, None,
                                       was.n_candidates, was.has_rule)
    again = build_plan(graph, GraphPlan(dict(gp.specs), choices), model, traced,
                       plan.flat_in_specs, plan.flat_out_specs, plan.search_mode,
                       model.profile.name)
    shown = ", ".join(edited[:5]) + (f" and {len(edited) - 5} more" if len(edited) > 5 else "")
    kept = " (in loop bodies: priced as saved)" if any("." in p for p in edited) else ""
    plan.graph_plan, plan.cost, plan.collectives = again.graph_plan, again.cost, \
        again.collectives
    plan.rows, plan.hardware = again.rows, again.hardware
    plan.notes = [*plan.notes, f"edited: the strategies of ops {shown} are not those the plan "
                               f"was saved with; they are priced again{kept}, and the cost, "
                               "collectives and rows are those of the strategies run"]


def _labels(graph, gp: GraphPlan, prefix: str = ""):
    """(row path, chosen strategy's label) of every op, loop bodies' too, as _rows gives them."""
    for op in graph.ops:
        choice = gp.choices[op.index]
        yield f"{prefix}{op.index}", choice.strategy.label()
        for r, body in enumerate(op.regions):
            yield from _labels(body, choice.regions[r], f"{prefix}{op.index}.{r}.")


def _check_path(path, where: str) -> None:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{where}: path={path!r} must be a file path (str or pathlib.Path).")


def check_writable(path, where: str) -> None:
    """Raise a ValueError naming `where` unless a file can be written at `path`: its directory
    exists and is writable, and `path` is no directory. Commands that save their result check
    this first, so that bad output paths fail before the work, not after it.

    Example:
      >>> check_writable("out/plan.json", "--out")  # out/ missing: ValueError
    """
    _check_path(path, where)
    target = Path(path)
    folder = target.parent
    if not str(path):
        problem = "the path is empty"
    elif target.is_dir():
        problem = "is a directory"
    elif not folder.is_dir():
        problem = f"its directory {str(folder)!r} does not exist"
    elif not os.access(folder, os.W_OK):
        problem = f"its directory {str(folder)!r} is not writable"
    else:
        return
    raise ValueError(f"{where} {str(path)!r}: cannot write a file there ({problem}); pass a "
                     "file path in a directory that exists and is writable.")


_PASS_THROUGH = frozenset({"convert_element_type", "transpose", "reshape", "broadcast_in_dim",
                           "copy", "copy_p"})
_ROLE_ORDER = ("dp", "fsdp", "tp", "rep")


def describe_layout(graph, gp: GraphPlan, mesh: MeshInfo, weights: set[int] | None = None) -> str:
    """The logical mesh a plan uses, e.g. "dp4 x tp2", from what each mesh axis cuts.

    At every matmul/conv that reads a weight (an input value in `weights`, default every input,
    possibly through a convert, transpose or reshape) and one other operand, an axis that
    cuts the weight operand works as tensor parallelism (tp) there, one that cuts only the other
    operand as data parallelism (dp). Each axis takes its role by flops, a loop's body's
    matmuls counted once per trip (a weight there: the body's input that its loop's operand is,
    a model's layers stacked and scanned). A dp axis that also cuts the weights as they are
    stored is fsdp (weights gathered before use); an axis that cuts no matmul is rep
    (replicated work). Axes with one role are multiplied together; an axis of size 1 has
    none ("rep1" on one device).
    """
    work = {a: {"dp": 0.0, "tp": 0.0} for a in mesh.names}
    stored: set[str] = set()
    _tally_roles(graph, gp, set(graph.inputs) if weights is None else set(weights), 1.0,
                 work, stored)
    sizes: dict[str, int] = {}
    for a, n in zip(mesh.names, mesh.sizes, strict=True):
        if n == 1:  # cuts nothing, whatever its role
            continue
        w = work[a]
        role = "rep" if not (w["dp"] or w["tp"]) else ("tp" if w["tp"] > w["dp"] else "dp")
        if role == "dp" and a in stored:
            role = "fsdp"
        sizes[role] = sizes.get(role, 1) * n
    return " x ".join(f"{r}{sizes[r]}" for r in _ROLE_ORDER if r in sizes) or "rep1"


def _tally_roles(graph, gp: GraphPlan, weights: set[int], times: float,
                 work: dict[str, dict[str, float]], stored: set[str]) -> None:
    """describe_layout's flops per axis and role (`work`) and the axes cutting a stored weight
    (`stored`), over `graph`'s ops and its loops' and conds' bodies, each op's flops `times`
    over."""
    from jaxpar.cost.model import HEAVY_OPS, flops
    from jaxpar.rules.registry import OpInfo

    producer = graph.producers()

    def root(v):
        while isinstance(v, int) and v in producer and producer[v].name in _PASS_THROUGH:
            v = producer[v].inputs[0]
        return v if isinstance(v, int) and v in weights else None

    for op in graph.ops:
        choice = gp.choices.get(op.index)
        if choice is None:
            continue
        for r, body in enumerate(op.regions):
            outer = body_operands(op, r)
            if outer is not None and r < len(choice.regions):
                inner = {b for b, o in zip(body.inputs, outer, strict=True)
                         if root(o) is not None}
                _tally_roles(body, choice.regions[r], inner, times * choice.trips, work,
                             stored)
        if op.name not in HEAVY_OPS:
            continue
        roots = [root(v) for v in op.inputs[:2]]
        if (roots[0] is None) == (roots[1] is None):
            continue
        k = 0 if roots[0] is not None else 1
        s, done = choice.strategy, times * flops(OpInfo.of(op, graph))
        stored.update(gp.specs[roots[k]].axes() if roots[k] in gp.specs else ())
        for a in work:
            if a in s.ins[k].axes():
                work[a]["tp"] += done
            elif a in s.ins[1 - k].axes():
                work[a]["dp"] += done


def _same_collectives(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> bool:
    """Whether two predictions by kind name the same collectives, counts and bytes (up to
    the rounding of a sum)."""
    return a.keys() == b.keys() and all(
        a[k]["count"] == b[k]["count"] and math.isclose(a[k]["bytes"], b[k]["bytes"],
                                                       rel_tol=1e-9, abs_tol=1e-6)
        for k in a)


def _by_kind(cols) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for c in cols:
        entry = out.setdefault(c.kind, {"count": 0, "bytes": 0})
        entry["count"] += c.count
        entry["bytes"] += c.bytes
    return out


def _rows(graph, gp: GraphPlan, model, prefix: str = ""):
    for op in graph.ops:
        choice = gp.choices[op.index]
        path = f"{prefix}{op.index}"
        shapes = ",".join("x".join(map(str, graph.shape(v))) or "()" for v in op.inputs[:3])
        shapes += " -> " + ",".join("x".join(map(str, graph.shape(v))) or "()" for v in op.outputs)
        note = "" if choice.has_rule else "no rule: replicated"
        if choice.regions:
            note = f"region x{choice.trips}"
        runner = choice.runner_up.label() if choice.runner_up else ""
        yield Row(path, op.name, shapes, choice.strategy.label(), runner, choice.score,
                  choice.runner_score, note)
        for r, body in enumerate(op.regions):
            yield from _rows(body, choice.regions[r], model, f"{path}.{r}.")


def peak_memory(graph, gp: GraphPlan, mesh: MeshInfo,
                returned: dict[int, Spec] | None = None) -> float:
    """Peak per-device bytes of live values in program order (inputs live throughout).

    Args:
      graph, gp, mesh: the program, its plan and the mesh.
      returned: {output position: the spec the program returns it in} (an output not in it:
        its planned spec), for a whole program (returned_specs; a Plan's out_specs); None for
        a loop's or cond's body, whose results are no program outputs. At the program's end
        every output then held twice counts twice (returned_copies): one returned in another
        spec than it is made in (both live while it is resharded), and an argument returned
        unchanged (XLA copies it into an output buffer of its own).

    Returns:
      Bytes per device. A donated argument (graph.donated) is held throughout, as its buffer
      is; an output JAX aliases to it (graph.aliases) and returns in its spec goes back in
      that buffer, with no end copy, and where an op makes it there too, after the
      argument's last read (graph.in_place), it holds no bytes of its own (in_place). Nor does
      a broadcast XLA sinks into the loops reading it (graph.sunk). While an op runs it
      also holds what its bodies add (body_memory) or the partial sums it reduce-scatters,
      whole over the reduction's axes (OpStrategy.scatter_bytes).

    Example:
      >>> peak_memory(graph, gp, mesh, dict(enumerate(out_specs)))
    """
    values, specs = graph.values, gp.specs

    def size(v) -> float:
        spec = specs.get(v)
        return values[v].nbytes / spec.shards(mesh) if spec is not None else values[v].nbytes

    inputs, end = set(graph.inputs), len(graph.ops)
    mine, back = in_place(graph, gp, returned) if returned is not None else (set(), set())
    mine = graph.sunk().union(mine)  # values holding no bytes of their own
    freed: dict[int, list[int]] = {}  # op index -> the values dead after it
    for v, point in graph.last_points().items():  # (outputs, and results nothing reads: end)
        if point < end and v not in inputs and v not in mine:
            freed.setdefault(point, []).append(v)
    live = sum(size(v) for v in graph.inputs) + sum(size(v) for v in graph.consts)
    peak = live
    for op in graph.ops:
        choice = gp.choices[op.index]
        if op.regions:
            inner = body_memory(op, choice.regions, mesh)
        else:  # a partial sum made whole before its reduce-scatter
            inner = choice.strategy.scatter_bytes([values[v].nbytes for v in op.outputs], mesh)
        for v in op.outputs:
            if v not in mine:
                live += size(v)
        peak = max(peak, live + inner)
        for v in freed.get(op.index, ()):
            live -= size(v)
    if returned is None:
        return peak
    return max(peak, live + returned_copies(graph, gp, mesh, returned, back))


def in_place(graph, gp: GraphPlan, returned: dict[int, Spec]) -> tuple[set[int], set[int]]:
    """(values made in a donated argument's buffer, output positions returned in one) under
    this plan: the outputs JAX aliases to a donated argument (graph.aliases) that are returned
    in its spec (one layout: one buffer per device), and of those the values an op makes in
    that spec after the argument's last read (graph.in_place). peak_memory's."""
    aliases = graph.aliases()
    if not aliases:
        return set(), set()
    made_in, values, positions = graph.in_place(), set(), set()

    def layout(v, spec=None):
        spec = spec or gp.specs.get(v) or Spec.replicated(len(graph.values[v].shape))
        return spec.resolved()

    for pos, v_in in aliases.items():
        v = graph.outputs[pos]
        if not isinstance(v, int) or layout(v, returned.get(pos)) is not layout(v_in):
            continue
        positions.add(pos)
        if made_in.get(v) == v_in and layout(v) is layout(v_in):
            values.add(v)
    return values, positions


def returned_copies(graph, gp: GraphPlan, mesh: MeshInfo, returned: dict[int, Spec],
                    donated: set[int] = frozenset()) -> float:
    """Per-device bytes of the second copies a program holds of its outputs at its end: each
    output returned in another spec than its planned one, at the returned spec (the reshard's
    result, made while the planned copy is still held: all of them counted held at once, as
    XLA's output buffers are), and each argument or constant returned unchanged (XLA returns
    a copy). Not the outputs at `donated`, returned in a donated argument's buffer
    (in_place). peak_memory's `returned`."""
    held, total = set(graph.inputs) | set(graph.consts), 0.0
    for pos, v in enumerate(graph.outputs):
        if not isinstance(v, int) or pos in donated:
            continue  # a literal: made in its output buffer; a donated argument's: in its
        made = gp.specs.get(v)
        spec = returned.get(pos) or made
        if spec is not made or v in held:
            total += graph.values[v].nbytes / (spec.shards(mesh) if spec is not None else 1)
    return total


def search_peak(graph, gp: GraphPlan, mesh: MeshInfo, fixed_out: dict[int, Spec],
                ties: Sequence[tuple[int, int]] = ()) -> float:
    """peak_memory of a search's plan as the program hands its outputs back (returned_specs):
    what the searches hold a memory budget to."""
    return peak_memory(graph, gp, mesh, returned_specs(gp, fixed_out, ties))


def returned_specs(gp: GraphPlan, fixed_out: dict[int, Spec],
                   ties: Sequence[tuple[int, int]] = ()) -> dict[int, Spec]:
    """{output position: the spec the program returns it in} for a search's plan: fixed_out's,
    and each carried output (tie: input value, output position) its input's planned spec, as
    api.py hands them back. peak_memory's `returned`."""
    back = {pos: gp.specs[v] for v, pos in ties if v in gp.specs}
    return back | dict(fixed_out)


def body_memory(op, plans, mesh: MeshInfo) -> float:
    """Per-device bytes a region op's bodies add while it runs: the largest body peak less
    that body's arguments, which the enclosing graph holds as the op's operands already."""
    def held(graph, gp) -> float:
        return sum(graph.values[v].nbytes / gp.specs[v].shards(mesh) if v in gp.specs else
                   graph.values[v].nbytes for v in graph.inputs)
    return max([0.0, *(peak_memory(b, p, mesh) - held(b, p) for b, p in
                       zip(op.regions, plans, strict=True))])
