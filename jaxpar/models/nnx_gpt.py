"""The GPT-2 style decoder of `jaxpar.models.gpt` as a Flax `nnx.Module`, with two train steps.

The module holds the same parameters under the same names as the plain model's dict (`wte`,
`wpe`, `blocks[i].ln1/attn/ln2/mlp`, `ln_f`) and computes the same function, so the two can be
checked against each other: `from_params` builds the module from `gpt.init_params` output and
`to_params` gives the dict back. Layer norms are `nnx.LayerNorm` set to the plain model's
epsilon and two-pass variance (flax takes their statistics in at least float32, so with a
half-precision `cfg.dtype` the two models differ by rounding); the rest is written out as in
`gpt.py`.

Two ways to train it:
- `make_train_step(tx)`: the nnx in-place style, `step(model, optimizer, tokens, targets)`
  updates `model` and the `nnx.Optimizer` and returns the loss (wrap it in `nnx.jit`).
- `make_functional_step(cfg, tx)`: a pure function over `nnx.State` pytrees, what a
  pure-function compiler (`jax.jit`, `jaxpar.shard`) consumes.

    cfg = GPTConfig(layers=2, d_model=64, heads=4, vocab=256, seq=16)
    step, init = make_functional_step(cfg, optax.adamw(1e-3))
    graphdef, params, opt_state = init(NNXGPT(cfg, rngs=nnx.Rngs(0)))
    params, opt_state, loss = jax.jit(step)(params, opt_state, tokens, targets)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxpar.models.gpt import GPTConfig, init_params


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape) * std).astype(dtype))


def _zeros(shape: tuple[int, ...], dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


def _layer_norm(cfg: GPTConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    # gpt._layer_norm: epsilon 1e-5, variance as mean((x - mean)^2) rather than E[x^2] - mean^2.
    return nnx.LayerNorm(cfg.d_model, epsilon=1e-5, use_fast_variance=False,
                         param_dtype=cfg.dtype, rngs=rngs)


class _Attention(nnx.Module):
    """Causal softmax self-attention with a fused qkv projection."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d = cfg.d_model
        self.heads = cfg.heads
        self.wqkv = _normal(rngs, (d, 3 * d), 0.02, cfg.dtype)
        self.bqkv = _zeros((3 * d,), cfg.dtype)
        self.wo = _normal(rngs, (d, d), 0.02, cfg.dtype)
        self.bo = _zeros((d,), cfg.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, d = x.shape
        hd = d // self.heads
        q, k, v = jnp.split(x @ self.wqkv[...] + self.bqkv[...], 3, axis=-1)
        q, k, v = (t.reshape(b, s, self.heads, hd) for t in (q, k, v))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / float(np.sqrt(hd))  # weak: keeps the dtype
        causal = jnp.tril(jnp.ones((s, s), bool))
        logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
        att = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)
        return out @ self.wo[...] + self.bo[...]


