"""benchmarks/run.py on tiny models: baseline layouts, their numbers, the rows, JSON and markdown.

Every hand-written baseline must compute what the unsharded step computes (same loss, rtol
1e-5) on 8 CPU devices; the layouts must be the ones documented (and gpt_plans.py's where both
have one); the results files must hold the documented keys with the documented types.
"""

import functools
import json
import os
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.models import moe, vit

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import baselines  # noqa: E402
import gpt_plans  # noqa: E402
import models  # noqa: E402
import run  # noqa: E402

KEYS = {"model": str, "mesh": str, "hardware": str, "strategy": str, "kind": str, "status": str,
        "modeled_step_s": float, "compute_s": float, "comm_s": float, "roofline_step_s": float,
        "hlo_comm_bytes": float, "peak_memory_bytes": float, "search_s": float,
        "compile_s": float, "collectives": dict}


@pytest.fixture(scope="module")
def mlp_rows():
    opts = run.Options(("mlp",), ((4, 2),), ("h100-nvlink",), ("dynamic_programming",),
                       objectives=("default",), preset="tiny")
    return models.build("mlp", "tiny"), run.run(opts)


@functools.cache
def _unsharded_loss(name: str) -> float:
    model = models.build(name, "tiny")
    return float(jax.jit(model.step)(*model.make_args(0))[2])


def _loss_matches(model, compiled) -> None:
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(model.make_args(0))]
    _, out = run.execute(compiled, leaves, 1)
    loss = jax.tree_util.tree_leaves(out)[-1]
    np.testing.assert_allclose(loss, _unsharded_loss(model.name), rtol=1e-5)


def test_every_baseline_row_computes_the_unsharded_loss(mlp_rows):
    model, rows = mlp_rows
    base = [r for r in rows if r["kind"] == "baseline"]
    assert [r["strategy"] for r in base] == list(baselines.BASELINES)
    for r in base:
        assert r["status"] == "ok", r
        _loss_matches(model, r["_compiled"])


@pytest.mark.parametrize("model,name,shape", [
    ("gpt", "megatron", (2, 2, 2)), ("vit", "maxtext_2d", (4, 2)),
    ("moe", "alpa_heuristic", (2, 2, 2))])
def test_transformer_and_moe_baselines_compute_the_unsharded_loss(model, name, shape):
    bench = models.build(model, "tiny")
    _loss_matches(bench, baselines.compile_baseline(name, bench, jaxpar.make_mesh(shape)))


def test_layouts_match_gpt_plans_and_the_documented_heuristics():
    model = models.build("gpt", "tiny")
    leaves = model.leaves()
    fsdp = baselines.layout("fsdp", model, jaxpar.make_mesh((2, 2, 2)))
    assert fsdp == [gpt_plans.fsdp(p, s) for p, s in leaves]
    rename = {"d0": "dp", "d1": "tp"}
    mega = baselines.layout("megatron", model, jaxpar.make_mesh((4, 2)))
    want = [gpt_plans.megatron(p, s) for p, s in leaves]
    assert [P(*(rename.get(e, e) for e in spec)) for spec in mega] == [
        P(*spec, *[None] * (len(s) - len(spec))) if spec else P(*[None] * len(s))
        for spec, (_, s) in zip(want, leaves, strict=True)]
    mesh = jaxpar.make_mesh((2, 2, 2))
    assert baselines._greedy_largest(mesh, (1024, 4096)) == P("d2", ("d0", "d1"))
    assert baselines._largest_divisible(mesh, (6, 5)) == P()


def test_layouts_that_do_not_fit_say_why():
    model = models.build("gpt", "tiny")  # 4 heads
    with pytest.raises(baselines.NotApplicable, match="does not divide the 4 attention heads"):
        baselines.layout("megatron", model, jaxpar.make_mesh((8,)))
    with pytest.raises(baselines.NotApplicable, match="two or more axes"):
        baselines.layout("maxtext_2d", model, jaxpar.make_mesh((8,)))
    with pytest.raises(ValueError, match="use one of"):
        baselines.layout("zero", model, jaxpar.make_mesh((8,)))
    small = models.gpt_model(layers=1, d_model=32, heads=4, vocab=64, seq=8, batch=4)
    with pytest.raises(baselines.NotApplicable, match=r"batch of tokens \(4, 8\)"):
        baselines.layout("data_parallel", small, jaxpar.make_mesh((8,)))
    assert baselines.layout("maxtext_2d", small, jaxpar.make_mesh((2, 2, 2)))[-1] == P(
        ("d0", "d1"), None)


