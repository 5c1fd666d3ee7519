"""Small real programs (forward passes, a training step): each returns (fn, args, in_strategy)."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np


def _arr(rng, *shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def attention():
    rng = np.random.default_rng(1)
    b, s, d, h = 8, 16, 64, 4

    def fn(x, wqkv, wo):
        q, k, v = jnp.split(x @ wqkv, 3, axis=-1)
        def split(t):
            return t.reshape(b, s, h, d // h).transpose(0, 2, 1, 3)

        q, k, v = split(q), split(k), split(v)
        att = jax.nn.softmax(q @ k.transpose(0, 1, 3, 2) / (d // h) ** 0.5, axis=-1)
        out = (att @ v).transpose(0, 2, 1, 3).reshape(b, s, d)
        return out @ wo

    args = (_arr(rng, b, s, d), _arr(rng, d, 3 * d, scale=0.1), _arr(rng, d, d, scale=0.1))
    return fn, args, ((8, 1, 1), None, None)


def attention_tensor_parallel():
    fn, args, _ = attention()
    return fn, args, ((1, 1, 1), (1, 8), (8, 1))  # Megatron: qkv by columns, output by rows


def conv_net_feature_parallel():
    fn, args, _ = conv_net()
    return fn, args, ((2, 1, 1, 1), (1, 1, 1, 4), None, None)  # first conv's filters cut


def moe_top2():
    rng = np.random.default_rng(2)
    t, d, f, e = 32, 16, 32, 8

    def fn(x, wr, w1, w2):
        gates = jax.nn.softmax(x @ wr, axis=-1)
        top, idx = jax.lax.top_k(gates, 2)
        mask = jnp.sum(jax.nn.one_hot(idx, e) * top[..., None], axis=1)       # (t, e)
        hidden = jax.nn.relu(jnp.einsum("td,edf->tef", x, w1))
        out = jnp.einsum("tef,efd->ted", hidden, w2)
        return jnp.einsum("ted,te->td", out, mask)

    args = (_arr(rng, t, d), _arr(rng, d, e), _arr(rng, e, d, f, scale=0.2),
            _arr(rng, e, f, d, scale=0.2))
    return fn, args, (None, None, (8, 1, 1), (8, 1, 1))


def conv_net():
    rng = np.random.default_rng(3)

    def fn(x, k1, k2, w):
        dn = ("NHWC", "HWIO", "NHWC")
        y = jax.nn.relu(jax.lax.conv_general_dilated(x, k1, (1, 1), "SAME", dimension_numbers=dn))
        y = jax.lax.reduce_window(y, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4
        y = jax.nn.relu(jax.lax.conv_general_dilated(y, k2, (1, 1), "SAME", dimension_numbers=dn))
        y = jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return y.reshape(y.shape[0], -1) @ w

    args = (_arr(rng, 8, 8, 8, 4), _arr(rng, 3, 3, 4, 8, scale=0.3),
            _arr(rng, 3, 3, 8, 8, scale=0.2), _arr(rng, 32, 10, scale=0.2))
    return fn, args, ((8, 1, 1, 1), None, None, None)


def scan_layers():
    rng = np.random.default_rng(4)

    def fn(x, ws):
        def layer(h, w):
            return jnp.tanh(h @ w), jnp.sum(h)
        return jax.lax.scan(layer, x, ws)

    return fn, (_arr(rng, 32, 64), _arr(rng, 4, 64, 64, scale=0.1)), ((8, 1), None)


def cond_and_fori():
    rng = np.random.default_rng(5)

    def fn(x, w):
        y = jax.lax.cond(jnp.sum(x) > 0, lambda a: a @ w, lambda a: a @ w * 2.0, x)
        return jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w.T @ w), y)

    return fn, (_arr(rng, 32, 16), _arr(rng, 16, 16, scale=0.3)), ((8, 1), None)


def while_loop():
    rng = np.random.default_rng(6)

    def fn(x, n):
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 0.5 + 1.0),
                                  (0, x))[1]

    return fn, (_arr(rng, 16, 8), jnp.int32(3)), ((8, 1), None)


def embedding_xent():
    rng = np.random.default_rng(7)
    b, s, v, d = 4, 8, 32, 16

    def fn(table, ids, labels):
        h = table[ids]                                   # (b, s, d) gather
        logits = h @ table.T                              # tied output embedding
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

    ids = jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32)
    labels = jnp.asarray(rng.integers(0, v, (b, s)), jnp.int32)
    return fn, (_arr(rng, v, d), ids, labels), (None, (4, 2), (4, 2))


def mlp_train_step():
    rng = np.random.default_rng(8)

    def loss(params, x, y):
        h = x
        for w, b in params[:-1]:
            h = jax.nn.gelu(h @ w + b)
        w, b = params[-1]
        return jnp.mean((h @ w + b - y) ** 2)

    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), value

    dims = [32, 64, 64, 8]
    params = [(_arr(rng, a, c, scale=a ** -0.5), _arr(rng, c, scale=0.1))
              for a, c in itertools.pairwise(dims)]
    return step, (params, _arr(rng, 64, 32), _arr(rng, 64, 8)), (None, (8, 1), (8, 1))


PROGRAMS = {f.__name__: f for f in (attention, attention_tensor_parallel, moe_top2, conv_net,
                                     conv_net_feature_parallel, scan_layers, cond_and_fori,
                                     while_loop, embedding_xent, mlp_train_step)}

# Programs whose plans must communicate (so the byte check compares real traffic).
COMMUNICATING = {"attention_tensor_parallel", "moe_top2", "conv_net_feature_parallel",
                 "scan_layers", "cond_and_fori", "embedding_xent", "mlp_train_step"}
