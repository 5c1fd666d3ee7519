"""Elementwise ops: every dimension of the result is a loop shared by the operands.

Rank-0 operands (scalar literals such as the 0.0 in `max x 0.0`) stay replicated, and so does a
size-1 operand dimension that the op broadcasts (`add f32[32,10] f32[1,10]`).
"""

from __future__ import annotations

from jax import lax
from jax._src import ad_util
from jax._src.lax import lax as lax_internal

from jaxpar.rules.registry import LOCAL, RULES, Loop, OpInfo, loop_strategies
from jaxpar.spec import MeshInfo, OpStrategy


def elementwise_rule(info: OpInfo, mesh: MeshInfo) -> list[OpStrategy]:
    shape = info.out_shapes[0]
    def indexes(s: tuple[int, ...], d: int) -> bool:
        return len(s) == len(shape) and s[d] == shape[d]

    loops = [Loop(n, tuple(d if indexes(s, d) else None for s in info.in_shapes),
                  tuple(d for _ in info.out_shapes))
             for d, n in enumerate(shape)]
    return loop_strategies(info, mesh, loops)


_NAMES = """
abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp complex conj
convert_element_type copy cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge
gt imag integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg
nextafter not or population_count pow real reduce_precision rem round rsqrt select_n
shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square stop_gradient
sub tan tanh xor clz one_minus_square log2
eq_to le_to lt_to mulhi bessel_i0e bessel_i1e polygamma zeta
"""

# XLA computes these in a while loop that runs until every element has converged: cut by the
# partitioner, each turn all-reduces the devices' "not done" flags. Bound per shard instead
# (registry.LOCAL), each device loops until its own elements converge; an element's value does
# not depend on how many more turns the others take (checked equal to jax.jit).
_LOOPED = "igamma igammac igamma_grad_a"


def _primitive(name: str):
    # lax exports most primitives; some (one_minus_square, jax 0.11's tanh derivative) only
    # live in jax._src.lax.lax
    return getattr(lax, f"{name}_p", None) or getattr(lax_internal, f"{name}_p", None)


def _register() -> None:
    looped = _LOOPED.split()
    for name in _NAMES.split() + looped:
        prim = _primitive(name)
        if prim is not None:
            RULES[prim] = elementwise_rule
            if name in looped:
                LOCAL.add(prim)
    RULES[ad_util.add_jaxvals_p] = elementwise_rule  # `add_any`: AD's cotangent accumulation


_register()
