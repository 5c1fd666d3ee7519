"""Alpha-beta collective costs and the cheapest resharding between two specs of one array.

Bytes follow `analysis.collective_stats`: per device, the larger of a collective's operand and
result (all-gather: the gathered result; reduce-scatter: the full input). Ring costs for a group
of n devices over a link of bandwidth bw and per-hop latency lat, with h hops (n-1 on a ring,
ceil(log2 n) on a switch, where NCCL-style trees and recursive doubling apply):
  all-gather, reduce-scatter: (n-1)/n * b / bw + h lat;  all-reduce: twice that;
  all-to-all: (n-1)/n * b / bw + h lat on a switch, n/4 * b / bw + h lat on a ring;
  permute: b / bw + lat.
A group spanning several axes runs at its slowest link.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

from jaxpar.cost.hardware import Link
from jaxpar.spec import Axes, MeshInfo, Spec


@dataclass(frozen=True)
class Collective:
    """`count` runs of one collective over the mesh `axes`, moving `bytes` in all (per device)."""

    kind: str
    axes: Axes
    bytes: float
    count: float = 1


def collective_time(c: Collective, mesh: MeshInfo, links: dict[str, Link],
                    latency: float = 1.0) -> float:
    """Seconds for `c`; `latency` scales its latency (below 1 for a collective XLA combines with
    others, which share one latency)."""
    return c.count * _once(c.kind, c.axes, c.bytes / c.count, mesh, links, latency)


def collective_line(kind: str, axes: Axes, mesh: MeshInfo, links: dict[str, Link],
                    latency: float = 1.0, span: float = 2.0 ** 30) -> tuple[float, float]:
    """(per_byte, per_call): collective_time of a collective of this kind over `axes` moving
    B bytes in k calls is per_byte * B + per_call * k (its time is affine in the bytes; the
    slope is measured over `span` bytes, so that the latency does not swamp it)."""
    per_call = _once(kind, axes, 0.0, mesh, links, latency)
    return (_once(kind, axes, span, mesh, links, latency) - per_call) / span, per_call


def _once(kind: str, axes: Axes, nbytes: float, mesh: MeshInfo, links: dict[str, Link],
          latency: float = 1.0) -> float:
    n = mesh.group_size(axes)
    if n <= 1:
        return 0.0
    bw = min(links[a].bandwidth for a in axes)
    on_ring = any(links[a].topology == "ring" for a in axes)
    # Latency: a ring pays one hop per peer; a switch runs trees/recursive doubling, log2(n).
    hops = (n - 1) if on_ring else math.ceil(math.log2(n))
    lat = max(links[a].latency for a in axes) * hops * latency
    ring = (n - 1) / n * nbytes / bw + lat
    if kind == "all-reduce":  # twice a ring's bytes; one latency (tree / recursive doubling on
        return 2 * (ring - lat) + lat  # small messages), so it beats reduce-scatter+all-gather

    if kind == "all-to-all":
        return max((n - 1) / n, n / 4 if on_ring else 0.0) * nbytes / bw + lat
    if kind == "collective-permute":
        return nbytes / bw + max(links[a].latency for a in axes)
    return ring


def reshard(src: Spec, dst: Spec, nbytes: float, mesh: MeshInfo,
            matmul: bool = True) -> list[Collective]:
    """Collectives that turn an array of `nbytes` laid out as `src` into `dst`, as XLA's SPMD
    partitioner emits them (checked against compiled HLO in tests/test_cost.py and, over every
    pair of specs of an array on a mesh, by benchmarks/reshard_accuracy.py). matmul: a partial
    `src` is a matmul's or conv's product (True) or another reduction's (a sum, a max: they
    reduce a partial sum over several axes otherwise, see _summed).

    When every piece of dst lies within one piece of src (src cuts each dimension into pieces
    dst cuts further) but not where the device holding it needs it, one collective-permute moves
    the pieces; when dst is src with some axes renamed to others of their size and then gathers
    alone, one permute renumbers the pieces and the gathers follow (_relabelled). Where XLA
    finds no direct path it falls back, and so does the model: the whole array gathered at once
    (_rematerialized) or a dimension at a time (_merged), or the pieces renumbered and gathered
    in groups (_swapped, _dropped_for), or the whole local piece moved before it is sliced
    (_moved_down_whole, _moved_then_sliced), a dimension's axes spread with new ones moved
    after the new ones slice it (_sliced_then_spread), or a dimension's axes gathered at once
    first (_gathered_whole_first, _gathered_minor_first). A matmul's product beside idle axes
    is split over them (_split_on_idle), and one whose partial axes land on a dimension it
    leaves whole beside new axes is reduced whole (_whole_then_sliced). Otherwise, in order:
    slices first (free, they shrink the pieces); partial sums reduced (a reduce-scatter onto
    the first dimension `dst` cuts with partial axes, an all-reduce before it, at full size,
    of those `dst` cuts on each later dimension, or one reduce-scatter onto them all and a
    permute where `dst` also slices axes `src` does not use; and an all-reduce of those `dst`
    does not cut); axes moving between dimensions (an all-to-all per pair of dimensions,
    _all_to_alls, which XLA chooses by the pieces each dimension has, _by_counts); one
    collective-permute when a dimension keeps an axis but the axes outside it change, or when
    the moved axes land out of dst's order (the pieces are renumbered); then one all-gather per
    dimension that loses axes, last dimension first.
    Axes of size 1 cut nothing and are left out first (specs that differ only in them move
    nothing). Some shapes of path run on the axes XLA takes for them (_on_source_axes,
    _on_xla_axes).
    """
    src, dst = _cutting(src, mesh), _cutting(dst.resolved(), mesh)
    if src.placed_as(dst):
        return []
    return _on_xla_axes(src, dst, _path(src, dst, nbytes, mesh, matmul), nbytes, mesh)


def _on_xla_axes(src: Spec, dst: Spec, out: list[Collective], nbytes: float,
                 mesh: MeshInfo) -> list[Collective]:
    """`out` on the mesh axes XLA runs it over where it renumbers the pieces and then gathers
    (_regathered) or gathers, moves one dimension's pieces to another and renumbers them
    (_gathered_then_moved, _emptied_then_moved), and that path moves the same kinds and
    bytes; `out` otherwise. A gather and an all-to-all that XLA runs from the other
    dimension, as many bytes, take the permute renumbering the pieces after them too
    (_emptied_then_moved: [-, d0, d1] to [d0, -, -] on 2 x 2 x 2 gathers d0, moves d1 and
    renumbers, where gathering d1 and moving d0 into place had been predicted; of every pair
    of rank 3 on 2 x 2 x 2, 54 more priced as compiled, none fewer). An all-to-all then a
    gather is _emptied_then_moved's path wherever it has one: XLA gathers first and moves
    from the other dimension ([-, d0, d1+d2] to [d1, -, d0]: d0 gathered, an all-to-all
    over d2 and a permute, 0.75 of the array, where an all-to-all over d0 and d1 and d2
    gathered had been predicted, 0.375; 72 more pairs, none fewer); so are gathers alone
    where dst cuts only dimensions src leaves whole ([-, d0, d1] to [d2, -, -]: d0 gathered,
    an all-to-all over d1 and a permute, 1.5 of the array, where both gathered and d2 sliced
    had been predicted, 0.75; 18 more, none fewer)."""
    kinds = [c.kind for c in out]
    if len(kinds) > 1 and kinds[0] == "collective-permute" and set(kinds[1:]) == {"all-gather"}:
        found = _regathered(src, dst, nbytes, mesh)
    elif kinds[:2] == ["all-gather", "all-to-all"] and kinds[2:] in ([], ["collective-permute"]):
        found = _gathered_then_moved(src, dst, nbytes, mesh) or \
            _emptied_then_moved(src, dst, nbytes, mesh)
    elif kinds == ["all-to-all", "all-gather"] or (
            len(kinds) > 1 and set(kinds) == {"all-gather"} and
            all(not src.dims[d] for d, axes in enumerate(dst.dims) if axes)):
        return _emptied_then_moved(src, dst, nbytes, mesh) or out
    else:
        return out
    if found is None:
        return out
    if len(out) == 2 and [c.kind for c in found] == [*kinds, "collective-permute"]:
        return found if _alike(out, found[:2]) else out
    return found if len(found) == len(out) and _alike(out, found) else out


def _alike(a: list[Collective], b: list[Collective]) -> bool:
    """Whether two lists of collectives move the same kinds and bytes (in any order)."""
    return all(x[0] == y[0] and math.isclose(x[1], y[1], rel_tol=1e-9)
               for x, y in zip(sorted((c.kind, c.bytes) for c in a),
                               sorted((c.kind, c.bytes) for c in b), strict=True))


def _path(src: Spec, dst: Spec, nbytes: float, mesh: MeshInfo, matmul: bool
          ) -> list[Collective]:
    """reshard()'s collectives, src and dst without axes of size 1 and not placed alike."""
    local = nbytes / src.shards(mesh)
    if _within(src, dst, mesh):
        # Each device slices its piece of dst from what some device holds: one permute.
        return [Collective("collective-permute", permuted_axes(src, dst, mesh),
                           nbytes / dst.shards(mesh))]
    relabelled = _relabelled(src, dst, nbytes, mesh)
    if relabelled is not None:
        return relabelled
    whole = _moved_then_sliced(src, dst, local)
    if whole is not None:
        return whole
    renamed = _renamed(src, dst, nbytes, mesh)
    if renamed is not None:
        if [c.kind for c in renamed] == ["collective-permute", "all-to-all"]:
            renamed = renamed[::-1]  # XLA moves the pieces first, then renumbers them
        return _on_source_axes(src, dst, renamed, mesh)
    if _rematerialized(src, dst, mesh):
        # XLA finds no path ("involuntary full rematerialization"): the whole array is
        # gathered, then sliced to dst.
        return [Collective("all-gather", src.axes(), nbytes)]
    if _merged(src, dst):
        whole = _whole_moves(src, dst, local, mesh)
        if whole is not None:
            return whole
        # XLA gathers every cut dimension (the last first), then slices to dst.
        out = []
        for axes in reversed(src.dims):
            if axes:
                local *= mesh.group_size(axes)
                out.append(Collective("all-gather", axes, local))
        return out
    swapped = _swapped(src, dst, mesh)
    if swapped is not None:
        # One dimension's axes replaced by others that cut it fewer ways: the pieces are
        # renumbered, then gathered in groups of the ratio.
        cut, into = swapped
        return [Collective("collective-permute", cut + into, local),
                Collective("all-gather", cut,
                           local * mesh.group_size(cut) / mesh.group_size(into))]
    dropped = _dropped_for(src, dst, nbytes, mesh)
    if dropped is not None:
        return dropped
    three = _three_into_two(src, dst, local, mesh)
    if three is not None:
        return three
    down = _moved_down_whole(src, dst, nbytes, mesh)
    if down is not None:
        return down
    spread = _sliced_then_spread(src, dst, nbytes, mesh)
    if spread is not None:
        return spread
    gathered = _gathered_whole_first(src, dst, nbytes, mesh, matmul) or \
        _gathered_minor_first(src, dst, nbytes, mesh, matmul)
    if gathered is not None:
        return gathered
    new = [a for d, axes in enumerate(dst.dims) for a in axes
           if a not in src.axes() and a not in src.dims[d]]
    out: list[Collective] = []
    scatter = tuple(a for a in src.partial if dst.dim_of(a) is not None)
    reduce = tuple(a for a in src.partial if a not in scatter)
    if matmul:
        fixed = _split_on_idle(src, dst, scatter, local, mesh) or \
            _whole_then_sliced(src, dst, scatter, reduce, new, local, mesh) or \
            _two_partial(src, dst, scatter, reduce, new, local, mesh)
    else:
        fixed = _summed(src, dst, scatter, reduce, new, local, mesh)
    if fixed is not None:
        return fixed
    local /= mesh.group_size(tuple(new))
    # XLA reduce-scatters onto one dimension, the first that `dst` cuts with partial axes;
    # the partial axes `dst` puts on later dimensions are all-reduced first, at full size,
    # one all-reduce per dimension, the last first (a batched matmul's product partial over
    # d0+d1+d2 into [d0, d1, d2]: two all-reduces of the whole, one had been predicted),
    # and then sliced.
    # Where dst also slices axes src does not use, XLA reduce-scatters onto every dimension
    # at once and renumbers the pieces (a permute) instead: partial (y, z) -> [y, x+z] on
    # 2 x 2 x 2 devices.
    first = min((dst.dim_of(a) for a in scatter), default=None)
    early = tuple(a for a in scatter if dst.dim_of(a) != first)
    if early and new:
        out.append(Collective("reduce-scatter", scatter, local))
        local /= mesh.group_size(scatter)
        out.append(Collective("collective-permute", scatter, local))
        early = scatter = ()
    for d in sorted({dst.dim_of(a) for a in early}, reverse=True):
        out.append(Collective("all-reduce", tuple(a for a in early if dst.dim_of(a) == d),
                              local))
    scatter = tuple(a for a in scatter if a not in early)
    if scatter:
        out.append(Collective("reduce-scatter", scatter, local))
        local /= mesh.group_size(scatter)
    local /= mesh.group_size(early)
    if reduce:
        out.append(Collective("all-reduce", reduce, local))
    moved = tuple(a for d, axes in enumerate(src.dims) for a in axes
                  if dst.dim_of(a) is not None and dst.dim_of(a) != d)
    gathers = []  # one all-gather per dimension that loses axes, last dimension first
    for axes in reversed(src.dims):
        gone = tuple(a for a in axes if dst.dim_of(a) is None)
        if gone:
            gathers.append(gone)
    first = bool(moved and gathers and _gathers_first(src, dst, moved))
    if first:
        for gone in gathers:
            local *= mesh.group_size(gone)
            out.append(Collective("all-gather", gone, local))
        gathers = []
    pairs = _all_to_alls(src, dst, moved, mesh) if moved else []
    counted = _by_counts(src, dst, mesh) if len(pairs) > 1 and not (
        gathers or first or new or src.partial) else None
    if counted is not None:  # XLA's all-to-alls, by the pieces, and where they land
        pairs, landed = counted
    out += [Collective("all-to-all", axes, local) for axes in pairs]
    renumbered = _renumbered(src, dst)
    regrouped = _regrouped(src, dst, moved, len(pairs)) if moved else False
    if moved and not renumbered and (regrouped if regrouped is not None else (
            _misplaced(src, dst, mesh, ahead=not first) or
            _uneven_swap(src, dst, moved, mesh) or (first and _split(src, dst)) or
            _sliced_around(src, dst, moved))):
        renumbered = moved
    if counted is not None and landed.placed_as(dst):
        renumbered = ()
    elif counted is not None and _within(landed, dst, mesh):
        renumbered = permuted_axes(landed, dst, mesh)
    if renumbered:
        out.append(Collective("collective-permute", renumbered, local))
    for gone in gathers:
        local *= mesh.group_size(gone)
        out.append(Collective("all-gather", gone, local))
    return _on_source_axes(src, dst, out, mesh)


