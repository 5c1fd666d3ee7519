"""The nnx GPT against the plain-JAX GPT (logits, loss, three training steps two ways, parameter
round trip, leaf paths, under jaxpar.shard), and the MLP plain and as an nnx module."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.tree_util import DictKey, GetAttrKey

import jaxpar
from jaxpar.ir.trace import leaf_paths
from jaxpar.models import gpt, moe, nnx_gpt, vit
from jaxpar.models.mlp import (
    NNXMLP,
    init_mlp,
    make_sgd_step,
    make_train_step,
    mlp_forward,
    mlp_loss,
    mlp_params,
)

CFG = gpt.GPTConfig(layers=2, d_model=32, heads=4, vocab=64, seq=8)


@pytest.fixture(scope="module")
def plain():
    params = jax.jit(gpt.init_params, static_argnums=0)(CFG, jax.random.key(0))
    return params, *gpt.batch(CFG, 4)


def assert_trees_close(got, want, rtol=1e-5, atol=1e-6):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def test_nnx_gpt_computes_the_plain_logits_and_loss(plain):
    @jax.jit
    def both(params, tokens, targets):
        model = nnx_gpt.from_params(CFG, params)
        return ((model(tokens), nnx_gpt.loss(model, tokens, targets)),
                (gpt.forward(CFG, params, tokens), gpt.loss_fn(CFG, params, tokens, targets)))

    got, want = both(*plain)
    assert got[0].shape == (4, 8, 64)
    assert_trees_close(got, want)


def test_params_round_trip_exactly(plain):
    params = plain[0]
    back = nnx_gpt.to_params(nnx_gpt.from_params(CFG, params))
    assert jax.tree.structure(back) == jax.tree.structure(params)
    assert all(np.array_equal(a, b) for a, b in
               zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True))


def test_a_fresh_model_has_the_plain_layout():
    fresh = nnx_gpt.to_params(nnx.eval_shape(lambda: nnx_gpt.NNXGPT(CFG, rngs=nnx.Rngs(0))))
    want = jax.eval_shape(lambda: gpt.init_params(CFG, jax.random.key(0)))
    assert jax.tree.map(lambda a: (a.shape, a.dtype), fresh) == \
        jax.tree.map(lambda a: (a.shape, a.dtype), want)


def _plain_losses(params, tokens, targets, tx, n):
    step, opt_state = gpt.make_train_step(CFG, params, tx)
    step, losses = jax.jit(step), []
    for _ in range(n):
        params, opt_state, value = step(params, opt_state, tokens, targets)
        losses.append(float(value))
    return losses, params


def test_both_nnx_train_steps_follow_the_plain_step(plain):
    params, tokens, targets = plain
    tx = optax.adamw(1e-2)
    want, want_params = _plain_losses(params, tokens, targets, tx, 3)

    model = nnx_gpt.from_params(CFG, params)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    in_place = nnx.jit(nnx_gpt.make_train_step(tx))
    got_in_place = [float(in_place(model, optimizer, tokens, targets)) for _ in range(3)]

    step, init = nnx_gpt.make_functional_step(CFG, tx)
    graphdef, state, opt_state = init(nnx_gpt.from_params(CFG, params))
    step, got_functional = jax.jit(step), []
    for _ in range(3):
        state, opt_state, value = step(state, opt_state, tokens, targets)
        got_functional.append(float(value))

    assert want[2] < want[0]
    np.testing.assert_allclose(got_in_place, want, rtol=1e-5)
    np.testing.assert_allclose(got_functional, want, rtol=1e-5)
    for trained in (model, nnx.merge(graphdef, state)):
        assert_trees_close(_without_key_bias(nnx_gpt.to_params(trained)),
                           _without_key_bias(want_params), rtol=1e-4, atol=1e-5)


def _without_key_bias(params):
    # The key bias has no gradient (softmax ignores a shift shared by all keys), so adam turns
    # the rounding noise there into updates of the order of the learning rate.
    d = CFG.d_model
    return params | {"blocks": [b | {"attn": b["attn"] | {"bqkv": b["attn"]["bqkv"][
        np.r_[:d, 2 * d:3 * d]]}} for b in params["blocks"]]}


def test_functional_leaf_paths_are_the_plain_paths_with_value(plain):
    _, init = nnx_gpt.make_functional_step(CFG, optax.adamw(1e-3))
    _, state, opt_state = init(nnx_gpt.from_params(CFG, plain[0]))
    paths = leaf_paths(state, "params")
    assert sorted(paths) == sorted(p + "/value" for p in leaf_paths(plain[0], "params"))
    assert "params/blocks/1/attn/wqkv/value" in paths
    assert "params/blocks/0/ln1/scale/value" in paths
    assert "opt_state/0/mu/blocks/0/attn/wqkv/value" in leaf_paths(opt_state, "opt_state")
    keys = dict(jax.tree_util.tree_flatten_with_path(state)[0])
    assert (DictKey("blocks"), DictKey(0), DictKey("attn"), DictKey("wqkv"),
            GetAttrKey("value")) in keys


def test_the_functional_nnx_step_under_jaxpar_matches_jit():
    cfg = gpt.GPTConfig(layers=1, d_model=32, heads=4, vocab=64, seq=8)
    tokens, targets = gpt.batch(cfg, 8)
    # momentum SGD: optimizer state of the parameters' nnx.State layout, fewer ops than adam.
    step, init = nnx_gpt.make_functional_step(cfg, optax.sgd(0.1, momentum=0.9))
    graphdef, state, opt_state = init(nnx_gpt.NNXGPT(cfg, rngs=nnx.Rngs(0)))
    assert leaf_paths(opt_state, "opt_state")[0] == "opt_state/0/trace/blocks/0/attn/bo/value"
    sharded = jaxpar.shard(step, search_mode="sharding_propagation", in_strategy=None)
    got, want, losses = (state, opt_state), (state, opt_state), []
    for _ in range(2):
        *got, got_loss = sharded(*got, tokens, targets)
        *want, want_loss = jax.jit(step)(*want, tokens, targets)
        np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-4)
        losses.append(float(got_loss))
    assert losses[1] < losses[0]
    plan = sharded.plan(state, opt_state, tokens, targets)
    assert "params/blocks/0/mlp/w1/value" in plan.in_paths
    assert plan.collectives and len(jax.devices()) == 8  # really spread over 8 devices
    got, want = (_without_key_bias(nnx_gpt.to_params(nnx.merge(graphdef, state)))
                 for state, _ in (got, want))
    assert_trees_close(got, want, rtol=1e-4, atol=1e-5)


def test_bad_configs_params_and_inputs_are_value_errors(plain):
    params, tokens, _ = plain
    with pytest.raises(ValueError, match=r"d_model must be a multiple of heads"):
        gpt.GPTConfig(d_model=30, heads=4)
    with pytest.raises(ValueError, match=r"scan_layers=True.*use scan_layers=False"):
        nnx_gpt.NNXGPT(gpt.GPTConfig(scan_layers=True, layers=1, d_model=32, vocab=64, seq=8),
                       rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"params\['wte'\]: shape \(32, 32\).*needs \(64, 32\)"):
        nnx_gpt.from_params(CFG, params | {"wte": params["wte"][:32]})
    with pytest.raises(ValueError, match=r"missing \[\"\['ln_f'\]\['bias'\]\"\]"):
        nnx_gpt.from_params(CFG, params | {"ln_f": {"scale": params["ln_f"]["scale"]}})
    with pytest.raises(ValueError, match=r"tokens: shape \(4, 16\).*seq <= cfg.seq=8"):
        nnx_gpt.from_params(CFG, params)(jnp.tile(tokens, (1, 2)))


def test_steps_refuse_a_model_or_optimizer_they_were_not_made_for(plain):
    model = nnx_gpt.from_params(CFG, plain[0])
    _, init = nnx_gpt.make_functional_step(gpt.GPTConfig(layers=1, d_model=32, heads=4,
                                                         vocab=64, seq=8), optax.sgd(0.1))
    with pytest.raises(ValueError, match="make the step with the model's config"):
        init(model)
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match="build both from the same transformation"):
        nnx_gpt.make_train_step(optax.sgd(0.1))(model, optimizer, *plain[1:])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", [jax.nn.relu, None])
def test_mlp_plain_and_nnx_forward_agree(bias, activation):
    model = NNXMLP([8, 16, 16, 4], bias=bias, activation=activation, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (5, 8))
    params = mlp_params(model)
    assert [sorted(p) for p in params] == [["b", "w"] if bias else ["w"]] * 3
    np.testing.assert_allclose(mlp_forward(params, x, activation), model(x), rtol=1e-5,
                               atol=1e-6)
    if activation is not None:  # relu makes a difference on these inputs
        assert not np.allclose(mlp_forward(params, x, None), model(x))


def test_init_mlp_gives_alpa_layers():
    params = init_mlp(jax.random.key(0), [32] * 7)
    assert len(params) == 6 and all(p["w"].shape == (32, 32) and p["b"].shape == (32,)
                                    for p in params)
    assert "b" not in init_mlp(jax.random.key(0), [4, 2], bias=False)[0]


def _batch(n_in=8, n_out=4, batch=16):
    kx, ky = jax.random.split(jax.random.key(2))
    return jax.random.normal(kx, (batch, n_in)), jax.random.normal(ky, (batch, n_out))


def test_sgd_step_decreases_the_loss_and_matches_optax_sgd():
    x, y = _batch()
    params = init_mlp(jax.random.key(0), [8, 16, 4])
    sgd = jax.jit(make_sgd_step(0.05))
    p, losses = params, []
    for _ in range(5):
        p, value = sgd(p, x, y)
        losses.append(float(value))
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False))
    tx = optax.sgd(0.05)
    got, _, value = jax.jit(make_train_step(tx))(params, tx.init(params), x, y)
    assert_trees_close(got, sgd(params, x, y)[0])
    np.testing.assert_allclose(value, mlp_loss(params, x, y), rtol=1e-6)


def _alpa_reference_step(params, x, y):
    """The step of tests/test_objectives.py: linear layers with bias, MSE, SGD with lr 0.1."""
    def loss(params):
        h = x
        for w, b in params:
            h = h @ w + b
        return jnp.mean((h - y) ** 2)

    return jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params))


def _alpa_args(batch, hidden, layers=6):
    rng = np.random.default_rng(0)
    params = [(jnp.asarray(rng.standard_normal((hidden, hidden)) * 0.1, jnp.float32),
               jnp.asarray(rng.standard_normal(hidden) * 0.1, jnp.float32))
              for _ in range(layers)]
    x, y = (jnp.asarray(rng.standard_normal((batch, hidden)), jnp.float32) for _ in range(2))
    return params, x, y


@pytest.mark.parametrize("batch,hidden", [(256, 32), (32, 256)])  # Alpa's dp and tp cases
def test_sgd_step_is_a_drop_in_for_the_alpa_mlp_cases(batch, hidden):
    sgd = make_sgd_step(0.1, activation=None)

    def mlp_step(params, x, y):
        return sgd(params, x, y)[0]

    args = _alpa_args(batch, hidden)
    assert_trees_close(mlp_step(*args), _alpa_reference_step(*args), rtol=0, atol=0)
    mesh = jaxpar.make_mesh((4,), ("x",))
    planned = []
    for fn in (mlp_step, _alpa_reference_step):
        f = jaxpar.shard(fn, mesh=mesh, search_mode="recursive_programming")
        planned.append((f.plan(*args).layout, jaxpar.collective_stats(f.lower(*args).compile())))
    assert planned[0] == planned[1]  # the same plan, the same collectives
    assert "4" in planned[0][0] and "all-reduce" in planned[0][1]


@pytest.mark.parametrize("sizes", [[], [4], [4, 0], [4, -1, 2], [4, 2.5], "42", None,
                                   [True, 2]])
def test_mlp_rejects_bad_sizes(sizes):
    with pytest.raises(ValueError, match=r"NNXMLP\(sizes=.*at least two positive ints"):
        NNXMLP(sizes, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"init_mlp\(sizes=.*e\.g\. \[32, 64, 10\]"):
        init_mlp(jax.random.key(0), sizes)


@pytest.mark.parametrize("bias", ["no", 0, None])
def test_mlp_rejects_a_bias_flag_that_is_not_a_bool(bias):
    # "no" is truthy: init_mlp had made biases the caller asked to leave out.
    with pytest.raises(ValueError, match=r"init_mlp\(bias=.*must be True or False"):
        init_mlp(jax.random.key(0), [4, 2], bias=bias)
    with pytest.raises(ValueError, match=r"NNXMLP\(bias=.*must be True or False"):
        NNXMLP([4, 2], bias=bias, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("lr", [0, -0.1, "0.1", None, float("nan")])
def test_sgd_rejects_a_bad_learning_rate(lr):
    with pytest.raises(ValueError, match=r"lr=.*positive number"):
        make_sgd_step(lr)


def test_the_abstract_gpt_step_runs_no_optimizer_init():
    # abstract_train_step ran opt.init on the parameters' ShapeDtypeStructs (optax made real
    # zeros: two parameters' worth with Adam), so `jaxpar plan` of a big model allocated its
    # state or died of RESOURCE_EXHAUSTED. The init is now only traced (eval_shape).
    concrete = []
    adam = optax.adam(1e-3)

    def init(params):
        concrete.extend(not isinstance(p, jax.core.Tracer)
                        for p in jax.tree_util.tree_leaves(params))
        return adam.init(params)

    cfg = gpt.GPTConfig(layers=1, d_model=16, heads=2, vocab=32, seq=8)
    step, (params, opt_state, tok, _) = gpt.abstract_train_step(
        cfg, 4, optax.GradientTransformation(init, adam.update))
    assert concrete and not any(concrete)
    assert all(isinstance(x, jax.ShapeDtypeStruct)
               for x in jax.tree_util.tree_leaves((params, opt_state)))
    out = jax.eval_shape(step, params, opt_state, tok, tok)
    assert jax.tree_util.tree_structure(out[1]) == jax.tree_util.tree_structure(opt_state)


@pytest.mark.parametrize("name,value,rule", [
    ("capacity_factor", float("inf"), "> 0"), ("capacity_factor", float("nan"), "> 0"),
    ("capacity_factor", 0, "> 0"), ("capacity_factor", -1.0, "> 0"),
    pytest.param("capacity_factor", 10**400, "> 0", id="capacity_factor-10**400"),
    ("aux_loss_coef", float("inf"), ">= 0"),
    ("aux_loss_coef", float("nan"), ">= 0"), ("aux_loss_coef", -0.5, ">= 0")])
def test_moe_config_refuses_a_non_finite_or_non_positive_factor(name, value, rule):
    # inf and nan were accepted; `capacity` then raised OverflowError / "cannot convert NaN".
    with pytest.raises(ValueError, match=rf"MoEConfig\({name}=.*finite number {rule}, e\.g\."):
        moe.MoEConfig(**{name: value})
    assert moe.MoEConfig(capacity_factor=0.01, aux_loss_coef=0).capacity == 1


@pytest.mark.parametrize("kwargs,match", [
    ({"dtype": "bogus"}, r"dtype='bogus'\): .*need one of \['float32', 'bfloat16'"),
    ({"dtype": "int32"}, r"dtype='int32'\)"), ({"dtype": None}, r"dtype=None\)"),
    ({"dtype": jnp.complex64}, r"dtype=.*complex64"),
    ({"scan_layers": 1}, r"scan_layers=1\): must be True or False"),
    ({"scan_layers": "no"}, r"scan_layers='no'\)")])
def test_gpt_config_refuses_a_bad_dtype_or_scan_layers(kwargs, match):
    with pytest.raises(ValueError, match=rf"GPTConfig\({match}"):
        gpt.GPTConfig(**kwargs)
    for dtype in ("bfloat16", jnp.float16, np.dtype("float32")):  # what a model can train in
        assert gpt.GPTConfig(dtype=dtype, scan_layers=True).dtype == dtype


@pytest.mark.parametrize("scan", [False, True])
def test_a_half_precision_gpt_keeps_its_dtype_through_attention(scan):
    """The attention scores were divided by a float32 scalar, which made every activation
    after the first layer's attention float32: logits came out float32, and with scan_layers
    the scan refused its carry (bfloat16 in, float32 out) inside JAX."""
    cfg = gpt.GPTConfig(layers=2, d_model=32, heads=4, vocab=64, seq=8, dtype=jnp.bfloat16,
                        scan_layers=scan)
    params = gpt.init_params(cfg, jax.random.key(0))
    logits = jax.eval_shape(lambda p, t: gpt.forward(cfg, p, t), params,
                            jax.ShapeDtypeStruct((2, 8), jnp.int32))
    assert logits.dtype == jnp.bfloat16
    if not scan:  # the nnx model has no scan_layers
        module = nnx_gpt.NNXGPT(cfg, rngs=nnx.Rngs(0))
        assert module(jnp.zeros((2, 8), jnp.int32)).dtype == jnp.bfloat16


@pytest.mark.parametrize("module,cfg,arg", [
    (gpt, CFG, "batch_size"), (moe, moe.MoEConfig(d_model=8, d_ff=8, group_size=4), "groups"),
    (vit, vit.ViTConfig(image=8, d_model=8, heads=2, layers=1), "batch_size")])
@pytest.mark.parametrize("value", [-1, 0, 2.5, True, None])
def test_a_bad_batch_size_is_refused_before_tracing(module, cfg, arg, value):
    # -1 made a ShapeDtypeStruct of shape (-1, ...) that failed only inside the planner.
    for fn in (module.abstract_train_step, module.batch):
        with pytest.raises(ValueError, match=rf"{fn.__name__}\({arg}={value!r}\): .*positive"):
            fn(cfg, value)
    assert module.abstract_train_step(cfg, np.int64(2))[1][2].shape[0] == 2


def test_sgd_rejects_an_infinite_learning_rate():
    with pytest.raises(ValueError, match=r"lr=inf: .*finite positive number"):
        make_sgd_step(float("inf"))
