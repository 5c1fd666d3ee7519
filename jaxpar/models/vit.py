"""A Vision Transformer in plain JAX: parameters as a dict, a loss, and an optax training step.

Images (batch, height, width, channels) are cut into patches by a strided convolution (the
patch embedding: one conv with kernel = stride = patch size), get a learned position embedding,
pass through pre-norm encoder blocks (bidirectional softmax attention with a fused qkv
projection, then a GELU MLP), and the mean over patches goes through a linear classifier; the
loss is softmax cross-entropy on int labels.

    cfg = ViTConfig(image=32, patch=4, d_model=128, heads=4, layers=2, classes=10)
    params = init_params(cfg, jax.random.key(0))
    step, opt_state = make_train_step(cfg, params)
    params, opt_state, loss = step(params, opt_state, images, labels)

Block parameters use the GPT's names (ln1, attn/wqkv, attn/bqkv, attn/wo, attn/bo, ln2,
mlp/w1, mlp/b1, mlp/w2, mlp/b2), so layouts written for one fit the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar.models._checks import check_count


@dataclass(frozen=True)
class ViTConfig:
    image: int = 32        # height and width of the square input images
    patch: int = 4         # patch height and width; image must be a multiple of it
    channels: int = 3
    d_model: int = 128
    heads: int = 4
    layers: int = 2
    mlp_ratio: int = 4
    classes: int = 10

    def __post_init__(self):
        for name in ("image", "patch", "channels", "d_model", "heads", "layers", "mlp_ratio",
                     "classes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ViTConfig({name}={value!r}): must be a positive int.")
        if self.image % self.patch:
            raise ValueError(f"ViTConfig(image={self.image}, patch={self.patch}): image must be "
                             "a multiple of patch.")
        if self.d_model % self.heads:
            raise ValueError(f"ViTConfig(d_model={self.d_model}, heads={self.heads}): d_model "
                             "must be a multiple of heads.")

    @property
    def patches(self) -> int:
        return (self.image // self.patch) ** 2


def _norm_params(d: int) -> dict:
    return {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))}


def _block_params(cfg: ViTConfig, key) -> dict:
    d, f = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    k = jax.random.split(key, 4)
    return {"ln1": _norm_params(d),
            "attn": {"wqkv": jax.random.normal(k[0], (d, 3 * d)) * d ** -0.5,
                     "bqkv": jnp.zeros((3 * d,)),
                     "wo": jax.random.normal(k[1], (d, d)) * d ** -0.5, "bo": jnp.zeros((d,))},
            "ln2": _norm_params(d),
            "mlp": {"w1": jax.random.normal(k[2], (d, f)) * d ** -0.5, "b1": jnp.zeros((f,)),
                    "w2": jax.random.normal(k[3], (f, d)) * f ** -0.5, "b2": jnp.zeros((d,))}}


def init_params(cfg: ViTConfig, key) -> dict:
    """Parameters: patch (conv kernel HWIO and bias), pos, blocks (a list), ln_f, head.

    Example:
      params = init_params(ViTConfig(), jax.random.key(0))
    """
    p, c, d = cfg.patch, cfg.channels, cfg.d_model
    keys = jax.random.split(key, cfg.layers + 3)
    return {"patch": {"kernel": jax.random.normal(keys[0], (p, p, c, d)) * (p * p * c) ** -0.5,
                      "bias": jnp.zeros((d,))},
            "pos": jax.random.normal(keys[1], (cfg.patches, d)) * 0.02,
            "blocks": [_block_params(cfg, keys[3 + i]) for i in range(cfg.layers)],
            "ln_f": _norm_params(d),
            "head": {"w": jax.random.normal(keys[2], (d, cfg.classes)) * d ** -0.5,
                     "b": jnp.zeros((cfg.classes,))}}


def _layer_norm(x, p):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _block(cfg: ViTConfig, x, p):
    b, n, d = x.shape
    h, hd = cfg.heads, d // cfg.heads
    y = _layer_norm(x, p["ln1"])
    q, k, v = jnp.split(y @ p["attn"]["wqkv"] + p["attn"]["bqkv"], 3, axis=-1)
    q, k, v = (t.reshape(b, n, h, hd) for t in (q, k, v))
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.float32(np.sqrt(hd)), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, n, d)
    x = x + out @ p["attn"]["wo"] + p["attn"]["bo"]
    y = jax.nn.gelu(_layer_norm(x, p["ln2"]) @ p["mlp"]["w1"] + p["mlp"]["b1"])
    return x + y @ p["mlp"]["w2"] + p["mlp"]["b2"]


def forward(cfg: ViTConfig, params: dict, images):
    """Logits (batch, classes) for float images (batch, image, image, channels).

    Example:
      logits = forward(cfg, params, jnp.zeros((2, 32, 32, 3)))
    """
    x = jax.lax.conv_general_dilated(images, params["patch"]["kernel"], (cfg.patch, cfg.patch),
                                     "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    x = x.reshape(x.shape[0], cfg.patches, cfg.d_model) + params["patch"]["bias"]
    x = x + params["pos"][None]
    for p in params["blocks"]:
        x = _block(cfg, x, p)
    x = jnp.mean(_layer_norm(x, params["ln_f"]), axis=1)
    return x @ params["head"]["w"] + params["head"]["b"]


def loss_fn(cfg: ViTConfig, params: dict, images, labels):
    """Mean softmax cross-entropy against int labels (batch,)."""
    logp = jax.nn.log_softmax(forward(cfg, params, images), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def make_train_step(cfg: ViTConfig, params: dict, optimizer: optax.GradientTransformation
                    | None = None):
    """(step, opt_state): step(params, opt_state, images, labels) -> (params, opt_state, loss).

    The default optimizer is Adam (lr 1e-3).

    Example:
      step, opt_state = make_train_step(cfg, params)
    """
    opt = optimizer if optimizer is not None else optax.adam(1e-3)

    def step(params, opt_state, images, labels):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, p, images, labels))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, opt.init(params)


def batch(cfg: ViTConfig, batch_size: int, seed: int = 0):
    """Random (images float32 (batch, image, image, channels), labels int32 (batch,))."""
    check_count("batch", "batch_size", batch_size)
    rng = np.random.default_rng(seed)
    images = rng.standard_normal((batch_size, cfg.image, cfg.image, cfg.channels))
    labels = rng.integers(0, cfg.classes, (batch_size,), dtype=np.int32)
    return jnp.asarray(images, jnp.float32), jnp.asarray(labels)


def abstract_train_step(cfg: ViTConfig, batch_size: int, optimizer=None):
    """(step, (params, opt_state, images, labels) as ShapeDtypeStructs): plan without memory."""
    check_count("abstract_train_step", "batch_size", batch_size)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    opt = optimizer if optimizer is not None else optax.adam(1e-3)
    step, _ = make_train_step(cfg, params, opt)
    images = jax.ShapeDtypeStruct((batch_size, cfg.image, cfg.image, cfg.channels), jnp.float32)
    labels = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
    return step, (params, jax.eval_shape(opt.init, params), images, labels)