def _on_source_axes(src: Spec, dst: Spec, out: list[Collective], mesh: MeshInfo
                    ) -> list[Collective]:
    """An all-to-all and a permute (one dimension's pieces moved to another, then
    renumbered) on the mesh axes XLA runs them over, their bytes as given: the all-to-all
    groups the devices by the axes that cut src's dimension last (its minor pieces, as many
    as the dimension loses: the permute does the rest where axes also move the other way),
    and lands them last in dst's dimension, after the axes src leaves free that slice it
    further first (mesh order) and those src already cut it with; the permute then crosses
    the axes permuted_axes finds from that layout to dst's. From [-, d0] to [d1, -] on
    2 x 2 x 2: an all-to-all over d0 and a permute across d0 and d1, where one over d1 and
    one within d1 had been assumed; from [d0+d1, d2] to [d2, d0+d1], one over d1 and a
    permute across d0 and d2, where one over all three had been. All 696 such pairs of
    rank 2 on 2 x 2 x 2 compiled so (96, then 654 of 702 before); so do those _renamed gives as
    a permute then an all-to-all (XLA moves first: `out` in that order). Where whole minor
    axes cannot make the pieces lost, the all-to-all's own group (4 x 2: [d0, -] to
    [d1, d0]), else the fewest minor axes that cut more (_moved_minor's cover: 6 of the 7
    pairs of rank 2 on 4 x 2 that were named wrongly). Where several dimensions gain
    pieces, the all-to-all lands in one that gains as many as the dimension loses, among
    those in one src cuts already, else in the last, and src's free axes slice the others
    (dimension order; [-, -, d0] to [d0, d2+d1, -] lands [d0, d1+d2, -], its permute across
    d1 and d2, where [d1, d2+d0, -] had been assumed): from [d0, d2, -] to [d2+d0, -, d1], an
    all-to-all over d2 into [d0+d2, -, d1] and a permute across d0 and d2. Of a sample of
    600 pairs of rank 3 on 2 x 2 x 2, 195 of 198 such paths compiled so (118 before).
    An all-to-all priced alone lands so too, and where that is not dst XLA renumbers the
    pieces after it ([d0, -, d1] -> [d1, d2+d0, -]: d2 sliced into dimension 1, an
    all-to-all over d1 into [d0, d2+d1, -], then a permute across d0 and d1, which had been
    left out; [-, -, d0+d1] -> [d1, d2, d0]: d2 sliced into dimension 0, d1 moved into
    dimension 1, then the permute). Of every pair of rank 3 on 2 x 2 x 2 (11,130, all
    compiled), 126 more are priced as compiled, and 27 more on XLA's axes where it lands
    first as many pieces as it loses, none fewer. `out` as it is for other shapes, or where
    several dimensions lose pieces."""
    kinds = [c.kind for c in out]
    if kinds not in (["all-to-all", "collective-permute"], ["all-to-all"]):
        return out
    pieces = _pieces(src, dst, mesh)
    losing = [d for d, (a, b) in enumerate(pieces) if a > b]
    gaining = [d for d, (a, b) in enumerate(pieces) if b > a]
    if len(losing) != 1 or not gaining:
        return out
    i = losing[0]
    lost = pieces[i][0] // pieces[i][1]
    groups = dict.fromkeys((lost, mesh.group_size(out[0].axes)))
    # into one gaining as many pieces as i loses; among those, one src cuts already, else
    # the last
    into = sorted(gaining, key=lambda d: (pieces[d][1] // pieces[d][0] != lost,
                                          pieces[d][0] == 1, -d))
    tries = (_moved_minor(src, i, j, g, pieces, gaining, mesh) for j in into for g in groups)
    between = next((b for b in tries if b is not None), None)
    if between is None:  # no whole minor axes cut as many ways as it loses: those cutting more
        between = _moved_minor(src, i, into[0], lost, pieces, gaining, mesh, cover=True)
        if between is None:
            return out
    if len(out) == 1 and between.placed_as(dst):
        return out
    moved = tuple(a for a in src.dims[i] if a not in between.dims[i])
    last = out[-1]  # the permute moves the all-to-all's bytes where XLA adds one
    return [Collective("all-to-all", moved, out[0].bytes, out[0].count),
            Collective("collective-permute", permuted_axes(between, dst, mesh), last.bytes,
                       last.count)]


