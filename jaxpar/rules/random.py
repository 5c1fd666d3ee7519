"""Random numbers: key arrays map batch dims; new dims of bits and split keys are cut freely.

A key array `key<impl>[...]` is a batch of keys whose data (`u32[..., 2]` for threefry) lives in
a hidden trailing dim: random_wrap / random_unwrap, random_seed, random_fold_in and random_clone
act key by key, so the batch dims are loops and the key-data dim is never cut. random_bits and
random_split append new dims (`shape`) to the batch dims. With the threefry2x32 impl and
`jax_threefry_partitionable` (the default), each output element hashes its own flat index
(`iota_2x32_shape`), so a device computes its block of the new dims from the replicated key with
no communication and the same bits as unsharded; for other impls (rbg) or the old
non-partitionable threefry only the batch dims are loops.
"""

from __future__ import annotations

import jax
from jax._src.random import core as random_core
from jax._src.random import prng
from jax.extend import random as jex_random

from jaxpar.rules.elementwise import elementwise_rule
from jaxpar.rules.registry import RULES, Loop, OpInfo, loop_strategies
from jaxpar.spec import MeshInfo, OpStrategy


def _batch_loops(info: OpInfo, rank: int) -> list[Loop]:
    """One loop per leading (key batch) dim shared by the first operand and every result."""
    return [Loop(info.out_shapes[0][d], (d,) + (None,) * (len(info.in_shapes) - 1),
                 (d,) * len(info.out_shapes))
            for d in range(rank)]


def _partitionable(key_dtype) -> bool:
    impl = getattr(key_dtype, "_impl", None)
    return (impl is not None and impl.name == "threefry2x32"
            and bool(jax.threefry_partitionable.value))


def key_batch_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """random_wrap, random_unwrap, random_seed: the batch dims are those of the key array."""
    rank = min(len(info.in_shapes[0]), len(info.out_shapes[0]))
    return loop_strategies(info, mesh, _batch_loops(info, rank))


def new_dims_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """random_bits, random_split: key batch dims, then `shape` dims that only the result has."""
    rank = len(info.in_shapes[0])
    loops = _batch_loops(info, rank)
    if info.in_dtypes and _partitionable(info.in_dtypes[0]):
        out = info.out_shapes[0]
        loops += [Loop(out[d], (None,), (d,)) for d in range(rank, len(out))]
    return loop_strategies(info, mesh, loops)


def iota_2x32_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    """iota_2x32_shape: no operands; the two count arrays are cut alike."""
    loops = [Loop(n, (), (d, d)) for d, n in enumerate(info.out_shapes[0])]
    return loop_strategies(info, mesh, loops)


RULES[prng.random_wrap_p] = key_batch_rule
RULES[prng.random_unwrap_p] = key_batch_rule
RULES[prng.random_seed_p] = key_batch_rule
RULES[prng.random_bits_p] = new_dims_rule
RULES[prng.random_split_p] = new_dims_rule
RULES[prng.random_fold_in_p] = elementwise_rule
RULES[random_core.random_clone_p] = elementwise_rule
RULES[prng.iota_2x32_shape_p] = iota_2x32_rule
RULES[jex_random.threefry2x32_p] = elementwise_rule
