"""A GPT-2 style decoder in plain JAX: parameters as a dict, a loss, and an optax training step.

Used by the search benchmarks and the acceptance tests: it is small enough to trace in well under
a second yet has every op a transformer planner must get right (embedding gather, layer norm,
fused qkv projection, causal softmax attention, MLP, tied output projection, cross-entropy).

    cfg = GPTConfig(layers=2, d_model=1024, heads=16, vocab=8192, seq=512)
    params = init_params(cfg, jax.random.key(0))
    step, opt_state = make_train_step(cfg, params)
    params, opt_state, loss = step(params, opt_state, tokens, targets)

Layers are a Python list (one traced copy per layer) by default; `scan_layers=True` stacks them
and runs the stack with `jax.lax.scan`, so the jaxpr holds one layer body.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar.models._checks import MODEL_DTYPES, check_count, check_flag


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 2
    d_model: int = 256
    heads: int = 4
    vocab: int = 1024
    seq: int = 128
    mlp_ratio: int = 4
    scan_layers: bool = False
    dtype: jnp.dtype = jnp.float32

    def __post_init__(self):
        for name in ("layers", "d_model", "heads", "vocab", "seq", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig({name}={value!r}): must be a positive int.")
        if self.d_model % self.heads:
            raise ValueError(f"GPTConfig(d_model={self.d_model}, heads={self.heads}): d_model "
                             "must be a multiple of heads.")
        check_flag("GPTConfig", "scan_layers", self.scan_layers)
        if _dtype_name(self.dtype) not in MODEL_DTYPES:  # as a run config's model.dtype
            raise ValueError(f"GPTConfig(dtype={self.dtype!r}): the parameters and activations "
                             f"need one of {list(MODEL_DTYPES)}, e.g. jnp.bfloat16.")


def _dtype_name(dtype) -> str | None:
    """The name of jnp.dtype(dtype); None for what is not a dtype (None itself reads float64)."""
    if dtype is None:
        return None
    try:
        return jnp.dtype(dtype).name
    except (TypeError, ValueError):
        return None


def _layer_params(cfg: GPTConfig, key) -> dict:
    d, f = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    k = jax.random.split(key, 4)
    std = 0.02

    def normal(key, shape):
        return (jax.random.normal(key, shape) * std).astype(cfg.dtype)

    return {
        "ln1": {"scale": jnp.ones((d,), cfg.dtype), "bias": jnp.zeros((d,), cfg.dtype)},
        "attn": {"wqkv": normal(k[0], (d, 3 * d)), "bqkv": jnp.zeros((3 * d,), cfg.dtype),
                 "wo": normal(k[1], (d, d)), "bo": jnp.zeros((d,), cfg.dtype)},
        "ln2": {"scale": jnp.ones((d,), cfg.dtype), "bias": jnp.zeros((d,), cfg.dtype)},
        "mlp": {"w1": normal(k[2], (d, f)), "b1": jnp.zeros((f,), cfg.dtype),
                "w2": normal(k[3], (f, d)), "b2": jnp.zeros((d,), cfg.dtype)},
    }


def init_params(cfg: GPTConfig, key) -> dict:
    """Parameters as nested dicts: wte, wpe, blocks (a list, or one stacked dict), ln_f."""
    keys = jax.random.split(key, cfg.layers + 2)
    blocks = [_layer_params(cfg, keys[2 + i]) for i in range(cfg.layers)]
    if cfg.scan_layers:
        blocks = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
    return {
        "wte": (jax.random.normal(keys[0], (cfg.vocab, cfg.d_model)) * 0.02).astype(cfg.dtype),
        "wpe": (jax.random.normal(keys[1], (cfg.seq, cfg.d_model)) * 0.01).astype(cfg.dtype),
        "blocks": blocks,
        "ln_f": {"scale": jnp.ones((cfg.d_model,), cfg.dtype),
                 "bias": jnp.zeros((cfg.d_model,), cfg.dtype)},
    }


def _layer_norm(x, p):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _block(cfg: GPTConfig, x, p):
    b, s, d = x.shape
    h, hd = cfg.heads, d // cfg.heads
    y = _layer_norm(x, p["ln1"])
    q, k, v = jnp.split(y @ p["attn"]["wqkv"] + p["attn"]["bqkv"], 3, axis=-1)
    q, k, v = (t.reshape(b, s, h, hd) for t in (q, k, v))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / float(np.sqrt(hd))  # weak: keeps the dtype
    causal = jnp.tril(jnp.ones((s, s), bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    att = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)
    x = x + out @ p["attn"]["wo"] + p["attn"]["bo"]
    y = _layer_norm(x, p["ln2"])
    y = jax.nn.gelu(y @ p["mlp"]["w1"] + p["mlp"]["b1"])
    return x + y @ p["mlp"]["w2"] + p["mlp"]["b2"]


def forward(cfg: GPTConfig, params: dict, tokens):
    """Logits (batch, seq, vocab) for int32 tokens (batch, seq)."""
    x = params["wte"][tokens] + params["wpe"][None, : tokens.shape[1]]
    if cfg.scan_layers:
        x, _ = jax.lax.scan(lambda x, p: (_block(cfg, x, p), None), x, params["blocks"])
    else:
        for p in params["blocks"]:
            x = _block(cfg, x, p)
    x = _layer_norm(x, params["ln_f"])
    return x @ params["wte"].T


def loss_fn(cfg: GPTConfig, params: dict, tokens, targets):
    """Mean next-token cross-entropy."""
    logits = forward(cfg, params, tokens)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)


def make_train_step(cfg: GPTConfig, params: dict, optimizer: optax.GradientTransformation
                    | None = None):
    """(step, opt_state): step(params, opt_state, tokens, targets) -> (params, opt_state, loss).

    The default optimizer is Adam (lr 1e-3), so the step carries two moments per parameter.
    """
    opt = optimizer if optimizer is not None else optax.adam(1e-3)
    return _step(cfg, opt), opt.init(params)


def _step(cfg: GPTConfig, opt: optax.GradientTransformation):
    """The training step of make_train_step, without its optimizer state."""

    def step(params, opt_state, tokens, targets):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, p, tokens, targets))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def batch(cfg: GPTConfig, batch_size: int, seed: int = 0):
    """Random (tokens, targets), int32 (batch_size, seq)."""
    check_count("batch", "batch_size", batch_size)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab, (batch_size, cfg.seq), dtype=np.int32)
    return jnp.asarray(tokens), jnp.asarray(np.roll(tokens, -1, axis=1))


def abstract_train_step(cfg: GPTConfig, batch_size: int, optimizer=None):
    """(step, (params, opt_state, tokens, targets) as ShapeDtypeStructs): plan without memory."""
    check_count("abstract_train_step", "batch_size", batch_size)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    opt = optimizer if optimizer is not None else optax.adam(1e-3)
    opt_state = jax.eval_shape(opt.init, params)  # (opt.init on the structs made real zeros)
    step = _step(cfg, opt)
    tok = jax.ShapeDtypeStruct((batch_size, cfg.seq), jnp.int32)
    return step, (params, opt_state, tok, tok)