def _pieces(src: Spec, dst: Spec, mesh: MeshInfo) -> list[tuple[int, int]]:
    """Per dimension, how many pieces src and dst cut it into."""
    return [(mesh.group_size(a), mesh.group_size(b)) for a, b in zip(src.dims, dst.dims,
                                                                      strict=True)]


def _minor(axes: tuple[str, ...], group: int, mesh: MeshInfo) -> list[str]:
    """The fewest of a dimension's last (minor) axes that cut it at least `group` ways (all of
    them where they cut fewer)."""
    moved: list[str] = []
    for a in reversed(axes):
        if mesh.group_size(tuple(moved)) >= group:
            break
        moved.insert(0, a)
    return moved


def _moved_minor(src: Spec, i: int, j: int, group: int, pieces: list[tuple[int, int]],
                 gaining: list[int], mesh: MeshInfo, cover: bool = False) -> Spec | None:
    """src with the minor axes of its dimension i that cut `group` ways moved last into
    dimension j, and the axes src leaves free (mesh order) slicing each dimension of
    `gaining` further first (dimension order), as many ways as its `pieces` (src's, dst's)
    ask; None where whole axes cannot do that. cover: the fewest minor axes that cut at
    least `group` ways moved, nothing sliced (on 4 x 2, [d0, d1] -> [d1, d0] moves d0: XLA's
    all-to-all is over d0, and its permute, the pieces no longer one to one, crosses both)."""
    moved = _minor(src.dims[i], group, mesh)
    size = mesh.group_size(tuple(moved))
    if size < group or (size > group and not cover):
        return None
    dims = list(src.dims)
    dims[i] = tuple(a for a in src.dims[i] if a not in moved)
    if cover:
        dims[j] = (*src.dims[j], *moved)
        return Spec(tuple(dims))
    free = [a for a in mesh.names if src.dim_of(a) is None]
    for d in gaining:
        have = pieces[d][0] * (group if d == j else 1)
        if pieces[d][1] % have:
            return None
        pre: list[str] = []
        while free and mesh.group_size(tuple(pre)) < pieces[d][1] // have:
            pre.append(free.pop(0))
        if mesh.group_size(tuple(pre)) != pieces[d][1] // have:
            return None
        dims[d] = (*pre, *src.dims[d], *(moved if d == j else ()))
    return Spec(tuple(dims))


def _summed(src: Spec, dst: Spec, scatter: Axes, reduce: Axes, new: list, local: float,
            mesh: MeshInfo) -> list[Collective] | None:
    """A reduction other than a matmul (reduce_sum, ...) whose result is partial over two axes
    or more, some of them scattered and some not, dst keeping src's cuts and adding only
    partial axes: XLA all-reduces it over every partial axis at src's size and slices it (a
    reduce-scatter where the backend has one), and renumbers the pieces where a scattered axis
    comes before an axis src already cuts that dimension with (every such sum over one dim of
    a matrix on 2 x 2 x 2 and 4 x 2 compiled: tests/test_cost.py; a GRU's bias gradient in its
    backward scan, on 4 x 2 and 2 x 4, was priced 0.55-0.7x the compiled program's time).
    None elsewhere."""
    if len(src.partial) < 2 or not scatter or not reduce or new or any(
            not set(axes) <= set(dst.dims[d]) for d, axes in enumerate(src.dims)):
        return None
    out = [Collective("reduce-scatter", src.partial, local)]
    if any(dst.dims[d].index(a) < dst.dims[d].index(b)
           for a in scatter for d in [dst.dim_of(a)] for b in src.dims[d]):
        out.append(Collective("collective-permute", scatter, local / mesh.group_size(scatter)))
    return out


def of_splat(moves: list[Collective]) -> list[Collective]:
    """What XLA moves of reshard()'s `moves` when the array is a splat (a literal scalar
    broadcast: jnp.zeros, jnp.full; OpGraph.splats). The SPMD partitioner makes a constant's
    pieces wherever they are needed, so its gathers and permutes move nothing; once an
    all-to-all has moved them the pieces are data, and that all-to-all and what follows it
    move as any array's do; so does a permute after a gather (the gathered pieces are data:
    [d2, d0+d1, -] -> [d0, -, d1] on 2 x 2 x 2 gathers d0 and d1 for nothing, then permutes a
    quarter of the array). Compiled (jax 0.10.2, XLA:CPU), a zeros array resharded moves this
    in all of 510 sampled spec pairs (200 rank-2 and 200 rank-3 on 2 x 2 x 2, 110 rank-2 on
    4 x 2; 491 before the rank-3 rules of _by_counts and _gathered_then)."""
    for i, c in enumerate(moves):
        if c.kind == "all-to-all":
            return moves[i:]
        if c.kind == "collective-permute" and i and moves[i - 1].kind == "all-gather":
            return moves[i:]
    return []


def splits_on_idle(src: Spec, dst: Spec, mesh: MeshInfo) -> bool:
    """Whether XLA reduces a matmul's product, partial over src.partial, into dst by cutting
    it further over idle axes (_split_on_idle): dst scatters one partial axis, adds no axis
    src does not use and keeps src's cuts, and the mesh axes neither spec uses cut the
    array a multiple of the scattered axis's ways. Axes of size 1 count for nothing."""
    src, dst = _cutting(src, mesh), _cutting(dst.resolved(), mesh)
    scatter = tuple(a for a in src.partial if dst.dim_of(a) is not None)
    if len(scatter) != 1 or any(src.dim_of(a) is None and a not in src.partial
                                for a in dst.axes()) or \
            any(not set(axes) <= set(dst.dims[d]) for d, axes in enumerate(src.dims)):
        return False
    idle = tuple(a for a in mesh.names if mesh.axis_size(a) > 1 and a not in src.axes() and
                 dst.dim_of(a) is None)
    return bool(idle) and mesh.group_size(idle) % mesh.group_size(scatter) == 0


def _split_on_idle(src: Spec, dst: Spec, scatter: Axes, local: float, mesh: MeshInfo
                   ) -> list[Collective] | None:
    """XLA's path where splits_on_idle holds (a matmul's product, one partial axis scattered
    and idle axes cutting as many ways or a multiple): rather than reduce-scatter it, XLA
    cuts the operands over the idle axes into as many pieces as the scattered axis makes,
    all-reduces the smaller product over every partial axis and renumbers its pieces onto
    the scattered axis (a collective-permute). Every such candidate of a matmul and a
    batched matmul on 2 x 2 x 2, 4 x 2 and 2 x 4 devices compiles so, whatever dst's order
    (tests/test_cost.py): the reduce-scatter predicted moved as many bytes in half the time.
    None elsewhere."""
    if not splits_on_idle(src, dst, mesh):
        return None
    piece = local / mesh.group_size(scatter)
    return [Collective("all-reduce", src.partial, piece),
            Collective("collective-permute", src.partial, piece)]


def _whole_then_sliced(src: Spec, dst: Spec, scatter: Axes, reduce: Axes, new: list,
                       local: float, mesh: MeshInfo) -> list[Collective] | None:
    """A matmul's product partial over src.partial, its partial axes scattered onto one
    dimension src leaves whole, which dst also cuts with axes src does not use (`new`),
    every other dimension alike: XLA all-reduces the product at src's size over every
    partial axis and slices it (a reduce-scatter of the whole, not of a piece sliced by the
    new axes first), then renumbers the pieces (a collective-permute) when a partial axis is
    reduced but not scattered. A product is so where XLA gathered an operand first
    (cost.model.operand_gathers); every such pair of rank 2 on 2 x 2 x 2 devices compiles so
    (tests/test_cost.py: a slice first had been predicted, a quarter of the bytes).
    None elsewhere."""
    if not scatter or not new:
        return None
    into = {dst.dim_of(a) for a in scatter + tuple(new)}
    if len(into) != 1:
        return None
    d = into.pop()
    if src.dims[d] or any(a != b for i, (a, b) in enumerate(zip(src.dims, dst.dims,
                                                                 strict=True)) if i != d):
        return None
    out = [Collective("reduce-scatter", src.partial, local)]
    if reduce:
        out.append(Collective("collective-permute", dst.axes(),
                              local * src.shards(mesh) / dst.shards(mesh)))
    return out


def _two_partial(src: Spec, dst: Spec, scatter: Axes, reduce: Axes, new: list, local: float,
                 mesh: MeshInfo) -> list[Collective] | None:
    """A matmul's product partial over two axes resolved as XLA compiles it where reshard's
    general rule does not (every such pair of rank 2 on 2 x 2 x 2 compiled: tests/test_cost.py),
    dst keeping src's cuts and adding only partial axes: src cuts a dimension that dst
    scatters a partial axis onto: one all-reduce over both at src's size, sliced after (a
    reduce-scatter where the backend has one). (One axis scattered and the other reduced
    beside an idle axis: _split_on_idle.) None elsewhere."""
    if len(src.partial) != 2 or new or any(
            dst.dims[d][:len(axes)] != axes for d, axes in enumerate(src.dims)):
        return None
    if any(src.dims[dst.dim_of(a)] for a in scatter):
        return [Collective("reduce-scatter", src.partial, local)]
    return None


