"""A multi-layer perceptron two ways: plain functions over a list of layers, and an nnx module.

Alpa's MLP test cases (layers with bias, squared loss, one SGD step) are built from the plain
functions: `make_sgd_step(0.1, activation=None)` is the linear-layer step the planner tests use,
and it takes their `[(w, b), ...]` parameter lists as well as `init_mlp`'s `[{"w", "b"}, ...]`.

    params = init_mlp(jax.random.key(0), [32, 64, 64, 10])
    step = make_sgd_step(0.1)
    params, loss = step(params, x, y)

`NNXMLP` computes the same function with `nnx.Linear` layers; `mlp_params` reads its weights
back as the plain list.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxpar.context import is_finite
from jaxpar.models._checks import check_flag

Activation = Callable[[jax.Array], jax.Array] | None


def _check_sizes(owner: str, sizes) -> list[int]:
    ok = isinstance(sizes, Sequence) and len(sizes) >= 2 and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes)
    if not ok:
        raise ValueError(f"{owner}(sizes={sizes!r}): needs a list of at least two positive ints, "
                         "input width first and output width last, e.g. [32, 64, 10].")
    return list(sizes)


def _check_lr(lr) -> None:
    # inf passed `lr > 0` and turned every parameter into inf/nan after one step.
    if not isinstance(lr, numbers.Real) or isinstance(lr, bool) or not lr > 0 or not is_finite(lr):
        raise ValueError(f"lr={lr!r}: the learning rate must be a finite positive number, "
                         "e.g. 0.1.")


def init_mlp(key: jax.Array, sizes: Sequence[int], bias: bool = True) -> list[dict]:
    """Layer parameters `[{"w": (n_in, n_out), "b": (n_out,)}, ...]` for widths `sizes`.

    Weights are normal with std 1/sqrt(n_in), biases zero; `bias=False` leaves out "b".

    Args:
      key: a jax random key.
      sizes: widths, input first and output last (`len(sizes) - 1` layers).
      bias: whether layers have a bias.

    Returns:
      A list with one dict per layer.

    Example:
      params = init_mlp(jax.random.key(0), [32] * 7)  # Alpa's 6 layers of 32 with bias
    """
    sizes = _check_sizes("init_mlp", sizes)
    check_flag("init_mlp", "bias", bias)
    keys = jax.random.split(key, len(sizes) - 1)
    layers = []
    for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:], strict=True):
        layer = {"w": jax.random.normal(k, (n_in, n_out)) * n_in ** -0.5}
        if bias:
            layer["b"] = jnp.zeros((n_out,))
        layers.append(layer)
    return layers


def _unpack(layer) -> tuple[jax.Array, jax.Array | None]:
    if isinstance(layer, Mapping):
        return layer["w"], layer.get("b")
    w, *rest = layer
    return w, (rest[0] if rest else None)


def mlp_forward(params: Sequence, x: jax.Array, activation: Activation = jax.nn.relu
                ) -> jax.Array:
    """x through every layer, `activation` between layers (not after the last).

    Args:
      params: one entry per layer: `{"w", "b"}` (as `init_mlp` makes, "b" optional) or a
        `(w, b)` / `(w,)` tuple.
      x: (batch, sizes[0]).
      activation: the nonlinearity (default relu); None for linear layers.

    Returns:
      (batch, sizes[-1]).

    Example:
      y = mlp_forward(init_mlp(jax.random.key(0), [4, 8, 2]), jnp.ones((3, 4)))
    """
    for i, layer in enumerate(params):
        w, b = _unpack(layer)
        x = x @ w if b is None else x @ w + b
        if activation is not None and i < len(params) - 1:
            x = activation(x)
    return x


def mlp_loss(params: Sequence, x: jax.Array, y: jax.Array,
             activation: Activation = jax.nn.relu) -> jax.Array:
    """Mean squared error of `mlp_forward(params, x)` against y.

    Example:
      value = mlp_loss(params, x, y)
    """
    return jnp.mean((mlp_forward(params, x, activation) - y) ** 2)


def make_sgd_step(lr: float, activation: Activation = jax.nn.relu) -> Callable:
    """One step of plain SGD on `mlp_loss`: `step(params, x, y) -> (params, loss)`.

    Args:
      lr: the learning rate, > 0.
      activation: as in `mlp_forward`; None gives Alpa's linear-layer test step.

    Returns:
      step(params, x, y) -> (new params, loss before the step); params keep their structure.

    Example:
      params, value = jax.jit(make_sgd_step(0.1))(params, x, y)
    """
    _check_lr(lr)

    def step(params, x, y):
        value, grads = jax.value_and_grad(mlp_loss)(params, x, y, activation)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), value

    return step


def make_train_step(tx: optax.GradientTransformation, activation: Activation = jax.nn.relu
                    ) -> Callable:
    """One optax step on `mlp_loss`: `step(params, opt_state, x, y) -> (params, opt_state, loss)`.

    Args:
      tx: the optax transformation; `tx.init(params)` makes the first opt_state.
      activation: as in `mlp_forward`.

    Example:
      tx = optax.adam(1e-3)
      step = jax.jit(make_train_step(tx))
      params, opt_state, value = step(params, tx.init(params), x, y)
    """
    def step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(mlp_loss)(params, x, y, activation)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


class NNXMLP(nnx.Module):
    """The MLP of `mlp_forward` as an nnx module of `nnx.Linear` layers.

    Args:
      sizes: widths, input first and output last; at least two positive ints.
      bias: whether layers have a bias.
      activation: the nonlinearity between layers (default relu); None for linear layers.
      rngs: random streams for the weights (nnx.Linear's default initialisers).

    Example:
      model = NNXMLP([32, 64, 10], rngs=nnx.Rngs(0))
      y = model(jnp.ones((4, 32)))
    """

    def __init__(self, sizes: Sequence[int], *, bias: bool = True,
                 activation: Activation = jax.nn.relu, rngs: nnx.Rngs):
        sizes = _check_sizes("NNXMLP", sizes)
        check_flag("NNXMLP", "bias", bias)
        self.activation = activation
        self.layers = nnx.List([nnx.Linear(n_in, n_out, use_bias=bias, rngs=rngs)
                                for n_in, n_out in zip(sizes[:-1], sizes[1:], strict=True)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if self.activation is not None and i < len(self.layers) - 1:
                x = self.activation(x)
        return x


def mlp_params(model: NNXMLP) -> list[dict]:
    """The weights of `model` as `init_mlp`'s list of `{"w", "b"}` dicts.

    Example:
      y = mlp_forward(mlp_params(model), x)  # equals model(x)
    """
    return [{"w": layer.kernel[...]} | ({"b": layer.bias[...]} if layer.bias is not None else {})
            for layer in model.layers]
