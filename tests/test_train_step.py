"""make_train_step / accumulate_gradients: accumulation equals the full batch, gradients_mean,
microbatch layouts, aux outputs, and argument errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.train.step import accumulate_gradients, make_train_step, split_microbatches

B, D_IN, D_HID, D_OUT = 32, 16, 32, 4


def mlp_params(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return {"w1": jnp.asarray(rng.standard_normal((D_IN, D_HID)) * 0.3, dtype),
            "b1": jnp.zeros((D_HID,), dtype),
            "w2": jnp.asarray(rng.standard_normal((D_HID, D_OUT)) * 0.3, dtype)}


def batch():
    rng = np.random.default_rng(1)
    return (jnp.asarray(rng.standard_normal((B, D_IN)), jnp.float32),
            jnp.asarray(rng.standard_normal((B, D_OUT)), jnp.float32))


def mse(params, x, y):
    h = jax.nn.relu(x @ params["w1"].astype(x.dtype) + params["b1"].astype(x.dtype))
    return jnp.mean((h @ params["w2"].astype(x.dtype) - y) ** 2)


def mse_aux(params, x, y):
    loss = mse(params, x, y)
    return loss, {"mae": jnp.mean(jnp.abs(x[:, :D_OUT] - y)), "first": x[0, 0]}


def run_steps(step, params, opt, xy, n=2):
    """n steps through `step`, so adamw's moments matter in the second one."""
    state, losses = opt.init(params), []
    for _ in range(n):
        params, state, loss = step(params, state, *xy)
        losses.append(loss)
    return params, losses


def assert_tree_close(a, b, rtol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=rtol * 1e-2)


@pytest.fixture(scope="module")
def full_batch_result():
    opt = optax.adamw(1e-2)
    return run_steps(jax.jit(make_train_step(mse, opt)), mlp_params(), opt, batch())


@pytest.mark.parametrize("k", [1, 2, 4])
def test_accumulation_equals_full_batch_under_jit(k, full_batch_result):
    opt = optax.adamw(1e-2)
    params, losses = run_steps(jax.jit(make_train_step(mse, opt, grad_accumulation_step=k)),
                               mlp_params(), opt, batch())
    ref_params, ref_losses = full_batch_result
    assert_tree_close(params, ref_params, 1e-5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[1] < losses[0]


def test_accumulation_under_jaxpar_shard_matches_jit(full_batch_result):
    opt = optax.adamw(1e-2)
    step = jaxpar.shard(make_train_step(mse, opt, grad_accumulation_step=4),
                        search_mode="sharding_propagation")
    params, losses = run_steps(step, mlp_params(), opt, batch())
    ref_params, ref_losses = full_batch_result
    assert_tree_close(params, ref_params, 1e-4)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert all(isinstance(p.sharding, NamedSharding) for p in jax.tree.leaves(params))


def test_microbatch_layouts():
    x = jnp.arange(12).reshape(6, 2)
    np.testing.assert_array_equal(split_microbatches(x, 2)[1], x[1::2])
    np.testing.assert_array_equal(split_microbatches(x, 2, "contiguous")[1], x[3:])
    assert split_microbatches({"a": x}, 3)["a"].shape == (3, 2, 2)
    with pytest.raises(ValueError, match="layout='rows' must be one of"):
        split_microbatches(x, 2, "rows")
    # k and the leaves are checked before any reshape (which failed deep in JAX, or divided
    # by zero, naming neither)
    for k, error, said in ((0, ValueError, "k=0 must be >= 1"), (-2, ValueError, "k=-2 must"),
                           (2.0, TypeError, "k=2.0 must be an int"),
                           (4, ValueError, r"tree\['a'\] of shape \(6, 2\) has leading dim 6, "
                                           "which does not divide by k=4")):
        with pytest.raises(error, match=said):
            split_microbatches({"a": x}, k)
    with pytest.raises(ValueError, match=r"tree\[1\] of shape \(\) is a scalar"):
        split_microbatches((x, jnp.float32(1.0)), 2)


def test_strided_and_contiguous_layouts_give_the_same_update():
    opt = optax.adamw(1e-2)
    out = {lay: run_steps(jax.jit(make_train_step(mse, opt, grad_accumulation_step=4,
                                                  microbatch_layout=lay)),
                          mlp_params(), opt, batch())
           for lay in ("strided", "contiguous")}
    assert_tree_close(out["strided"], out["contiguous"], 1e-5)


def test_strided_microbatches_stay_on_the_batch_shards():
    """The reason for the strided layout: with the batch sharded over 8 devices, taking a
    microbatch moves no data, while contiguous microbatches must be gathered."""
    mesh = jaxpar.make_mesh(8)
    rows = NamedSharding(mesh, P(("d0", "d1", "d2")))
    xy = tuple(jax.device_put(a, rows) for a in batch())
    opt, params = optax.sgd(0.1), mlp_params()
    stats = {}
    for lay in ("strided", "contiguous"):
        step = make_train_step(mse, opt, grad_accumulation_step=4, microbatch_layout=lay)
        stats[lay] = jaxpar.collective_stats(
            jax.jit(step).lower(params, opt.init(params), *xy).compile())
    assert "all-gather" not in stats["strided"] and "all-to-all" not in stats["strided"]
    assert set(stats["contiguous"]) - {"all-reduce"}


@pytest.mark.parametrize("k", [1, 4])
def test_gradients_mean_false_scales_by_data_parallel(k):
    lr, dp, params, xy = 0.01, 8, mlp_params(), batch()
    opt = optax.sgd(lr)
    step = jax.jit(make_train_step(mse, opt, grad_accumulation_step=k, gradients_mean=False,
                                   data_parallel=dp))
    new, _, loss = step(params, opt.init(params), *xy)
    ref_loss, grads = jax.value_and_grad(mse)(params, *xy)
    assert_tree_close(new, jax.tree.map(lambda p, g: p - lr * dp * g, params, grads), 1e-5)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)  # the loss is the mean either way


