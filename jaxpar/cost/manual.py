"""The work of a `jax.shard_map` in the user's function: its body's flops and collectives.

A shard_map's body runs on each device's shard (its avals are local) and moves data only where
the user wrote a collective (psum, all_gather, psum_scatter, ppermute, all_to_all, pmax, pmin).
However jaxpar lays out its operands, the body does that same work: its operands are first
resharded into the shard_map's in_specs (the rule in rules/manual.py asks for those), then the
body runs. So the op's cost is not its strategy's but its body's: the flops and bytes of every
op in it (nested calls and loops included: a scan's body times its length, a while loop's
body times its trip count where XLA knows it, else once, a cond's branch that communicates
most) and the collectives, priced as `analysis.collective_stats` counts them in the compiled
program (per device, the larger of operand and result; a tuple collective is one, its
elements' bytes summed).

Example (a shard_map on make_mesh(8) of `lambda xb, w: jax.lax.psum(xb @ w, "d0")`, x of
(16, 32) cut on d0 and w of (32, 8) whole, its eqn in the traced jaxpr):
    >>> work = body_work(eqn.params["jaxpr"])
    >>> work.flops, [(c.kind, c.axes, c.bytes) for c in work.collectives]
    (4096.0, [('all-reduce', ('d0',), 256.0)])
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxpar.cost.comm import Collective
from jaxpar.ir.graph import literal, while_trips
from jaxpar.rules.registry import OpInfo
from jaxpar.spec import MeshInfo, Spec

# Body primitive -> the collective XLA runs for it (jax 0.10 names; psum is psum_invariant
# where shard_map checks varying axes, its default).
_KINDS = {"psum": "all-reduce", "psum_invariant": "all-reduce", "psum2": "all-reduce",
          "pmax": "all-reduce", "pmin": "all-reduce", "all_gather": "all-gather",
          "all_gather_invariant": "all-gather", "reduce_scatter": "reduce-scatter",
          "ppermute": "collective-permute", "all_to_all": "all-to-all"}
_MARKERS = frozenset({"pvary"})  # type-level only: no work, nothing moved


@dataclass
class BodyWork:
    """What one run of a body does per device: flops, bytes its ops read and write, and its
    collectives (each a Collective over the axes it names)."""

    flops: float = 0.0
    nbytes: float = 0.0
    collectives: list[Collective] = field(default_factory=list)


def on_mesh(params: dict, mesh: MeshInfo) -> bool:
    """Whether a shard_map's mesh is `mesh` as far as planning goes: each of its axes there
    by name, of the same size."""
    own = params["mesh"]
    return all(a in mesh.names and mesh.axis_size(a) == n
               for a, n in zip(own.axis_names, own.axis_sizes, strict=True))


def off_mesh(graph, mesh: MeshInfo) -> list[str]:
    """The meshes (described) of the graph's shard_maps, region bodies included, that are not
    `mesh` (on_mesh): those run replicated in the plan, and what they move is not priced."""
    found = []
    for _, op in graph.walk():
        if op.name == "shard_map" and not on_mesh(op.params, mesh):
            found.append(MeshInfo.of(op.params["mesh"]).describe())
    return found


def misordered(params: dict, shapes, dtypes, mesh: MeshInfo) -> list[Collective]:
    """The collective-permutes XLA adds around a shard_map whose in_specs or out_specs cut a
    dimension over several axes out of mesh order (P(("d2", "d0"))): a spec here holds its
    axes in mesh order, so each such operand is permuted into the shard_map's order on the
    way in and each such result back on the way out (its shard's bytes, once each)."""
    from jaxpar.cost.model import nbytes  # (cost.model reads this module)

    out = []
    for pspec, shape, dtype in zip(tuple(params["in_specs"]) + tuple(params["out_specs"]),
                                   shapes, dtypes, strict=True):
        entries = [tuple(e) for e in pspec if isinstance(e, tuple | list) and len(e) > 1]
        axes = [a for e in entries if e != mesh.order(e) for a in e]
        if axes:
            shard = nbytes(shape, dtype) / Spec.from_pspec(pspec, len(shape)).shards(mesh)
            out.append(Collective("collective-permute", mesh.order(axes), shard))
    return out


def body_work(jaxpr) -> BodyWork:
    """The work of one run of `jaxpr` (a Jaxpr or ClosedJaxpr with local avals)."""
    work = BodyWork()
    _add(getattr(jaxpr, "jaxpr", jaxpr), 1.0, work)
    return work


def _add(jaxpr, times: float, work: BodyWork) -> None:
    from jax.extend.core import jaxprs_in_params

    from jaxpar.cost.model import flops, nbytes  # (cost.model reads this module)

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _MARKERS:
            continue
        inner = list(jaxprs_in_params(eqn.params))
        if name == "cond":
            # One branch runs: priced as the one that communicates most (as
            # analysis.collective_stats counts the compiled program), flops at the dearest.
            works = [body_work(b) for b in inner]
            loud = max(works, key=lambda w: (sum(c.bytes for c in w.collectives),
                                             sum(c.count for c in w.collectives)))
            work.flops += max(w.flops for w in works) * times
            work.nbytes += max(w.nbytes for w in works) * times
            work.collectives += [Collective(c.kind, c.axes, c.bytes * times, c.count * times)
                                 for c in loud.collectives]
            continue
        if name == "while":  # as XLA runs it: its test once more than its body
            trips = while_trips(eqn.params, [literal(v) for v in eqn.invars]) or 1
            _add(eqn.params["cond_jaxpr"].jaxpr, times * (trips + 1), work)
            _add(eqn.params["body_jaxpr"].jaxpr, times * trips, work)
            continue
        if inner:
            trips = eqn.params.get("length", 1) if name == "scan" else 1
            for body in inner:
                _add(getattr(body, "jaxpr", body), times * trips, work)
            continue
        ins = [v.aval for v in eqn.invars if hasattr(v.aval, "shape")]
        outs = [v.aval for v in eqn.outvars if hasattr(v.aval, "shape")]
        sizes_in = [nbytes(a.shape, a.dtype) for a in ins]
        sizes_out = [nbytes(a.shape, a.dtype) for a in outs]
        kind = _KINDS.get(name)
        if kind is not None:
            axes = _axes(eqn.params)
            moved = max(sum(sizes_in), sum(sizes_out))
            if axes and moved:
                work.collectives.append(Collective(kind, axes, moved * times, times))
            continue
        info = OpInfo(eqn.primitive, eqn.params, tuple(tuple(a.shape) for a in ins),
                      tuple(tuple(a.shape) for a in outs),
                      tuple(a.dtype for a in ins), tuple(a.dtype for a in outs))
        work.flops += flops(info) * times
        work.nbytes += (sum(sizes_in) + sum(sizes_out)) * times


def _axes(params: dict) -> tuple[str, ...]:
    names = params.get("axes", params.get("axis_name", ()))
    names = names if isinstance(names, tuple | list) else (names,)
    return tuple(n for n in names if isinstance(n, str))
