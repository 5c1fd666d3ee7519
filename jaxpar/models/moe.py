"""A top-2 mixture-of-experts layer (GShard style) in plain JAX, with an optax training step.

Tokens come in routing groups, `x` of shape (groups, group_size, d_model). A router picks each
token's two best experts (argmax, then argmax of the rest, as GShard does); every expert takes
at most `capacity` tokens of a group, in token order, first choices before second ones, and a
token over capacity skips that expert. Dispatch and combine are one-hot tensors
(groups, group_size, experts, capacity), so the layer is a handful of einsums:

    expert_in = einsum("gsec,gsd->egcd", dispatch, x)     # tokens to their experts
    expert_out = ffn(expert_in)                           # (experts, groups, capacity, d_model)
    y = einsum("gsec,egcd->gsd", combine, expert_out)     # back, weighted by the gates

Expert weights are stacked on a leading `experts` dimension: w1 (experts, d_model, d_ff),
w2 (experts, d_ff, d_model). The loss is the squared error of `x + moe(x)` against a target plus
GShard's load-balancing term, so a training step has gradients through the gates and experts.

    cfg = MoEConfig(d_model=512, d_ff=2048, experts=8, group_size=256)
    params = init_params(cfg, jax.random.key(0))
    step, opt_state = make_train_step(cfg, params)
    params, opt_state, loss = step(params, opt_state, x, y)
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar.context import is_finite
from jaxpar.models._checks import check_count


@dataclass(frozen=True)
class MoEConfig:
    d_model: int = 256
    d_ff: int = 1024
    experts: int = 8
    group_size: int = 128           # tokens per routing group (GShard's S)
    capacity_factor: float = 1.25   # expert slots per group = factor * 2 * S / experts
    aux_loss_coef: float = 0.01     # weight of the load-balancing loss

    def __post_init__(self):
        for name in ("d_model", "d_ff", "experts", "group_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoEConfig({name}={value!r}): must be a positive int.")
        if self.experts < 2:
            raise ValueError(f"MoEConfig(experts={self.experts}): top-2 routing needs at least "
                             "2 experts.")
        # `capacity` rounds factor * 2 * S / experts up: inf and nan failed there, at trace
        # time, naming no field (OverflowError for inf), and a factor of 0 still gave one slot.
        _check_number("capacity_factor", self.capacity_factor, positive=True)
        _check_number("aux_loss_coef", self.aux_loss_coef, positive=False)

    @property
    def capacity(self) -> int:
        """Slots per expert and group: at least one."""
        return max(1, math.ceil(self.capacity_factor * 2 * self.group_size / self.experts))


def _check_number(name: str, value, positive: bool) -> None:
    if (not isinstance(value, numbers.Real) or isinstance(value, bool) or not is_finite(value)
            or value < 0 or (positive and value == 0)):
        raise ValueError(f"MoEConfig({name}={value!r}): must be a finite number "
                         f"{'> 0' if positive else '>= 0'}, e.g. {getattr(MoEConfig, name)} "
                         "(the default).")


def init_params(cfg: MoEConfig, key) -> dict:
    """{"router": (d, e), "w1": (e, d, f), "b1": (e, f), "w2": (e, f, d), "b2": (e, d)}.

    Example:
      params = init_params(MoEConfig(), jax.random.key(0))
    """
    d, f, e = cfg.d_model, cfg.d_ff, cfg.experts
    k = jax.random.split(key, 3)
    return {"router": jax.random.normal(k[0], (d, e)) * d ** -0.5,
            "w1": jax.random.normal(k[1], (e, d, f)) * d ** -0.5,
            "b1": jnp.zeros((e, f)),
            "w2": jax.random.normal(k[2], (e, f, d)) * f ** -0.5,
            "b2": jnp.zeros((e, d))}


def _slots(mask, offset, capacity: int):
    """Each token's slot in its expert (token order, after `offset` taken slots) and the mask of
    the tokens that fit; mask (g, s, e) one-hot per token, offset (g, e)."""
    position = (jnp.cumsum(mask, axis=1) - 1 + offset[:, None, :]) * mask
    mask = mask * (position < capacity)
    return jnp.sum(position * mask, axis=-1).astype(jnp.int32), mask


def _weights(gate, mask, position, capacity: int):
    """(g, s, e, c): a token's gate at (its expert, its slot); gate/position (g, s)."""
    slot = jax.nn.one_hot(position, capacity)[..., None, :]
    return gate[..., None, None] * mask[..., None] * slot