def test_rows_json_and_markdown(mlp_rows, tmp_path):
    _, rows = mlp_rows
    summary = run.write(rows, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved) == len(rows) == len(baselines.BASELINES) + 1
    for r in saved:
        for key, kind in KEYS.items():
            assert isinstance(r[key], kind), (key, r)
        assert r["modeled_step_s"] == pytest.approx(r["compute_s"] + r["comm_s"])
        assert r["modeled_step_s"] > 0 and r["peak_memory_bytes"] > 0
        assert r["hlo_comm_bytes"] == sum(v["bytes"] for v in r["collectives"].values())
    ours = [r for r in saved if r["kind"] == "jaxpar"]
    assert [r["strategy"] for r in ours] == ["jaxpar-dynamic_programming"]
    assert ours[0]["search_s"] > 0 and isinstance(ours[0]["predicted_comm_bytes"], float)
    assert all(r["predicted_comm_bytes"] is None and r["search_s"] == 0.0 for r in saved
               if r["kind"] == "baseline")
    (case,) = summary
    assert case["ratio"] == pytest.approx(case["jaxpar_s"] / case["baseline_s"])
    assert case["baseline_s"] == min(r["modeled_step_s"] for r in saved if r["kind"] == "baseline")
    md = (tmp_path / "results.md").read_text()
    assert "| model | mesh | hardware | best jaxpar |" in md
    assert f"| mlp | 4x2 | h100-nvlink | jaxpar-dynamic_programming | {run._ms(case['jaxpar_s'])}" \
        in md
    assert md.count("| mlp | 4x2 | h100-nvlink |") == len(rows) + 1


def test_failures_name_slower_cases_only():
    def case(ours, theirs):
        return {"model": "m", "mesh": "8", "hardware": "h", "jaxpar": "jaxpar-x",
                "jaxpar_s": ours, "baseline": "fsdp", "baseline_s": theirs,
                "ratio": None if ours is None else ours / theirs}

    found = run.failures([case(2.0, 1.0), case(1.0, 1.0), case(0.5, 1.0), case(None, 1.0)])
    assert len(found) == 2
    assert "2.000x fsdp" in found[0] and "no jaxpar plan" in found[1]


def test_main_writes_results_and_reports_na(tmp_path, monkeypatch):
    for var, default in (("XLA_FLAGS", ""), ("TF_CPP_MIN_LOG_LEVEL", "0")):
        monkeypatch.setenv(var, os.environ.get(var, default))  # main() sets them; undone after
    code = run.main(["--sizes", "tiny", "--models", "mlp", "--meshes", "8", "--hardware",
                     "tpu-v5e", "--modes", "dynamic_programming", "--baselines", "maxtext_2d",
                     "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["strategy"] for r in saved] == ["maxtext_2d", "jaxpar-dynamic_programming",
                                              "jaxpar-dynamic_programming-speed"]
    assert saved[0]["status"] == "n/a" and "two or more axes" in saved[0]["reason"]
    assert saved[1]["status"] == saved[2]["status"] == "ok" and saved[1]["mesh"] == "8"
    assert code == 0  # no baseline compiled: nothing for jaxpar to be slower than
    with pytest.raises(SystemExit, match="--baselines 'zero'"):
        run.main(["--sizes", "tiny", "--baselines", "zero", "--out", str(tmp_path)])


def test_moe_routes_each_token_to_at_most_two_experts_within_capacity():
    cfg = moe.MoEConfig(d_model=16, d_ff=32, experts=8, group_size=8, capacity_factor=1.0)
    params = jax.jit(moe.init_params, static_argnums=0)(cfg, jax.random.key(0))
    x, _ = moe.batch(cfg, 2)
    dispatch, combine, aux = jax.jit(moe.route, static_argnums=0)(cfg, params["router"], x)
    assert dispatch.shape == (2, 8, 8, cfg.capacity) and cfg.capacity == 2
    per_token = np.asarray(dispatch.sum(axis=(2, 3)))
    assert per_token.max() <= 2 and per_token.min() >= 1
    assert np.asarray(dispatch.sum(axis=1)).max() <= 1  # one token per expert slot
    kept = per_token > 0
    np.testing.assert_allclose(np.asarray(combine.sum(axis=(2, 3)))[kept], 1.0, rtol=1e-5)
    assert float(aux) > 0
    with pytest.raises(ValueError, match="experts=1"):
        moe.MoEConfig(experts=1)


def test_vit_config_errors_name_the_fields():
    assert vit.ViTConfig(image=8, patch=4).patches == 4
    with pytest.raises(ValueError, match="image=10, patch=4"):
        vit.ViTConfig(image=10, patch=4)
    with pytest.raises(ValueError, match="heads=3"):
        vit.ViTConfig(d_model=16, heads=3)