def _three_into_two(src: Spec, dst: Spec, local: float, mesh: MeshInfo
                    ) -> list[Collective] | None:
    """src cuts three dimensions, one axis each; dst cuts one of them but the first, with two
    of those axes, and drops the third (`[d0, d1, d2] -> [-, d0+d2, -]`). XLA gathers the
    dropped axis first, then moves the other into place, and renumbers the pieces unless the
    axis dst keeps in place comes first in it, the moved one second and the dropped one came
    from dimension 0 (every such pair of rank 3 on 2 x 2 x 2 compiled: tests/test_cost.py).
    None for other pairs."""
    if src.partial or len(src.dims) < 3:
        return None
    cut = [d for d, axes in enumerate(src.dims) if axes]
    into = [d for d, axes in enumerate(dst.dims) if axes]
    if len(cut) != 3 or any(len(src.dims[d]) != 1 for d in cut) or len(into) != 1 or \
            into[0] == 0 or len(dst.dims[into[0]]) != 2:
        return None
    j = into[0]
    origin = [src.dim_of(a) for a in dst.dims[j]]
    gone = [a for a in src.axes() if dst.dim_of(a) is None]
    if None in origin or len(gone) != 1:
        return None
    moved = tuple(a for a, d in zip(dst.dims[j], origin, strict=True) if d != j)
    local *= mesh.group_size(tuple(gone))
    out = [Collective("all-gather", tuple(gone), local),
           Collective("all-to-all", moved, local)]
    in_order = origin[0] == j and origin[1] != j and src.dim_of(gone[0]) == 0
    if not in_order:
        out.append(Collective("collective-permute", moved, local))
    return out


def _moved_down_whole(src: Spec, dst: Spec, nbytes: float, mesh: MeshInfo
                      ) -> list[Collective] | None:
    """src cuts one dimension, a (not the first), and dst moves all its axes into dimension
    a - 1 and cuts the last dimension with axes src does not use, in mesh order, and nothing
    else ([-, d0, -] -> [d0, -, d1+d2]). XLA then runs the all-to-all on the whole local
    piece and slices it after (not the piece sliced first: 4x the bytes on 2 x 2 x 2
    devices). Every such pair of rank 3 and 4 on 2 x 2 x 2 compiles so, whatever the sizes
    (tests/test_cost.py); with the axes out of mesh order, into another dimension, or the
    new ones elsewhere, XLA slices first (reshard's general rule), and where the moved axes
    land in another order it slices first too (_sliced_then_spread: [-, d0+d1, -] ->
    [d1+d0, -, d2] is an all-to-all over d2 and one over d0 and d1 of the sliced piece, and a
    permute; the whole piece moved and a permute had been assumed, the last 6 of the 11,130
    pairs of rank 3 on 2 x 2 x 2 the model named wrongly). None for other pairs."""
    cut = [d for d, axes in enumerate(src.dims) if axes]
    into = [d for d, axes in enumerate(dst.dims) if axes]
    last = len(dst.dims) - 1
    if src.partial or len(cut) != 1 or cut[0] in (0, last) or into != [cut[0] - 1, last]:
        return None
    moved, new = src.dims[cut[0]], dst.dims[last]
    if dst.dims[cut[0] - 1] != moved or any(src.dim_of(a) is not None for a in new) or \
            mesh.order(new) != new:
        return None
    return [Collective("all-to-all", moved, nbytes / src.shards(mesh))]


