"""Indexing ops: dynamic_slice, dynamic_update_slice, gather and the scatter family.

An indexing op reads or writes *windows* of an operand at data-dependent positions. A dimension
can be cut without communication only where every device's piece of the work touches its own
piece of every array:

- a *window* dimension that the window covers whole and that no index moves (a `dynamic_slice`
  of a full dimension, the `d_model` dimension of an embedding lookup): a loop over the operand
  and the gathered result / the scattered updates;
- an *index batch* dimension (the token dimensions of `table[ids]`): a loop over the indices and
  the result / updates, joined by the operand dimension it is paired with in
  `operand_batching_dims` (the rows of `take_along_axis`).

- an *indexed* dimension whose window is one element wide (the vocabulary of an embedding
  table, Megatron's vocab-parallel embedding): each device looks up or updates only the rows
  it holds, with the indices shifted to its piece and those outside it masked. A gather's
  result is then partial (each row comes from the one device holding it, zeros elsewhere:
  an all-reduce over the axis makes it whole); a scatter's operand and result are cut so, and
  its indices and updates are read whole. XLA's SPMD partitioner emits exactly that (a local
  gather, a select, an all-reduce; a local scatter), checked against compiled HLO in
  tests/test_rules_indexing.py.

Windows narrower than their dimension at a data-dependent start and the index-vector dimension
(always the last of `indices` in JAX) are not loops.
Cutting a scatter's index batch dimension while the operand stays whole leaves each device with
only some of the updates: summable for `scatter-add` / `scatter-sub` (a reducible loop), wrong
for overwriting, multiplying or min/max scatters, which therefore never get that cut. The scalar
start indices of the dynamic slices are rank 0 and stay replicated.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax import lax

from jaxpar.rules.registry import (
    RULES,
    Loop,
    OpInfo,
    loop_strategies,
    same_dim_strategies,
)
from jaxpar.spec import MeshInfo, OpStrategy

Shape = tuple[int, ...]


def dynamic_slice_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    operand, sizes = info.in_shapes[0], info.params["slice_sizes"]
    return same_dim_strategies(info, mesh, [d for d, n in enumerate(operand) if sizes[d] == n])


def dynamic_update_slice_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    operand, update = info.in_shapes[:2]
    whole = [d for d, (n, u) in enumerate(zip(operand, update, strict=True)) if u == n]
    return same_dim_strategies(info, mesh, whole, arrays=2)


def _window_pairs(operand: Shape, window: Shape, window_dims: Sequence[int],
                  skipped: Sequence[int], indexed: Sequence[int]) -> list[tuple[int, int]]:
    """(operand dim, window dim) pairs where the window spans the operand dim at offset 0.

    Window dims map in order onto the operand dims that are neither collapsed / inserted nor
    batching (`skipped`); a dim in `indexed` has a data-dependent start, so it never qualifies.
    """
    kept = [d for d in range(len(operand)) if d not in skipped]
    return [(d, w) for d, w in zip(kept, window_dims, strict=True)
            if d not in indexed and window[w] == operand[d]]


def _batch_triples(indices: Shape, other: Shape, window_dims: Sequence[int],
                   index_batching: Sequence[int],
                   operand_batching: Sequence[int]) -> list[tuple[int, int, int | None]]:
    """(indices dim, result/updates dim, paired operand dim or None) per index batch dim.

    The non-window dims of the result (gather) or updates (scatter) map in order onto the dims
    of `indices` other than its last, index-vector dim.
    """
    batch = [d for d in range(len(other)) if d not in window_dims]
    paired = dict(zip(index_batching, operand_batching, strict=True))
    return [(i, o, paired.get(i)) for i, o in zip(range(len(indices) - 1), batch, strict=True)]


def gather_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    dn = info.params["dimension_numbers"]
    (operand, indices), (out,) = info.in_shapes, info.out_shapes
    skipped = (*dn.collapsed_slice_dims, *dn.operand_batching_dims)
    loops = [Loop(operand[d], (d, None), (w,))
             for d, w in _window_pairs(operand, out, dn.offset_dims, skipped, dn.start_index_map)]
    loops += [Loop(indices[i], (od, i), (o,))
              for i, o, od in _batch_triples(indices, out, dn.offset_dims,
                                             dn.start_indices_batching_dims,
                                             dn.operand_batching_dims)]
    rows = [Loop(operand[d], (d, None), (None,), reducible=True)
            for d in _rows(operand, info.params["slice_sizes"], dn.start_index_map)]
    # A masked lookup is reduced with an all-reduce: constrained to be reduce-scattered onto a
    # dim of the result, XLA partitions the gather otherwise and moves several times more.
    return loop_strategies(info, mesh, loops + rows, scatter_dims=() if rows else None)


def _rows(operand: Shape, window: Sequence[int], indexed: Sequence[int]) -> list[int]:
    """The operand dims an index moves one element at a time (an embedding table's
    vocabulary): each device can look up or update the rows it holds, the others masked."""
    return [d for d in dict.fromkeys(indexed) if window[d] == 1 and operand[d] > 1]


def _scatter_loops(info: OpInfo, summable: bool) -> list[Loop]:
    """Loops of a scatter; unpaired index batch dims only when partial results add up."""
    dn = info.params["dimension_numbers"]
    operand, indices, updates = info.in_shapes
    skipped = (*dn.inserted_window_dims, *dn.operand_batching_dims)
    loops = [Loop(operand[d], (d, None, w), (d,))
             for d, w in _window_pairs(operand, updates, dn.update_window_dims, skipped,
                                       dn.scatter_dims_to_operand_dims)]
    for i, u, od in _batch_triples(indices, updates, dn.update_window_dims,
                                   dn.scatter_indices_batching_dims, dn.operand_batching_dims):
        if od is not None:
            loops.append(Loop(indices[i], (od, i, u), (od,)))
        elif summable:
            loops.append(Loop(indices[i], (None, i, u), (None,), reducible=True))
    window = [1 if d in skipped else None for d in range(len(operand))]
    for d, w in zip([d for d in range(len(operand)) if d not in skipped],
                    dn.update_window_dims, strict=True):
        window[d] = updates[w]
    loops += [Loop(operand[d], (d, None, None), (d,))
              for d in _rows(operand, window, dn.scatter_dims_to_operand_dims)]
    return loops


def scatter_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    return loop_strategies(info, mesh, _scatter_loops(info, summable=False))


def scatter_add_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    return loop_strategies(info, mesh, _scatter_loops(info, summable=True))


RULES[lax.dynamic_slice_p] = dynamic_slice_rule
RULES[lax.dynamic_update_slice_p] = dynamic_update_slice_rule
RULES[lax.gather_p] = gather_rule
RULES[lax.scatter_p] = scatter_rule
RULES[lax.scatter_mul_p] = scatter_rule
RULES[lax.scatter_min_p] = scatter_rule
RULES[lax.scatter_max_p] = scatter_rule
RULES[lax.scatter_add_p] = scatter_add_rule
RULES[lax.scatter_sub_p] = scatter_add_rule