def route(cfg: MoEConfig, router, x):
    """(dispatch, combine, aux_loss): dispatch/combine (g, s, e, c), aux_loss a scalar.

    Example:
      dispatch, combine, aux = route(cfg, params["router"], x)
    """
    e, c = cfg.experts, cfg.capacity
    gates = jax.nn.softmax(x @ router, axis=-1)                       # (g, s, e)
    mask1 = jax.nn.one_hot(jnp.argmax(gates, axis=-1), e)
    mask2 = jax.nn.one_hot(jnp.argmax(gates * (1 - mask1), axis=-1), e)
    # GShard's balance loss: fraction of first choices times mean gate, per expert.
    aux = jnp.mean(jnp.mean(mask1, axis=1) * jnp.mean(gates, axis=1)) * e * e
    pos1, mask1 = _slots(mask1, jnp.zeros((x.shape[0], e)), c)
    pos2, mask2 = _slots(mask2, jnp.sum(mask1, axis=1), c)
    g1, g2 = jnp.sum(gates * mask1, axis=-1), jnp.sum(gates * mask2, axis=-1)
    denom = jnp.maximum(g1 + g2, jnp.finfo(gates.dtype).eps)
    combine = _weights(g1 / denom, mask1, pos1, c) + _weights(g2 / denom, mask2, pos2, c)
    dispatch = jax.lax.stop_gradient((combine > 0).astype(x.dtype))
    return dispatch, combine, aux


def moe_layer(cfg: MoEConfig, params: dict, x):
    """(y, aux_loss): y (groups, group_size, d_model), the experts' gated outputs.

    Example:
      y, aux = moe_layer(cfg, params, x)
    """
    dispatch, combine, aux = route(cfg, params["router"], x)
    expert_in = jnp.einsum("gsec,gsd->egcd", dispatch, x)
    h = jax.nn.relu(jnp.einsum("egcd,edf->egcf", expert_in, params["w1"])
                    + params["b1"][:, None, None, :])
    out = jnp.einsum("egcf,efd->egcd", h, params["w2"]) + params["b2"][:, None, None, :]
    return jnp.einsum("gsec,egcd->gsd", combine, out), aux


def loss_fn(cfg: MoEConfig, params: dict, x, y):
    """Mean squared error of the residual `x + moe(x)` against y, plus the balance loss."""
    out, aux = moe_layer(cfg, params, x)
    return jnp.mean(jnp.square(x + out - y)) + cfg.aux_loss_coef * aux


def make_train_step(cfg: MoEConfig, params: dict, optimizer: optax.GradientTransformation
                    | None = None):
    """(step, opt_state): step(params, opt_state, x, y) -> (params, opt_state, loss).

    The default optimizer is Adam (lr 1e-3).

    Example:
      step, opt_state = make_train_step(cfg, params)
    """
    opt = optimizer if optimizer is not None else optax.adam(1e-3)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, p, x, y))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, opt.init(params)


def batch(cfg: MoEConfig, groups: int, seed: int = 0):
    """Random (x, y), float32 (groups, group_size, d_model)."""
    check_count("batch", "groups", groups)
    rng = np.random.default_rng(seed)
    shape = (groups, cfg.group_size, cfg.d_model)
    return (jnp.asarray(rng.standard_normal(shape), jnp.float32),
            jnp.asarray(rng.standard_normal(shape), jnp.float32))


def abstract_train_step(cfg: MoEConfig, groups: int, optimizer=None):
    """(step, (params, opt_state, x, y) as ShapeDtypeStructs): plan without memory."""
    check_count("abstract_train_step", "groups", groups)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    opt = optimizer if optimizer is not None else optax.adam(1e-3)
    step, _ = make_train_step(cfg, params, opt)
    x = jax.ShapeDtypeStruct((groups, cfg.group_size, cfg.d_model), jnp.float32)
    return step, (params, jax.eval_shape(opt.init, params), x, x)