def _all_to_alls(src: Spec, dst: Spec, moved: Axes, mesh: MeshInfo) -> list[Axes]:
    """The mesh axes of each all-to-all XLA runs to move `moved` between dimensions. Where
    dst adds no axis src does not use, XLA pairs the dimensions by how many pieces the
    moved axes cut each into: each dimension they leave (cut fewer ways after) with one
    they enter (cut more ways), equal ratios first, then the largest split; one all-to-all
    per pair ([d1+d0, d2, -] -> [-, d2+d0, d1]: dimension 0 to 1 and 0 to 2, two), none
    for a dimension cut as many ways before and after ([d1, -, d2] -> [-, d2, d1]: one,
    from 0 to 1). Every such pair of rank 3 in a sample of 500 on 2 x 2 x 2 devices
    compiles so (tests/test_cost.py; one all-to-all had been predicted for all); which axes
    each runs over, and where they land, _by_counts says. Where dst adds or drops axes, one
    all-to-all of every moved axis."""
    if set(src.axes()) != set(dst.axes()):
        return [moved]
    ratios = []
    for d, (a, b) in enumerate(zip(src.dims, dst.dims, strict=True)):
        out = mesh.group_size(tuple(x for x in a if x in moved))
        into = mesh.group_size(tuple(x for x in b if x in moved))
        ratios.append((out // into, d) if out > into else (-(into // out), d))
    sources = sorted(([r, d] for r, d in ratios if r > 1), reverse=True)
    targets = sorted(([-r, d] for r, d in ratios if r < -1), reverse=True)
    pairs = []
    for s in list(sources):  # equal ratios pair first
        t = next((t for t in targets if t[0] == s[0]), None)
        if t is not None:
            pairs.append((s[1], t[1]))
            sources.remove(s)
            targets.remove(t)
    while sources and targets:  # then the largest, split by the other
        s, t = sources[0], targets[0]
        n = min(s[0], t[0])
        pairs.append((s[1], t[1]))
        s[0], t[0] = s[0] // n, t[0] // n
        sources = sorted(x for x in sources if x[0] > 1)[::-1]
        targets = sorted(x for x in targets if x[0] > 1)[::-1]
    if len(pairs) <= 1:
        return [moved] if pairs else []
    return [tuple(a for a in moved if src.dim_of(a) == s and dst.dim_of(a) == t) or
            tuple(a for a in moved if src.dim_of(a) == s) for s, t in pairs]


def _by_counts(src: Spec, dst: Spec, mesh: MeshInfo, whole_only: bool = False
               ) -> tuple[list[Axes], Spec] | None:
    """(the axes of each all-to-all, the layout they leave) where XLA moves axes between
    dimensions with several all-to-alls, dst neither adding nor dropping axes. XLA goes by
    how many pieces each dimension has, not by the axes' names: each all-to-all moves into
    a dimension that has fewer pieces than dst's as many more as it lacks, from one that has
    that many (all its pieces: the dimension that lacks most first, then the lower), else
    the minor pieces of one that has more than dst's; the pieces land last in the
    dimension, and a permute renumbers them after where that is not dst. From [-, d0, d1+d2]
    to [d0+d1, -, d2] on 2 x 2 x 2: dimension 2's four pieces into dimension 0 (over d1 and
    d2), then dimension 1's two into dimension 2 (over d0), landing [d1+d2, -, d0], and a
    permute across all three axes (all-to-alls over d0 and over d1 and a permute across d2
    had been predicted: d1 and d0 go into dimension 0 by name; with it the model priced
    11,124 of the 11,130 pairs of rank 3 on 2 x 2 x 2 as compiled, 10,836 before). Moves
    between two pairs of dimensions with none in common, one after the other, are one all-to-all
    over both's axes (rank 4: [d0, d1+d2, -, -] to [-, -, d0, d1+d2] is one over all three;
    on a sample of 1,000 pairs of rank 4 on 2 x 2 x 2, 906 -> 924 priced as compiled, none
    fewer), and a dimension moved into gives none of its pieces away ([d2, d1+d0, -, -] to
    [-, d0, d2, d1]: d2 into dimension 2 and d0 into dimension 3, one all-to-all; 944 -> 954).
    None where no such moves reach dst (whole_only: with whole dimensions' pieces
    alone), or dst adds or drops axes."""
    if set(src.axes()) != set(dst.axes()):
        return None
    cur = list(src.dims)
    size = mesh.group_size
    moves: list[Axes] = []
    ends: list[set[int]] = []  # the dimensions each all-to-all moves pieces between
    filled: set[int] = set()   # the dimensions moved into
    for _ in range(len(cur) * len(cur)):
        lack = {d: size(dst.dims[d]) // size(axes) for d, axes in enumerate(cur)
                if size(dst.dims[d]) > size(axes)}
        if not lack:
            break
        into = sorted(lack, key=lambda d: (-lack[d], d))
        # (a dimension moved into keeps its pieces)
        whole = [(t, d) for t in into for d, axes in enumerate(cur)
                 if d != t and d not in filled and axes and size(axes) == lack[t]]
        if whole:
            t, s = whole[0]
        elif whole_only:
            return None
        else:
            t = into[0]
            s = next((d for d, axes in enumerate(cur) if d != t and size(axes) > size(dst.dims[d])
                      and size(tuple(_minor(axes, lack[t], mesh))) == lack[t]), None)
            if s is None:
                return None
        axes = tuple(_minor(cur[s], lack[t], mesh))
        cur[s] = tuple(a for a in cur[s] if a not in axes)
        cur[t] = (*cur[t], *axes)
        filled.add(t)
        if moves and ends[-1].isdisjoint((s, t)):  # one all-to-all over both pairs of dims
            moves[-1], ends[-1] = (*moves[-1], *axes), ends[-1] | {s, t}
        else:
            moves.append(axes)
            ends.append({s, t})
    if any(size(a) != size(b) for a, b in zip(cur, dst.dims, strict=True)):
        return None
    return moves, Spec(tuple(cur))


def _whole_moves(src: Spec, dst: Spec, local: float, mesh: MeshInfo
                 ) -> list[Collective] | None:
    """Where dst merges src's dimensions (_merged) but every dimension dst cuts lacks as many
    pieces as one of src's has, which only rank 4 and up allow: XLA moves them whole, by
    _by_counts' all-to-alls, and renumbers after, where it gathers the whole array for rank 3
    ([-, d0, -, d1+d2] -> [d1, -, d2+d0, -] on 2 x 2 x 2: one all-to-all over all three axes
    and a permute, an eighth of the array each, where gathers of 1.5 of it had been assumed;
    on 1,000 sampled pairs of rank 4, 924 -> 944 priced as compiled, none fewer). None
    otherwise."""
    counted = _by_counts(src, dst, mesh, whole_only=True)
    if counted is None:
        return None
    moves, landed = counted
    if not landed.placed_as(dst) and not _within(landed, dst, mesh):
        return None
    return [Collective("all-to-all", axes, local) for axes in moves] + \
        _renumbered_into(landed, dst, local, mesh)


def _regrouped(src: Spec, dst: Spec, moved: Axes, all_to_alls: int) -> bool | None:
    """Whether XLA's all-to-alls leave the pieces out of place where dst moves src's axes and
    neither adds nor drops any, and the moves are not one all-to-all between two dimensions
    (None there, and where dst adds or drops axes: reshard's other rules decide). They do
    when the moved axes go between more pairs of dimensions than XLA runs all-to-alls
    (_all_to_alls), and when it runs several but some dimension's moved axes are not a
    whole dimension of src landing as a whole dimension of dst ([d0, -, d1+d2] ->
    [d1+d2, d0, -] is not renumbered, [-, d0+d1, d2] -> [d1, -, d2+d0] is). The same
    sample as _all_to_alls'."""
    groups = {(src.dim_of(a), dst.dim_of(a)) for a in moved}
    if set(src.axes()) != set(dst.axes()) or (all_to_alls == 1 and len(groups) == 1):
        return None
    if all_to_alls < len(groups):
        return True
    return any(tuple(a for a in moved if src.dim_of(a) == s and dst.dim_of(a) == t) !=
               src.dims[s] or src.dims[s] != dst.dims[t] for s, t in groups)


def _sliced_around(src: Spec, dst: Spec, moved: Axes) -> bool:
    """Whether dst adds axes src does not use both before an axis moving into a dimension
    (in that dimension) and on a dimension no axis moves out of or into ([-, d0, -] ->
    [d1+d0, -, d2]): XLA slices them first, then the all-to-all leaves the pieces out of
    place and a collective-permute renumbers them (every such pair of rank 3 on 2 x 2 x 2
    devices, tests/test_cost.py)."""
    ends = {src.dim_of(a) for a in moved} | {dst.dim_of(a) for a in moved}
    before = any(src.dim_of(b) is None for a in moved
                 for b in dst.dims[dst.dim_of(a)][:dst.dims[dst.dim_of(a)].index(a)])
    return before and any(src.dim_of(b) is None for d, axes in enumerate(dst.dims)
                          if d not in ends for b in axes)


def _cutting(spec: Spec, mesh: MeshInfo) -> Spec:
    """The spec without the mesh axes of size 1 (itself when it has none)."""
    ones = mesh.cache.get("axes of size 1")
    if ones is None:
        ones = mesh.cache["axes of size 1"] = frozenset(
            a for a in mesh.names if mesh.axis_size(a) == 1)
    if not ones or ones.isdisjoint(spec.axes()):
        return spec
    return Spec(tuple(tuple(a for a in d if a not in ones) for d in spec.dims),
                tuple(a for a in spec.partial if a not in ones))


def permuted_axes(src: Spec, dst: Spec, mesh: MeshInfo, replica_order: Axes | None = None
                  ) -> Axes:
    """The mesh axes along which the devices a collective-permute pairs differ, for a permute
    from src's pieces to dst's where each piece of dst lies within one of src's (_within): the
    links it crosses, which on a mesh across nodes decide its time. XLA pairs a device with the
    one holding the same piece at the same replica number, src's pieces first cut as dst's by
    the major end of its replica number (the axes src leaves free, mesh order): from [-, d0] to
    [-, d1+d2] on 2 x 2 x 2 device (a, b, c) takes its piece from (b, c, a), across all three
    axes, where dst's own axes (d1, d2) had been assumed. Every such pair of 2 x 2 x 2 and
    4 x 2 compiled so (522 and 12 pairs, the model's axes before: 186 and 10). Axes in mesh
    order; dst's axes where the pairing is not one to one. replica_order: src's free axes in the
    order that numbers the replicas (major first), where XLA's is not mesh order (after a
    gather: _gathered_whole_first). Remembered per mesh (mesh.cache): the resharding model
    asks it again for the steps of many pairs (a 16-device search: 67k asks, 21k distinct)."""
    memo = mesh.cache.setdefault("permuted axes", {})
    key = (src, dst, replica_order)
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = _permuted_axes(src, dst, mesh, replica_order)
    return hit


def _device_numbers(mesh: MeshInfo) -> tuple[np.ndarray, dict]:
    """(coordinates: axis x device, {axes: each device's number in them}): a device's number
    in a tuple of axes is mixed radix, the first axis most significant; filled as asked."""
    hit = mesh.cache.get("device numbers")
    if hit is None:
        coords = np.indices(mesh.sizes).reshape(len(mesh.sizes), -1)
        coords.flags.writeable = False  # shared: read only
        hit = mesh.cache["device numbers"] = (coords, {})
    return hit


def _permuted_axes(src: Spec, dst: Spec, mesh: MeshInfo, replica_order: Axes | None
                   ) -> Axes:
    """permuted_axes, worked out."""
    coords, numbers = _device_numbers(mesh)

    def number(axes) -> np.ndarray:  # mixed radix, the first axis most significant
        hit = numbers.get(axes)
        if hit is None:
            hit = np.zeros(coords.shape[1], dtype=np.int64)
            for a in axes:
                hit = hit * mesh.axis_size(a) + coords[mesh.names.index(a)]
            hit.flags.writeable = False
            numbers[axes] = hit
        return hit

    def free(spec: Spec) -> tuple[str, ...]:
        return tuple(a for a in mesh.names if spec.dim_of(a) is None)

    order = free(src) if replica_order is None else replica_order
    pieces, replica, left = [number(axes) for axes in src.dims], number(order), \
        mesh.group_size(order)
    for d, (a, b) in enumerate(zip(src.dims, dst.dims, strict=True)):
        more = mesh.group_size(b) // mesh.group_size(a)
        if more > 1:
            if left % more:
                return dst.axes()
            left //= more
            pieces[d] = pieces[d] * more + replica // left
            replica = replica % left

    def code(index: list[np.ndarray], rep: np.ndarray) -> np.ndarray:
        out = np.zeros_like(rep)
        for axes, k in zip(dst.dims, index, strict=True):
            out = out * mesh.group_size(axes) + k
        return out * left + rep

    held = code(pieces, replica)
    if len(np.unique(held)) != held.size:
        return dst.axes()
    source = np.empty_like(held)
    source[held] = np.arange(held.size)
    moved = source[code([number(axes) for axes in dst.dims], number(free(dst)))]
    crossed = (coords[:, moved] != coords).any(axis=1)
    return tuple(a for a, c in zip(mesh.names, crossed, strict=True) if c) or dst.axes()


def _within(src: Spec, dst: Spec, mesh: MeshInfo) -> bool:
    """src cuts every dimension into a number of pieces that dst's divides, and in some
    dimension src's axes are not the first of dst's (so slicing alone does not do): every
    piece of dst then lies within one piece of src, held by another device, and XLA moves the
    pieces with one collective-permute."""
    if src.partial:
        return False
    pairs = list(zip(src.dims, dst.dims, strict=True))
    return all(mesh.group_size(b) % mesh.group_size(a) == 0 for a, b in pairs) and \
        any(a != b[:len(a)] for a, b in pairs)


def _rematerialized(src: Spec, dst: Spec, mesh: MeshInfo) -> bool:
    """Whether XLA's partitioner finds no path from src to dst and gathers the whole array
    before slicing it to dst ("involuntary full rematerialization", the warning it logs), as
    compiled sharding constraints, the copies a plan lowers to, show (tests/test_cost.py):
    - src cuts one dimension; dst leaves it whole and cuts others, none of which carries every
      axis src cuts it on or cuts into as many pieces (an all-to-all moves one dimension's
      tiles to another cut as many ways);
    - src cuts one dimension; dst cuts several and leaves out some of src's axes;
    - dst moves an axis of src to another dimension and adds an axis src does not use, while
      a third axis is unused by both (a replicated remainder the all-to-all cannot keep)."""
    if src.partial:
        return False
    cut = [d for d, axes in enumerate(src.dims) if axes]
    into = [d for d, axes in enumerate(dst.dims) if axes]
    if len(cut) == 1 and not dst.dims[cut[0]]:
        axes, pieces = src.dims[cut[0]], mesh.group_size(src.dims[cut[0]])
        if into and not any(set(axes) <= set(dst.dims[j]) or
                            mesh.group_size(dst.dims[j]) == pieces for j in into):
            return True
    if len(cut) == 1 and len(into) > 1 and any(dst.dim_of(a) is None for a in src.axes()):
        return True
    moves = any(dst.dim_of(a) not in (None, src.dim_of(a)) for a in src.axes())
    adds = any(src.dim_of(a) is None for a in dst.axes())
    idle = any(src.dim_of(a) is None and dst.dim_of(a) is None for a in mesh.names)
    return moves and adds and idle


def _merged(src: Spec, dst: Spec) -> bool:
    """src cuts several dimensions, and dst merges their axes: either dst cuts only dimensions
    src leaves whole, one of them with axes from more than one of src's, or dst cuts one
    dimension only, with every axis of src's and more (an axis src does not use, or src's
    from three dimensions or more); dst keeps every axis of src's. When dst drops one, XLA
    takes other paths, but where dst cuts one dimension only, with several axes: a dimension
    src leaves whole, taking an axis of src's and one src does not use (`[d1, d2, -] ->
    [-, -, d0+d2]`), or dimension 0 when src cuts three or more (`[d0, d1, d2] -> [d0+d1, -,
    -]`; into dimension 1 or 2 XLA gathers the dropped axis and all-to-alls). XLA then gathers
    the whole array, a dimension at a time, and slices it (tests/test_cost.py; every such
    pair of rank 3 on 2 x 2 x 2 compiles so, whatever the shape's sizes)."""
    cut = [d for d, axes in enumerate(src.dims) if axes]
    into = [d for d, axes in enumerate(dst.dims) if axes]
    if src.partial or len(cut) < 2 or not into:
        return False
    if any(dst.dim_of(a) is None for a in src.axes()):
        if len(into) != 1 or len(dst.dims[into[0]]) < 2:
            return False
        j, origin = into[0], [src.dim_of(a) for a in dst.dims[into[0]]]
        return (j not in cut and None in origin and any(d is not None for d in origin)) or \
            (j == 0 and len(cut) >= 3)
    if not set(cut) & set(into):
        return any(len({src.dim_of(a) for a in dst.dims[j]} - {None}) > 1 for j in into)
    return len(into) == 1 and set(src.axes()) <= set(dst.dims[into[0]]) and (
        len(cut) > 2 or any(src.dim_of(a) is None for a in dst.axes()))


def _swapped(src: Spec, dst: Spec, mesh: MeshInfo) -> tuple[Axes, Axes] | None:
    """(src's axes, dst's) of the one dimension whose axes dst replaces by others, unused in
    src, that cut it fewer ways, every other dimension alike; None when the specs differ
    otherwise. XLA renumbers the pieces (a collective-permute) and gathers them in groups."""
    if src.partial:
        return None
    differ = [d for d, (a, b) in enumerate(zip(src.dims, dst.dims, strict=True)) if a != b]
    if len(differ) != 1:
        return None
    cut, into = src.dims[differ[0]], dst.dims[differ[0]]
    if not cut or not into or set(into) & set(src.axes()) or \
            mesh.group_size(into) >= mesh.group_size(cut):
        return None
    return cut, into


def _gathers_first(src: Spec, dst: Spec, moved: Axes) -> bool:
    """Whether XLA gathers the axes dst drops before the all-to-all moving `moved` (which then
    moves the larger pieces): it does when no moved axis lands in a dimension that loses
    one (rank-3 arrays on 4 x 2 and 2 x 2 x 2 devices, benchmarks/reshard_accuracy.py)."""
    return not any(dst.dim_of(a) is None for m in moved for a in src.dims[dst.dim_of(m)])


def _misplaced(src: Spec, dst: Spec, mesh: MeshInfo, ahead: bool = True) -> bool:
    """Whether an all-to-all leaves the axes out of dst's order. XLA slices the axes src does
    not use onto their dimensions first, in mesh order whatever dst's ([-, d0] ->
    [d2+d1+d0, -] is renumbered on 2 x 2 x 2 devices, [-, d0] -> [d1+d2+d0, -] is not), then
    moves each axis changing dimension after those its new dimension holds; where that order
    is not dst's, or (`ahead`) an axis moves out from before one that stays in its
    dimension, the pieces are renumbered. With the dropped axes gathered first (`ahead`
    False) the second does not hold (benchmarks/reshard_accuracy.py: 2 x 2 x 2 devices,
    rank 3)."""
    dims = [[a for a in axes if dst.dim_of(a) is not None] for axes in src.dims]
    for d, axes in enumerate(dst.dims):
        dims[d].extend(mesh.order(a for a in axes if src.dim_of(a) is None))
    for d, axes in enumerate(src.dims):
        for a in axes:
            j = dst.dim_of(a)
            if j is None or j == d:
                continue
            after = dims[d][dims[d].index(a) + 1:]
            if ahead and any(dst.dim_of(b) == d and src.dim_of(b) in (d, None) for b in after):
                return True
            dims[d].remove(a)
            dims[j].append(a)
    return tuple(map(tuple, dims)) != dst.dims


def _relabelled(src: Spec, dst: Spec, nbytes: float, mesh: MeshInfo
                ) -> list[Collective] | None:
    """XLA's path when dst is src with some axes renamed to others of the same size, and then
    gathers alone: dst keeps the leading axes of each dimension of the renamed spec
    ([d0, d1+d2] -> [d1, d2] on 2 x 2 x 2 devices: renamed [d1, d2+d0], d0 gathered). The
    renaming is a renumbering of the devices' pieces (one collective-permute), then each
    dimension that loses axes is gathered, the last first. None where gathers alone do
    (no renaming needed) or no renaming leads to gathers. On 2 x 2 x 2 devices every such
    pair of rank 2 (522) and a sample of 400 of rank 3 compile so (benchmarks/
    reshard_accuracy.py); an all-to-all and a gather had been predicted for a sixth of them."""
    # Renaming keeps each dimension's number of axes and gathers only drop some: dst holds
    # no more in any dimension (most pairs stop here).
    if src.partial or any(len(b) > len(a) for a, b in zip(src.dims, dst.dims, strict=True)) \
            or all(dst.dims[d] == axes[:len(dst.dims[d])] for d, axes in enumerate(src.dims)):
        return None
    for rename in _renamings(mesh):
        dims = [tuple(rename[a] for a in axes) for axes in src.dims]
        if dims == list(src.dims) or any(dst.dims[d] != axes[:len(dst.dims[d])]
                                         for d, axes in enumerate(dims)):
            continue
        moved = tuple(a for a in mesh.names if rename[a] != a and a in src.axes())
        return _permuted_then_gathered(moved, dims, dst, nbytes / src.shards(mesh), mesh)
    return None


def _permuted_then_gathered(axes: Axes, dims: list[tuple[str, ...]], dst: Spec, local: float,
                            mesh: MeshInfo) -> list[Collective]:
    """One collective-permute over `axes` of the local pieces (`local` bytes) into a layout
    of `dims`, then each dimension's axes past dst's gathered, the last dimension first."""
    out = [Collective("collective-permute", axes, local)]
    for d in reversed(range(len(dims))):
        gone = dims[d][len(dst.dims[d]):]
        if gone:
            local *= mesh.group_size(gone)
            out.append(Collective("all-gather", gone, local))
    return out


def _regathered(src: Spec, dst: Spec, nbytes: float, mesh: MeshInfo
                ) -> list[Collective] | None:
    """XLA's pieces renumbered, then gathered: the renumbered layout is dst with each
    dimension cut further, as many ways as src cuts it, by the axes dst leaves free in mesh
    order (the first dimension first); one collective-permute into it (on permuted_axes'
    axes), then each dimension's added axes gathered, the last dimension first. From
    [-, d1+d2] to [-, d0] on 2 x 2 x 2: a permute into [-, d0+d1] across all three axes and
    d1 gathered, where a renaming into [-, d0+d2] (a permute over d1, d2 gathered) had been
    assumed. None where no such layout exists or it is src or dst itself. reshard() takes
    it for the paths it prices as a permute and gathers of the same bytes, and the compiled
    programs run on its axes: all 276 such pairs of rank 2 on 2 x 2 x 2 (212 before), the 41
    of a sample of 600 of rank 3 (33) and the 6 of rank 2 on 4 x 2 (2)."""
    if src.partial:
        return None
    free = [a for a in mesh.names if dst.dim_of(a) is None]
    dims = []
    for d, axes in enumerate(dst.dims):
        want, got = mesh.group_size(src.dims[d]), list(axes)
        while mesh.group_size(tuple(got)) < want and free:
            got.append(free.pop(0))
        if mesh.group_size(tuple(got)) != want:
            return None
        dims.append(tuple(got))
    between = Spec(tuple(dims))
    if between == src or between.dims == dst.dims:
        return None
    return _permuted_then_gathered(permuted_axes(src, between, mesh), dims, dst,
                                   nbytes / src.shards(mesh), mesh)


def _gathered_then_moved(src: Spec, dst: Spec, nbytes: float, mesh: MeshInfo
                         ) -> list[Collective] | None:
    """XLA's path when dst leaves one dimension (q) of src's whole and cuts another (p) as
    many ways as src cut q, every other dimension alike: p's own axes gathered, q's pieces
    all moved to p (one all-to-all over q's axes), then renumbered into dst (a permute, on
    permuted_axes' axes). From [d0, d1+d2] to [d0+d1, -] on 2 x 2 x 2: d0 gathered, an
    all-to-all over d1 and d2, a permute across all three axes, where d2 gathered and an
    all-to-all and a permute over d1 had been assumed (the same bytes). reshard() takes it
    for the paths it prices as those kinds and bytes, and the compiled programs run on its
    axes: all 48 such pairs of rank 2 on 2 x 2 x 2 (none before) and 11 more of a sample of
    600 of rank 3. None for other pairs."""
    if src.partial:
        return None
    rank = len(src.dims)
    whole = [d for d in range(rank) if src.dims[d] and not dst.dims[d]]
    changed = [d for d in range(rank) if src.dims[d] != dst.dims[d]]
    if len(whole) != 1 or len(changed) != 2:
        return None
    q = whole[0]
    p = changed[0] if changed[1] == q else changed[1]
    if not src.dims[p] or mesh.group_size(dst.dims[p]) != mesh.group_size(src.dims[q]):
        return None
    local = nbytes / src.shards(mesh) * mesh.group_size(src.dims[p])
    out = [Collective("all-gather", src.dims[p], local),
           Collective("all-to-all", src.dims[q], local)]
    moved = Spec(tuple(src.dims[q] if d == p else () if d == q else src.dims[d]
                       for d in range(rank)))
    return out + _renumbered_into(moved, dst, local, mesh)


def _moved_then_sliced(src: Spec, dst: Spec, local: float) -> list[Collective] | None:
    """XLA's path when the last dimension's axes move, all of them and in order, into the one
    before it, which src leaves whole, and dst's new axes cut only the last: one all-to-all
    over the moved axes at src's piece size, then the slice (free). From [-, d0+d1] to
    [d0+d1, d2] on 2 x 2 x 2 (and [-, d0] to [d0, d1] on 4 x 2): an all-to-all over d0 and d1
    of the whole piece, where d2 sliced first, then an all-to-all over d1 and a permute of
    half the piece each, had been assumed (the same bytes). Every such pair of rank 2 on
    2 x 2 x 2 and 4 x 2 compiled so, and on 4 x 2 [-, -, d0] to [-, d0, d1]; not
    [-, d0, -] to [d0, d1, -], nor [-, -, d0] to [d0, -, d1] (an all-to-all and a permute of
    the sliced piece, as the general path has them). None for other pairs."""
    if src.partial:
        return None
    rank = len(src.dims)
    into = [(d, src.dim_of(dst.dims[d][0])) for d in range(rank)
            if dst.dims[d] and not src.dims[d] and src.dim_of(dst.dims[d][0]) is not None]
    into = [(j, i) for j, i in into if dst.dims[j] == src.dims[i]]
    if len(into) != 1 or into[0] != (rank - 2, rank - 1):
        return None
    j, i = into[0]
    for d in range(rank):
        if d == j:
            continue
        kept = src.dims[d] if d != i else ()
        extra = dst.dims[d][len(kept):]
        if dst.dims[d][:len(kept)] != kept or (extra and d != i) or \
                any(src.dim_of(a) is not None for a in extra):
            return None
    return [Collective("all-to-all", src.dims[i], local)]


def _sliced_then_spread(src: Spec, dst: Spec, nbytes: float, mesh: MeshInfo
                        ) -> list[Collective] | None:
    """XLA's path when src cuts one dimension alone and dst leaves it whole, cuts two
    dimensions or more with its axes and new ones, and cuts the first of them as many ways
    as src cut its own, more than any other: the new axes slice src's dimension first (in
    mesh order, ahead of its own axes); then one all-to-all per dimension dst cuts, the one
    cut most ways first (the lower first where two are cut alike), each taking as many of
    the dimension's minor pieces as dst cuts it into; then a permute where that leaves the
    pieces out of dst's order. From [-, -, d0+d1] to [d0+d2, d1, -] on 2 x 2 x 2: d2 sliced
    into [-, -, d2+d0+d1], an all-to-all over d0 and d1 into dimension 0 and one over d2
    into dimension 1, then a permute across d1 and d2 (one all-to-all of d0 and d1 and a
    permute had been predicted); on 4 x 2, [d0, -, -] to [-, d0, d1] is two all-to-alls,
    over d0 and over d1 (one, of half the bytes, had been). Of every pair of rank 3
    compiled (11,130 on 2 x 2 x 2, 342 on 4 x 2), 96 and 8 more are priced as compiled,
    none fewer. None for other pairs (where dst cuts a later dimension most, [-, -, d0+d1]
    to [d2, d1+d0, -], XLA slices d2 into dimension 0 and runs one all-to-all, as the
    general path prices it)."""
    if src.partial or dst.partial:
        return None
    cut = [d for d, axes in enumerate(src.dims) if axes]
    new = [a for a in mesh.names if a in dst.axes() and src.dim_of(a) is None]
    if len(cut) != 1 or not new or dst.dims[cut[0]] or \
            any(dst.dim_of(a) is None for a in src.axes()):
        return None
    i = cut[0]
    gaining = sorted((d for d, axes in enumerate(dst.dims) if axes),
                     key=lambda d: (-mesh.group_size(dst.dims[d]), d))
    if len(gaining) < 2 or gaining[0] != min(gaining) or \
            mesh.group_size(dst.dims[gaining[0]]) != mesh.group_size(src.dims[i]):
        return None
    left, dims = [*new, *src.dims[i]], [()] * len(src.dims)
    local = nbytes / (src.shards(mesh) * mesh.group_size(tuple(new)))
    out = []
    for d in gaining:
        moved = _minor(tuple(left), mesh.group_size(dst.dims[d]), mesh)
        if mesh.group_size(tuple(moved)) != mesh.group_size(dst.dims[d]):
            return None
        left = left[:len(left) - len(moved)]
        dims[d] = tuple(moved)
        out.append(Collective("all-to-all", tuple(moved), local))
    if left:
        return None
    return out + _renumbered_into(Spec(tuple(dims)), dst, local, mesh)


def _gathered_whole_first(src: Spec, dst: Spec, nbytes: float, mesh: MeshInfo,
                          matmul: bool) -> list[Collective] | None:
    """XLA's path when src cuts one dimension with two axes or more and one other with one
    axis, and dst leaves the first whole, cuts no dimension with more than one axis, and cuts
    one that src leaves whole: the first dimension's axes gathered at once, then the rest of
    the way from there (_gathered_then). From [-, d0, d1+d2] to [d0, d1, -] on 2 x 2 x 2: an
    all-gather over d1 and d2 into [-, d0, -], then a permute across d0 and d1 (d2 gathered,
    an all-to-all over d0 and d1 and a permute, had been predicted: 0.75 of the array where
    XLA moves 0.75, on other axes; [d0, -, d1+d2] to [d0, d1, -], 0.75 where XLA gathers
    0.5 and moves nothing else; [-, d0+d1, d2] to [d0, -, d2], the same). Of every pair of
    rank 3 on 2 x 2 x 2, 216 more priced as compiled, none fewer. None for other pairs."""
    if src.partial or dst.partial or len(src.dims) < 3:
        return None
    cut = [d for d, axes in enumerate(src.dims) if axes]
    many = [d for d in cut if len(src.dims[d]) > 1]
    if len(cut) != 2 or len(many) != 1 or dst.dims[many[0]] or \
            any(len(axes) > 1 for axes in dst.dims) or \
            not any(axes and not src.dims[d] for d, axes in enumerate(dst.dims)):
        return None
    return _gathered_then(src, dst, many[0], 0, nbytes, mesh, matmul)


def _gathered_minor_first(src: Spec, dst: Spec, nbytes: float, mesh: MeshInfo,
                          matmul: bool) -> list[Collective] | None:
    """XLA's path when src cuts one dimension alone, with three axes or more, and dst cuts it
    fewer ways, as many as its leading (major) axes do, cuts no dimension with more than one
    axis and cuts another: the dimension's other (minor) axes gathered at once, then the
    rest of the way from there (_gathered_then). From [-, -, d0+d1+d2] to [d0, d1, d2] on
    2 x 2 x 2: an all-gather over d1 and d2 into [-, -, d0], then a permute across all three
    axes (two all-to-alls and a permute had been predicted, 0.375 of the array where XLA
    moves 0.625; of every pair of rank 3 on 2 x 2 x 2, 108 more priced as compiled, none
    fewer). None for other pairs."""
    if src.partial or dst.partial or len(src.dims) < 3:
        return None
    cut = [d for d, axes in enumerate(src.dims) if axes]
    if len(cut) != 1 or len(src.dims[cut[0]]) < 3 or any(len(axes) > 1 for axes in dst.dims) \
            or not any(axes for d, axes in enumerate(dst.dims) if d != cut[0]):
        return None
    k = cut[0]
    keep = next((m for m in range(len(src.dims[k]))
                 if mesh.group_size(src.dims[k][:m]) == mesh.group_size(dst.dims[k])), None)
    return None if keep is None else _gathered_then(src, dst, k, keep, nbytes, mesh, matmul)


def _gathered_then(src: Spec, dst: Spec, k: int, keep: int, nbytes: float, mesh: MeshInfo,
                   matmul: bool) -> list[Collective]:
    """An all-gather of src's dimension k but its first `keep` axes, at once, then the rest
    of the way to dst: nothing where dst only slices further, else a permute where every
    piece of dst lies within one (_within), pairing devices by replica numbers in which the
    gathered axes come in src's order, after the axes src left free ([-, d0, d2+d1] to
    [d0, d1, -] crosses all three axes, [-, d0, d1+d2] to [d0, d1, -] d0 and d1), else the
    path reshard() takes from there."""
    gone = src.dims[k][keep:]
    between = Spec(tuple(src.dims[k][:keep] if d == k else axes
                         for d, axes in enumerate(src.dims)))
    out = [Collective("all-gather", gone, nbytes / between.shards(mesh))]
    if _within(between, dst, mesh):
        order = (*(a for a in mesh.names if src.dim_of(a) is None), *gone)
        out += _renumbered_into(between, dst, nbytes / dst.shards(mesh), mesh, order)
    elif not between.placed_as(dst):
        out += _on_xla_axes(between, dst, _path(between, dst, nbytes, mesh, matmul), nbytes,
                            mesh)
    return out


def _emptied_then_moved(src: Spec, dst: Spec, nbytes: float, mesh: MeshInfo
                        ) -> list[Collective] | None:
    """XLA's path, by the pieces each dimension has, when one dimension (p) gains pieces and
    several lose them: the all-to-all takes p's new pieces from one that loses as many (q:
    one dst still cuts, else the last; its minor axes), and the others, which dst leaves
    whole, are gathered first (the last first); a permute then renumbers the pieces into dst.
    From [d0, d1, d2] to [-, d0+d1, -] on 2 x 2 x 2: d0 gathered, an all-to-all over d2 and a
    permute across all three axes, where d2 gathered and an all-to-all and a permute over d0
    had been assumed (the same bytes). None for other pairs."""
    if src.partial:
        return None
    pieces = _pieces(src, dst, mesh)
    gaining = [d for d, (a, b) in enumerate(pieces) if b > a]
    losing = [d for d, (a, b) in enumerate(pieces) if a > b]
    if len(gaining) != 1 or len(losing) < 2 or pieces[gaining[0]][1] % pieces[gaining[0]][0]:
        return None
    p = gaining[0]
    need = pieces[p][1] // pieces[p][0]
    sources = [d for d in losing if pieces[d][0] == pieces[d][1] * need]
    if not sources:
        return None
    q = max(sources, key=lambda d: (pieces[d][1] > 1, d))
    emptied = [d for d in losing if d != q]
    moved = _minor(src.dims[q], need, mesh)
    if any(pieces[d][1] > 1 for d in emptied) or mesh.group_size(tuple(moved)) != need:
        return None
    local, out = nbytes / src.shards(mesh), []
    for d in reversed(emptied):
        local *= pieces[d][0]
        out.append(Collective("all-gather", src.dims[d], local))
    out.append(Collective("all-to-all", tuple(moved), local))
    between = Spec(tuple(
        () if d in emptied else tuple(a for a in axes if a not in moved) if d == q else
        (*axes, *moved) if d == p else axes for d, axes in enumerate(src.dims)))
    return out + _renumbered_into(between, dst, local, mesh)


def _renumbered_into(between: Spec, dst: Spec, local: float, mesh: MeshInfo,
                     replica_order: Axes | None = None) -> list[Collective]:
    """The permute (on permuted_axes' axes, of `local` bytes; replica_order as there) that
    renumbers pieces laid out as `between` into dst's places; none where they are there
    already."""
    if between.placed_as(dst):
        return []
    return [Collective("collective-permute",
                       permuted_axes(between, dst, mesh, replica_order), local)]


def _renamings(mesh: MeshInfo) -> list[dict[str, str]]:
    """Every renaming of the mesh's axes to axes of the same size but the identity (kept in
    mesh.cache)."""
    hit = mesh.cache.get("renamings")
    if hit is None:
        names = mesh.names
        hit = mesh.cache["renamings"] = [
            dict(zip(names, image, strict=True)) for image in itertools.permutations(names)
            if image != names and all(mesh.axis_size(a) == mesh.axis_size(b)
                                      for a, b in zip(names, image, strict=True))]
    return hit


def _renamed(src: Spec, dst: Spec, nbytes: float, mesh: MeshInfo) -> list[Collective] | None:
    """XLA's path when dst drops axes of one dimension of src's for others, unused by src, that
    cut as many ways, and what is left is a move of axes between dimensions: the pieces are
    renumbered (one collective-permute, the dropped axes renamed the new ones where they are,
    or after the all-to-all, where the new ones go) and moved (an all-to-all). None
    otherwise (benchmarks/reshard_accuracy.py, 2 x 2 x 2 devices: [d0, -] -> [-, d2] and
    [d0+d2, -] -> [d2, d1] had been priced as gathers of half and all of the array)."""
    if src.partial:
        return None
    gone = tuple(a for a in src.axes() if dst.dim_of(a) is None)
    new = tuple(a for a in dst.axes() if src.dim_of(a) is None)
    if not gone or not new or mesh.group_size(gone) != mesh.group_size(new) or \
            len({src.dim_of(a) for a in gone}) > 1 or len({dst.dim_of(a) for a in new}) > 1:
        return None
    permute = Collective("collective-permute", dst.axes(), nbytes / src.shards(mesh))

    def moves(a: Spec, b: Spec) -> list[Collective] | None:
        """The all-to-alls from a to b where that is all it takes but a renumbering (which
        the one permute does as it renames)."""
        found = reshard(a, b, nbytes, mesh)
        kinds = [c.kind for c in found]
        if "all-to-all" not in kinds or set(kinds) - {"all-to-all", "collective-permute"}:
            return None
        return [c for c in found if c.kind == "all-to-all"]

    d, j = src.dim_of(gone[0]), dst.dim_of(new[0])
    kept, at = [a for a in src.dims[d] if a not in gone], src.dims[d].index(gone[0])
    # Renamed in place: the new axes in mesh order with the kept ones, else where the first
    # dropped one was.
    for axes in (mesh.order(tuple(kept) + new), tuple(kept[:at]) + new + tuple(kept[at:])):
        found = moves(Spec(tuple(axes if i == d else a for i, a in enumerate(src.dims))), dst)
        if found:
            return [permute, *found]
    # Moved first, the dropped axes where dst puts the new ones, then renamed.
    kept, at = [a for a in dst.dims[j] if a not in new], dst.dims[j].index(new[0])
    axes = tuple(kept[:at]) + gone + tuple(kept[at:])
    found = moves(src, Spec(tuple(axes if i == j else a for i, a in enumerate(dst.dims))))
    return [*found, permute] if found else None


def _dropped_for(src: Spec, dst: Spec, nbytes: float, mesh: MeshInfo
                 ) -> list[Collective] | None:
    """XLA's path when dst moves one dimension's axes (B, from dimension q) into another (p)
    whose axes (A) it drops, leaving q whole, every other dimension alike ([d0, d1] -> [d1, -]).
    With A cutting at least as many ways as B, the pieces are renumbered (one
    collective-permute) and gathered, in groups of |B| and then of |A| / |B|; with A cutting
    fewer, A is gathered first and an all-to-all moves B (and a permute renumbers the pieces
    where B lands in another order). None for other pairs. Every such
    pair on 4 x 2 and 2 x 2 x 2 devices, rank 2 and 3, compiles so
    (benchmarks/reshard_accuracy.py): an all-to-all and one gather had been predicted, short
    of the bytes by a third where |A| > |B| and by a quarter where |A| < |B|."""
    if src.partial:
        return None
    differ = [d for d, (a, b) in enumerate(zip(src.dims, dst.dims, strict=True)) if a != b]
    if len(differ) != 2:
        return None
    for p, q in (differ, differ[::-1]):
        cut, moved = src.dims[p], src.dims[q]
        if cut and moved and sorted(dst.dims[p]) == sorted(moved) and not dst.dims[q] and \
                not set(cut) & set(dst.axes()):
            break
    else:
        return None
    local = nbytes / src.shards(mesh)
    a, b = mesh.group_size(cut), mesh.group_size(moved)
    if a < b:  # and the moved axes renumbered where they land in another order
        return [Collective("all-gather", cut, local * a),
                Collective("all-to-all", moved, local * a)] + \
            [Collective("collective-permute", moved, local * a)] * (dst.dims[p] != moved)
    if dst.dims[p] != moved:
        return None
    out = [Collective("collective-permute", src.axes(), local),
           Collective("all-gather", cut, local * b)]
    if a > b:
        out.append(Collective("all-gather", cut, local * a))
    return out


def _uneven_swap(src: Spec, dst: Spec, moved: Axes, mesh: MeshInfo) -> bool:
    """Whether a dimension trades axes with another for axes that cut it a different number of
    ways ([d0, d1] -> [d1, d0] on 4 x 2 devices): XLA's all-to-all then leaves the pieces on
    the wrong devices, and a collective-permute renumbers them (benchmarks/
    reshard_accuracy.py)."""
    for d in range(len(src.dims)):
        out = tuple(a for a in src.dims[d] if a in moved)
        into = tuple(a for a in dst.dims[d] if a in moved)
        if out and into and mesh.group_size(out) != mesh.group_size(into):
            return True
    return False


def _split(src: Spec, dst: Spec) -> bool:
    """Whether some dimension of src both loses axes (gathered) and moves others to another
    dimension ([d0, d1+d2] -> [d0+d1, -]). Gathered first, XLA then renumbers the pieces
    after the all-to-all: every such pair on 2 x 2 x 2 devices, rank 2, compiles so
    (benchmarks/reshard_accuracy.py)."""
    return any(any(dst.dim_of(a) is None for a in axes) and
               any(dst.dim_of(a) not in (None, d) for a in axes)
               for d, axes in enumerate(src.dims))


def _renumbered(src: Spec, dst: Spec) -> Axes:
    """Axes a dimension keeps while the axes outside them in that dimension change: the piece
    each device holds along that axis is then another one, and the pieces must move."""
    out = []
    for s_axes, d_axes in zip(src.dims, dst.dims, strict=True):
        for a in s_axes:
            if a in d_axes and s_axes[:s_axes.index(a)] != d_axes[:d_axes.index(a)]:
                out.append(a)
    return tuple(out)