def test_aux_is_averaged_over_microbatches():
    params, xy = mlp_params(), batch()
    (loss, aux), grads = accumulate_gradients(mse_aux, params, xy, 4, has_aux=True)
    (ref_loss, ref_aux), ref_grads = jax.value_and_grad(mse_aux, has_aux=True)(params, *xy)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(aux["mae"], ref_aux["mae"], rtol=1e-5)
    np.testing.assert_allclose(aux["first"], jnp.mean(xy[0][:4, 0]), rtol=1e-5)  # row j of mb j
    assert_tree_close(grads, ref_grads, 1e-5)
    opt = optax.sgd(0.1)
    out = jax.jit(make_train_step(mse_aux, opt, grad_accumulation_step=2, has_aux=True))(
        params, opt.init(params), *xy)
    assert len(out) == 4 and set(out[3]) == {"mae", "first"}


def test_integer_aux_cannot_be_averaged():
    def loss_fn(params, x, y):
        return mse(params, x, y), jnp.sum(x > 0)

    with pytest.raises(TypeError, match=r"output aux has dtype int32, .* k=1"):
        accumulate_gradients(loss_fn, mlp_params(), batch(), 2, has_aux=True)


def test_unbatched_arguments_reach_every_microbatch_whole():
    def loss_fn(params, x, y, scale):
        return mse(params, x, y) * scale[0]

    params, (x, y), scale = mlp_params(), batch(), jnp.array([2.0, 0.0, 0.0])
    loss, grads = accumulate_gradients(loss_fn, params, (x, y, scale), 4, batch_argnums=(0, 1))
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, x, y, scale)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_tree_close(grads, ref_grads, 1e-5)


def test_low_precision_params_accumulate_in_float32():
    params, xy = mlp_params(jnp.bfloat16), batch()
    loss, grads = accumulate_gradients(mse, params, xy, 4)
    ref_loss, ref_grads = jax.value_and_grad(mse)(params, *xy)
    assert loss.dtype == jnp.float32
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.float32(g), np.float32(r), rtol=2e-2, atol=2e-3)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)