class _MLP(nnx.Module):
    """d_model -> mlp_ratio * d_model -> d_model with a GELU between."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.mlp_ratio * cfg.d_model
        self.w1 = _normal(rngs, (d, f), 0.02, cfg.dtype)
        self.b1 = _zeros((f,), cfg.dtype)
        self.w2 = _normal(rngs, (f, d), 0.02, cfg.dtype)
        self.b2 = _zeros((d,), cfg.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(x @ self.w1[...] + self.b1[...]) @ self.w2[...] + self.b2[...]


class _Block(nnx.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then + mlp(ln2(.))."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.ln1 = _layer_norm(cfg, rngs)
        self.attn = _Attention(cfg, rngs)
        self.ln2 = _layer_norm(cfg, rngs)
        self.mlp = _MLP(cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _check_config(cfg: GPTConfig) -> None:
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg={cfg!r}: expected a jaxpar.models.gpt.GPTConfig.")
    if cfg.scan_layers:
        raise ValueError(f"GPTConfig(scan_layers={cfg.scan_layers}): NNXGPT keeps its layers "
                         "as a list of blocks; use scan_layers=False.")


class NNXGPT(nnx.Module):
    """GPT-2 style decoder: the function of `gpt.forward` as an nnx module.

    Initialised with the plain model's distributions (normal 0.02, positions 0.01, zero biases,
    unit layer-norm scales) but its own random draws; use `from_params` for identical weights.

    Args:
      cfg: the model shape (`scan_layers` must be False).
      rngs: random streams; `rngs.params()` draws every weight.

    Example:
      model = NNXGPT(GPTConfig(layers=1, d_model=32, heads=2, vocab=64, seq=8), rngs=nnx.Rngs(0))
      logits = model(tokens)  # (batch, seq, vocab)
    """

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        _check_config(cfg)
        self.cfg = cfg
        self.wte = _normal(rngs, (cfg.vocab, cfg.d_model), 0.02, cfg.dtype)
        self.wpe = _normal(rngs, (cfg.seq, cfg.d_model), 0.01, cfg.dtype)
        self.blocks = nnx.List([_Block(cfg, rngs) for _ in range(cfg.layers)])
        self.ln_f = _layer_norm(cfg, rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits (batch, seq, vocab) for int tokens (batch, seq), seq <= cfg.seq."""
        if jnp.ndim(tokens) != 2 or jnp.shape(tokens)[1] > self.cfg.seq:
            raise ValueError(f"tokens: shape {jnp.shape(tokens)}; expected (batch, seq) with "
                             f"seq <= cfg.seq={self.cfg.seq}.")
        x = self.wte[...][tokens] + self.wpe[...][None, : tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte[...].T


def loss(model: NNXGPT, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of `model` (as `gpt.loss_fn`).

    Args:
      model: the decoder.
      tokens, targets: int (batch, seq); targets[b, t] is the token that follows tokens[b, t].

    Returns:
      A float scalar.

    Example:
      value = loss(model, *gpt.batch(model.cfg, 4))
    """
    logp = jax.nn.log_softmax(model(tokens), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0])


def _abstract_model(cfg: GPTConfig) -> NNXGPT:
    return nnx.eval_shape(lambda: NNXGPT(cfg, rngs=nnx.Rngs(0)))


def _leaf_names(leaves: list) -> set[str]:
    return {jax.tree_util.keystr(path) for path, _ in leaves}


def _check_params(cfg: GPTConfig, params: dict) -> None:
    want, want_tree = jax.tree_util.tree_flatten_with_path(
        jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))))
    got, got_tree = jax.tree_util.tree_flatten_with_path(params)
    if got_tree != want_tree:
        raise ValueError(f"params: not the layout of gpt.init_params({cfg}); missing "
                         f"{sorted(_leaf_names(want) - _leaf_names(got))}, unexpected "
                         f"{sorted(_leaf_names(got) - _leaf_names(want))}.")
    for (path, g), (_, w) in zip(got, want, strict=True):
        if (jnp.shape(g), jnp.result_type(g)) != (w.shape, w.dtype):
            raise ValueError(f"params{jax.tree_util.keystr(path)}: shape {jnp.shape(g)} dtype "
                             f"{jnp.result_type(g)}, but {cfg} needs {w.shape} {w.dtype}.")


def from_params(cfg: GPTConfig, params: dict) -> NNXGPT:
    """The NNXGPT holding the plain model's parameters (the arrays themselves, not copies).

    Args:
      cfg: the config the parameters were made for (`scan_layers=False`).
      params: a dict as `gpt.init_params(cfg, key)` returns.

    Returns:
      An NNXGPT whose logits equal `gpt.forward(cfg, params, tokens)`.

    Example:
      model = from_params(cfg, gpt.init_params(cfg, jax.random.key(0)))
    """
    _check_config(cfg)
    _check_params(cfg, params)
    model = _abstract_model(cfg)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params | {"blocks": dict(enumerate(params["blocks"]))})
    nnx.update(model, state)
    return model


def to_params(model: NNXGPT) -> dict:
    """The parameters of `model` as the plain model's dict (`gpt.init_params` layout).

    Example:
      params = to_params(model); logits = gpt.forward(model.cfg, params, tokens)
    """
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return pure | {"blocks": [pure["blocks"][i] for i in range(len(model.blocks))]}


def make_train_step(tx: optax.GradientTransformation) -> Callable:
    """The nnx in-place train step: `step(model, optimizer, tokens, targets) -> loss`.

    `step` takes gradients of `loss` with `nnx.value_and_grad` and applies them with
    `optimizer.update(model, grads)`, so `model` and `optimizer` change in place. It is a plain
    Python function: wrap it in `nnx.jit`.

    Args:
      tx: the optax transformation `optimizer` was built with; the step refuses an optimizer
        built with another one, so a step and an optimizer from different setups do not mix.

    Returns:
      step(model, optimizer, tokens, targets) -> loss (the loss before the update).

    Example:
      tx = optax.adamw(1e-3)
      optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
      step = nnx.jit(make_train_step(tx))
      value = step(model, optimizer, tokens, targets)
    """
    def step(model: NNXGPT, optimizer: nnx.Optimizer, tokens, targets) -> jax.Array:
        if optimizer.tx is not tx:
            raise ValueError(f"optimizer: built with tx={optimizer.tx!r}, but this step was "
                             "made for another tx; build both from the same transformation.")
        value, grads = nnx.value_and_grad(loss)(model, tokens, targets)
        optimizer.update(model, grads)
        return value

    return step


def make_functional_step(cfg: GPTConfig, tx: optax.GradientTransformation
                         ) -> tuple[Callable, Callable]:
    """A pure train step over `nnx.State` pytrees, and the init that splits a model for it.

    `init(model)` splits the model with `nnx.split(model, nnx.Param)`; `step` merges the
    graphdef of `cfg` with the parameter state it is given, so it is a pure function of arrays
    that `jax.jit` or `jaxpar.shard` can trace. Parameter leaves flatten (with
    `jax.tree_util.tree_flatten_with_path`) to keys such as `(DictKey('blocks'), DictKey(0),
    DictKey('attn'), DictKey('wqkv'), GetAttrKey('value'))`, which jaxpar names
    `params/blocks/0/attn/wqkv/value` (layer norms: `params/blocks/0/ln1/scale/value`); the
    optimizer state follows them, e.g. `opt_state/0/mu/blocks/0/attn/wqkv/value` for adam(w).

    Args:
      cfg: the model shape (`scan_layers=False`).
      tx: the optax transformation.

    Returns:
      (step, init):
        step(params_state, opt_state, tokens, targets) -> (params_state, opt_state, loss);
        init(model) -> (graphdef, params_state, opt_state); `nnx.merge(graphdef, params_state)`
        gives the model back.

    Example:
      step, init = make_functional_step(cfg, optax.adamw(1e-3))
      graphdef, params, opt_state = init(NNXGPT(cfg, rngs=nnx.Rngs(0)))
      params, opt_state, value = jax.jit(step)(params, opt_state, tokens, targets)
    """
    _check_config(cfg)
    graphdef = nnx.graphdef(_abstract_model(cfg))

    def init(model: NNXGPT) -> tuple[nnx.GraphDef, nnx.State, optax.OptState]:
        model_graphdef, params = nnx.split(model, nnx.Param)
        if model_graphdef != graphdef:
            raise ValueError(f"model: an NNXGPT for {getattr(model, 'cfg', model)!r}, but this "
                             f"step was made for {cfg}; make the step with the model's config.")
        return model_graphdef, params, tx.init(params)

    def step(params: nnx.State, opt_state, tokens, targets):
        value, grads = jax.value_and_grad(
            lambda p: loss(nnx.merge(graphdef, p), tokens, targets))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, init