def test_complex_gradients_keep_their_imaginary_part():
    """The accumulators were float32 for every leaf: a complex gradient lost its imaginary
    part with k > 1 (an SGD step 0.138 off k=1's), silently."""
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((D_IN, D_OUT)) + 1j * rng.standard_normal((D_IN, D_OUT)),
                    jnp.complex64)
    x = batch()[0]

    def loss(w, x):
        return jnp.mean(jnp.abs(x @ w) ** 2)

    ref_loss, ref = jax.value_and_grad(loss)(w, x)
    for k in (2, 4):
        got_loss, got = accumulate_gradients(loss, w, (x,), k)
        assert got.dtype == jnp.complex64 and got_loss.dtype == jnp.float32
        assert np.abs(np.imag(got)).max() > 0.1
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-5)


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"loss_fn": "mse"}, TypeError, "loss_fn='mse' must be callable"),
    ({"optimizer": object()}, TypeError, "optimizer=.* must be an optax.GradientTransformation"),
    ({"grad_accumulation_step": 0}, ValueError, "grad_accumulation_step=0 must be >= 1"),
    ({"grad_accumulation_step": 2.0}, TypeError, "grad_accumulation_step=2.0 must be an int"),
    ({"grad_accumulation_step": True}, TypeError, "grad_accumulation_step=True must be an int"),
    ({"data_parallel": 0}, ValueError, "data_parallel=0 must be >= 1"),
    ({"gradients_mean": "yes"}, TypeError, "gradients_mean='yes' must be True or False"),
    ({"has_aux": 1}, TypeError, "has_aux=1 must be True or False"),
    ({"batch_argnums": -1}, TypeError, "batch_argnums=-1 must be None"),
    ({"batch_argnums": (0, 0)}, ValueError, r"batch_argnums=\(0, 0\) lists an index twice"),
    ({"microbatch_layout": "rows"}, ValueError, "microbatch_layout='rows' must be one of"),
])
def test_bad_arguments_fail_eagerly(kwargs, exc, match):
    args = {"loss_fn": mse, "optimizer": optax.sgd(0.1), **kwargs}
    with pytest.raises(exc, match=match):
        make_train_step(args.pop("loss_fn"), args.pop("optimizer"), **args)


def test_indivisible_batch_fails_at_trace_time_before_the_loss_runs():
    calls = []

    def loss_fn(params, x, y):
        calls.append(1)
        return mse(params, x, y)

    opt, params = optax.sgd(0.1), mlp_params()
    step = jax.jit(make_train_step(loss_fn, opt, grad_accumulation_step=3))
    with pytest.raises(ValueError, match=r"grad_accumulation_step=3: batch\[0\] of shape "
                                         r"\(32, 16\) has leading dim 32"):
        step(params, opt.init(params), *batch())
    assert not calls


@pytest.mark.parametrize("call, exc, match", [
    (lambda: accumulate_gradients(mse, mlp_params(), batch()[0], 2), TypeError,
     "batch must be a tuple"),
    (lambda: accumulate_gradients(mse, mlp_params(), batch(), 0), ValueError, "k=0 must be >= 1"),
    (lambda: accumulate_gradients(mse, mlp_params(), batch(), 2, batch_argnums=(2,)),
     ValueError, r"index 2 is out of range for the 2 batch argument"),
    (lambda: accumulate_gradients(mse, mlp_params(), (jnp.ones(()), batch()[1]), 2), ValueError,
     r"batch\[0\] of shape \(\) is a scalar"),
])
def test_accumulate_gradients_errors(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_semi_auto_accumulates_without_gathering_the_sums_after_the_loop():
    """In semi_auto (sharding_propagation) a loop's body was planned by propagation alone, and
    the gradient accumulators (the scan's carries, zeros any layout makes for free) came out
    cut on a weight dim: each microbatch's matmuls ran whole on every device and the sums were
    gathered after the loop, 30,720 bytes moved where jit's data parallel moves 24,592 (now
    6,144: the batch gathered once, modelled cheaper here). The body is now solved as the
    automatic searches solve it (CostModel.search_bodies)."""
    def loss(p, x, y):
        return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"] - y) ** 2)

    params = {"w1": jnp.full((16, 64), 0.1), "w2": jnp.full((64, 8), 0.1)}
    opt = optax.adam(1e-2)
    x, y = jnp.ones((64, 16)), jnp.ones((64, 8))
    step = make_train_step(loss, opt, grad_accumulation_step=4)
    mesh = jaxpar.make_mesh(8)
    whole, cut = NamedSharding(mesh, P()), NamedSharding(mesh, P(("d0", "d1", "d2")))
    dp = jax.jit(step, in_shardings=(whole, whole, cut, cut))
    args = (params, opt.init(params), x, y)
    net = jaxpar.AutoParallel(step, parallel_mode="semi_auto")
    moved = sum(c["bytes"] for c in jaxpar.collective_stats(net.lower(*args).compile()).values())
    assert moved < sum(c["bytes"] for c in
                       jaxpar.collective_stats(dp.lower(*args).compile()).values())
    assert_tree_close(net(*args), dp(*args), rtol=1e-5)
