"""The benchmarks' entry points on a tiny GPT: the JSON they write has its fields and sane figures.

No timings are asserted; the full-size runs are `benchmarks/gpt_plans.py` and
`benchmarks/search_time.py` themselves.
"""

import argparse
import json
import math

import jax
import pytest
from bench_loader import load_benchmark

F32 = 4


gpt_plans, search_time, search_gap, reshard_accuracy, memory_budget, search_programs = (
    load_benchmark("gpt_plans"), load_benchmark("search_time"), load_benchmark("search_gap"),
    load_benchmark("reshard_accuracy"), load_benchmark("memory_budget"),
    load_benchmark("search_programs"))
TINY = {"d_model": 32, "heads": 4, "vocab": 64, "seq": 8, "batch": 8}


def test_gpt_plans_tiny(tmp_path):
    # mem_coeff 1: at this size the step's time alone is least replicated, with nothing to
    # predict; weighing memory more cuts it.
    cfg = gpt_plans.Config(layers=1, mem_coeff=1.0, **TINY)
    result = gpt_plans.run(cfg, ["sharding_propagation", "no_such_mode"], ["data_parallel"],
                           ["jit"], tmp_path)
    saved = json.loads((tmp_path / "gpt_plans.json").read_text())
    assert saved["config"]["d_model"] == 32 and len(saved["rows"]) == 3
    assert "| plan | lowering |" in (tmp_path / "gpt_plans.md").read_text()
    auto, missing, dp = saved["rows"]
    assert missing["status"] == "unavailable" and "no_such_mode" in missing["error"]
    for row in (auto, dp):
        e = row["estimate"]
        assert row["status"] == "ok" and row["compile_s"] > 0 and row["peak_bytes"] > 0
        assert e["total_s"] == pytest.approx(e["compute_s"] + e["comm_s"]) and e["total_s"] > 0
        assert row["measured_bytes"] == sum(v["bytes"] for v in row["measured"].values())
    assert auto["plan_s"] > 0 and auto["predicted_bytes"] > 0 and auto["modelled_total_s"] > 0
    assert auto["bytes_ratio"] == pytest.approx(auto["predicted_bytes"] / auto["measured_bytes"])
    assert dp["plan_s"] is None and dp["bytes_ratio"] is None
    # Data parallel: one all-reduce of the gradients (the tied embedding's two gradient terms
    # may be reduced apart) and the loss.
    _, args = gpt_plans._problem(cfg)
    params = sum(x.size * F32 for x in jax.tree_util.tree_leaves(args[0]))
    wte = TINY["vocab"] * TINY["d_model"] * F32
    assert set(dp["measured"]) == {"all-reduce"}
    assert params <= dp["measured"]["all-reduce"]["bytes"] <= params + wte + F32
    assert result["failures"] == gpt_plans.failures(result["rows"])


def test_gpt_plans_failures_name_slow_plans_and_bad_predictions():
    def row(name, kind, total, ratio=None):
        return {"name": name, "kind": kind, "lowering": "x", "status": "ok", "bytes_ratio": ratio,
                "predicted_bytes": 1.0, "measured_bytes": 1.0, "estimate": {"total_s": total}}

    rows = [row("auto", "automatic", 2.0, 1.0), row("dp", "baseline", 1.0),
            row("fsdp", "baseline", 3.0, 1.2),
            {"name": "rp", "kind": "automatic", "status": "error", "error": "boom"}]
    found = gpt_plans.failures(rows)
    assert len(found) == 3 and "rp failed: boom" in found
    assert any(f.startswith("auto") and "slower than dp" in f for f in found)
    assert any(f.startswith("fsdp") and "ratio 1.200" in f for f in found)
    assert gpt_plans.failures([row("auto", "automatic", 1.0, 1.05), row("dp", "baseline", 1.0)]) \
        == []


@pytest.mark.parametrize("path,shape,want", [
    ("params/wte", (64, 32), (gpt_plans.ALL8, None)),
    ("params/blocks/0/mlp/w2", (128, 32), (gpt_plans.ALL8, None)),
    ("opt_state/0/mu/blocks/0/attn/wqkv", (32, 96), (None, gpt_plans.ALL8)),
    ("params/blocks/0/attn/bo", (32,), (gpt_plans.ALL8,)),
    ("params/odd", (6, 5), ()),
    ("opt_state/0/count", (), ()),
    ("tokens", (8, 16), (gpt_plans.ALL8, None)),
])
def test_fsdp_splits_the_largest_divisible_dimension(path, shape, want):
    assert tuple(gpt_plans.fsdp(path, shape)) == want


@pytest.mark.parametrize("path,want", [
    ("params/blocks/1/attn/wqkv", (None, "tp")), ("opt_state/0/nu/blocks/1/attn/bqkv", ("tp",)),
    ("params/blocks/0/attn/wo", ("tp", None)), ("params/blocks/0/attn/bo", ()),
    ("params/blocks/0/mlp/w1", (None, "tp")), ("params/blocks/0/mlp/w2", ("tp", None)),
    ("params/wte", ("tp", None)), ("params/wpe", ()), ("params/ln_f/scale", ()),
    ("targets", ("dp", None)),
])
def test_megatron_layout(path, want):
    assert tuple(gpt_plans.megatron(path, (8, 8))) == want


def test_search_time_tiny(tmp_path):
    cfg = search_time.Config(**TINY)
    result = search_time.run([1], ["sharding_propagation", "no_such_mode"], cfg, 300.0, tmp_path,
                             repeat=2)
    saved = json.loads((tmp_path / "search_time.json").read_text())
    assert saved == json.loads(json.dumps(result))
    ok, missing = saved["rows"]
    assert missing["status"] == "unavailable"
    assert ok["status"] == "ok", ok.get("error")
    assert ok["runs"] == 2 and ok["search_s"] == min(ok["search_s_runs"])  # the least of two
    assert ok["search_cpu_s"] in ok["search_cpu_s_runs"] and ok["search_cpu_s"] > 0
    assert ok["ops"] >= ok["eqns"] > 100 and ok["layers"] == 1
    assert ok["plan_s"] >= ok["search_s"] >= 0 and ok["trace_s"] > 0 and ok["graph_s"] > 0
    names = [name for name, _, _ in ok["steps"]]  # where the search's time went
    assert names[:2] == ["propagating", "refining, the step's tail solved again exactly"]
    assert "every axis used together, solved exactly" in names
    assert all(t >= 0 and n >= 1 for _, t, n in ok["steps"])
    assert sum(t for _, t, _ in ok["steps"]) <= ok["plan_s"]
    assert "Where sharding_propagation's search time goes at 1 layers" in \
        (tmp_path / "search_time.md").read_text()
    assert math.isfinite(ok["cost"]) and ok["cost"] > 0
    # The objective prices the step's tail reductions a share of one latency each, Plan.cost
    # one whole latency per kind and device group: neither bounds the other on a toy step.
    assert math.isfinite(ok["objective"]) and ok["objective"] > 0
    assert ok["optimal"] is None and ok["gap"] is None
    first, steps = (block.splitlines() for block in
                    (tmp_path / "search_time.md").read_text().split("\n\n")[1:3])
    assert first[0].startswith("| layers | mode |") and len(first) == 2 + 2
    assert len({line.count("|") for line in first}) == 1  # every row has every column
    assert steps[0].startswith("Where sharding_propagation's")  # the steps' table after it


def test_search_time_plans_under_a_memory_budget(tmp_path):
    # Given to the child process as a flag, and to jaxpar.shard there: a budget too small for
    # any plan is refused in the child, whose error becomes the row's.
    for budget, status in (("hardware", "ok"), ("1000", "error")):
        cfg = search_time.Config(**TINY, memory_budget=budget)
        row, = search_time.run([1], ["dynamic_programming"], cfg, 300.0, tmp_path)["rows"]
        assert row["status"] == status, row.get("error")
        assert f"h100-nvlink, memory_budget {budget};" in \
            (tmp_path / "search_time.md").read_text()
    assert "memory_budget=1000 bytes per device" in row["error"]
    with pytest.raises(SystemExit):  # neither bytes nor "hardware": argparse's error
        search_time.main(["--memory-budget", "lots"])


@pytest.mark.parametrize("repeat", [0, 1.5, True])
def test_search_time_rejects_a_bad_repeat(repeat):
    with pytest.raises(ValueError, match="repeat="):
        search_time.run([1], ["sharding_propagation"], search_time.Config(**TINY), 1.0, None,
                        repeat=repeat)


def test_search_time_records_timeouts_and_skips_larger_programs():
    result = search_time.run([1, 2], ["sharding_propagation"], search_time.Config(**TINY), 0.01,
                             None)
    assert [r["status"] for r in result["rows"]] == ["timeout", "skipped"]


def test_search_programs_tiny(tmp_path):
    search_programs.main(["--programs", "scan_grad:1", "--modes", "dynamic_programming",
                          "--out", str(tmp_path)])
    (row,) = json.loads((tmp_path / "search_programs.json").read_text())
    assert row["status"] == "ok", row.get("error")
    assert (row["program"], row["mode"]) == ("scan_grad:1", "dynamic_programming")
    assert row["eqns"] > 0 and row["plan_s"] >= row["search_s"] >= 0
    assert math.isfinite(row["cost"]) and row["cost"] > 0
    assert row["notes"][0].startswith("dynamic_programming: optimal")
    table = (tmp_path / "search_programs.md").read_text().splitlines()
    assert table[0].startswith("8 devices, cpu profile") and table[-1].startswith(
        "| scan_grad:1 | dynamic_programming | ")


@pytest.mark.parametrize("name", ["scan_grad", "scan_forward", "mlp_step"])
def test_search_programs_build_what_they_say(name):
    fn, args = search_programs.program(name, 2)
    eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    loops = [e for e in eqns if e.primitive.name == "scan"]
    assert len(loops) == {"scan_grad": 2, "scan_forward": 1, "mlp_step": 0}[name]
    if name == "mlp_step":  # two layers, no two of one width
        assert [a.shape for a in jax.tree_util.tree_leaves(args[0])] == [
            (72,), (64, 72), (80,), (72, 80)]


@pytest.mark.parametrize("text", ["scan:2", "scan_grad", "scan_grad:0", "mlp_step:x"])
def test_search_programs_refuse_a_bad_program(text):
    with pytest.raises(argparse.ArgumentTypeError, match="write NAME:N"):
        search_programs.parse_program(text)


@pytest.mark.parametrize("notes,want", [
    (["dynamic_programming: optimal over the plans whose repeated layers agree"],
     {"optimal": True, "gap": 0.0}),
    (["dynamic_programming: optimal (ilp, 1.20 s)"], {"optimal": True, "gap": 0.0}),  # before
    (["dynamic_programming: stopped at gap 2.5% (ilp, 60.00 s)"],
     {"optimal": False, "gap": 0.025}),
    (["dynamic_programming: stopped at gap inf% (ilp, 9.00 s)"],
     {"optimal": False, "gap": math.inf}),
    (["carried state: 3 outputs"], {"optimal": None, "gap": None}),
])
def test_search_time_reads_optimality_notes(notes, want):
    assert search_time._optimality(notes) == want


def test_search_gap_tiny(tmp_path):
    result = search_gap.run(["mlp"], "tiny", ["8"], ["h100-nvlink"], ["default", "speed"],
                            tmp_path)
    saved = json.loads((tmp_path / "search_gap.json").read_text())
    assert saved == json.loads(json.dumps(result))
    assert [r["objective"] for r in saved["rows"]] == ["default", "speed"]
    for row in saved["rows"]:
        # the exact search's plan is optimal under the objective both are scored with
        assert row["recursive_programming"] >= row["dynamic_programming"] * (1 - 1e-9) > 0
        assert row["ratio"] == row["recursive_programming"] / row["dynamic_programming"]
    assert saved["summary"]["cases"] == 2
    table = (tmp_path / "search_gap.md").read_text()
    assert "| model | mesh |" in table and "within 5%:" in table


def test_memory_budget_tiny(tmp_path):
    result = memory_budget.run(["mlp"], "tiny", list(memory_budget.MODES), [0.8, 0.01],
                               "h100-nvlink", tmp_path)
    saved = json.loads((tmp_path / "memory_budget.json").read_text())
    assert saved == json.loads(json.dumps(result))
    by = {(r["mode"], r["fraction"]): r for r in saved["rows"]}
    for mode in memory_budget.MODES:
        met, refused = by[(mode, 0.8)], by[(mode, 0.01)]
        # (its modelled time may come out below the free plan's: the searches minimise the
        # objective, which weighs memory)
        assert met["met"] and met["peak"] <= 0.8 and met["time"] > 0
        assert not refused["met"] and "memory_budget=" in refused["error"]
        if mode == "dynamic_programming":
            # Its unbudgeted plan is the optimum with the tail's reductions priced a share of
            # one latency each (its tables; then solved again once over fewer device groups);
            # the objective here pays one whole latency per group, as Plan.cost does, under
            # which a budgeted plan can score a little less (0.994 here).
            assert met["objective"] >= 0.99
        # the compiled program's bytes beside the model's, as multiples of the same peak
        assert met["compiled"] > 0 and met["free_compiled"] > 0
        assert saved["summary"][mode] == {"cases": 2, "met": 1, "mean_time": met["time"],
                                          "mean_objective": met["objective"],
                                          "compiled_over_budget": [met["compiled"] / 0.8]}
    table = (tmp_path / "memory_budget.md").read_text()
    assert "| mlp | dynamic_programming | 0.8 | yes |" in table and "met 1 of 2" in table
    assert "compiled over modelled peak: mlp" in table


def test_reshard_accuracy_tiny(tmp_path):
    # Every pair of a rank-1 array's specs on 4 x 2 devices: the model has each of them right,
    # d0's 4 pieces to d1's 2 included (renumbered, then gathered in pairs).
    assert reshard_accuracy.main(["--cases", "4x2:8", "--pairs", "0", "--out",
                                  str(tmp_path)]) == 0
    (result,) = json.loads((tmp_path / "reshard_accuracy.json").read_text())["results"]
    assert result["specs"] == 5 and result["summary"]["pairs"] == 20
    assert result["summary"]["agree"] == 20 and result["summary"]["error"] < 1e-9
    row = next(r for r in result["rows"] if (r["src"], r["dst"]) == ("[d0]", "[d1]"))
    assert row["measured"] == {"collective-permute": 8, "all-gather": 16} == row["predicted"]
    # and the mesh axes each runs over (analysis.collective_axes), which decide its time
    # across nodes: all 20 pairs on XLA's (18 before comm._regathered)
    assert row["links"]["measured"] == {"collective-permute over d0+d1": 8,
                                        "all-gather over d0": 16} == row["links"]["predicted"]
    assert result["summary"]["links"] == 20
    assert "| 4x2:8 | 5 | 20 | 20 (100%) | 20 (100%) |" in (
        tmp_path / "reshard_accuracy.md").read_text()


def test_reshard_accuracy_prices_a_splat_as_one(tmp_path):
    # --splat reshards jnp.zeros: XLA makes its pieces where they are needed, so [d0] -> [d1]
    # moves nothing (any array's is a permute and a gather), as comm.of_splat prices it.
    assert reshard_accuracy.main(["--splat", "--cases", "4x2:16", "--pairs", "0", "--out",
                                  str(tmp_path)]) == 0
    (result,) = json.loads((tmp_path / "reshard_accuracy.json").read_text())["results"]
    assert result["splat"] and result["summary"]["agree"] == result["summary"]["pairs"] == 20
    row = next(r for r in result["rows"] if (r["src"], r["dst"]) == ("[d0]", "[d1]"))
    assert row["measured"] == {} == row["predicted"]
    assert "priced as a splat" in (tmp_path / "reshard_accuracy.md").read_text()


def test_reshard_accuracy_seed_draws_another_sample(tmp_path):
    # --seed picks which pairs a sample holds (the rules are checked on pairs they were not
    # fitted on so); the same seed, the same pairs.
    def pairs(seed: int, out: str) -> list[tuple[str, str]]:
        assert reshard_accuracy.main(["--cases", "4x2:8", "--pairs", "4", "--seed", str(seed),
                                      "--out", str(tmp_path / out)]) == 0
        (result,) = json.loads((tmp_path / out / "reshard_accuracy.json").read_text())[
            "results"]
        assert result["seed"] == seed and result["summary"]["pairs"] == 4
        return [(r["src"], r["dst"]) for r in result["rows"]]
    assert pairs(0, "a") == pairs(0, "b") != pairs(1, "c")


def test_reshard_accuracy_leaves_out_specs_that_do_not_divide_the_shape(tmp_path):
    # A rank-1 array of 4 on 4 x 2 devices: d0+d1 and d1+d0 cut it 8 ways and are left out
    # (the benchmark compiled them before and died in JAX's IndivisibleError).
    assert reshard_accuracy.main(["--cases", "4x2:4", "--pairs", "0", "--out",
                                  str(tmp_path)]) == 0
    (result,) = json.loads((tmp_path / "reshard_accuracy.json").read_text())["results"]
    assert result["specs"] == 3 and result["unfit"] == 2 and result["summary"]["pairs"] == 6
    assert "4x2:4: 2 specs left out" in (tmp_path / "reshard_accuracy.md").read_text()


@pytest.mark.parametrize("case, says", [
    ("4x2", "give MESH:SHAPE"), ("4x2:8,x", "give MESH:SHAPE"), ("0x2:8", "all positive"),
    ("4x4:16", "the mesh needs 16 CPU devices and JAX has 8")])
def test_reshard_accuracy_refuses_a_bad_case_before_compiling(tmp_path, case, says):
    # A mesh larger than the devices JAX started with (the tests' 8) is refused by name; a
    # fresh process gets as many as the largest mesh asks (ensure_devices).
    with pytest.raises(ValueError, match=f"--cases '{case}'.*{says}"):
        reshard_accuracy.main(["--cases", "4x2:8", case, "--out", str(tmp_path)])
    assert not (tmp_path / "reshard_accuracy.json").exists()


@pytest.mark.parametrize("devices, baselines, says", [
    (16, ["data_parallel"], "the hand-written layouts are for 8 devices"),
    (16, [], "JAX has 8 CPU devices"), (0, [], "give a number of simulated CPU devices")])
def test_gpt_plans_other_device_counts_are_checked_before_planning(tmp_path, devices,
                                                                   baselines, says):
    # --devices N plans the automatic modes on make_mesh(N) in a fresh process; the baselines
    # are 8-device layouts, and a JAX started with fewer devices (the tests' 8) is named.
    cfg = gpt_plans.Config(layers=1, **TINY, devices=devices)
    with pytest.raises(ValueError, match=f"--devices {devices}.*{says}"):
        gpt_plans.run(cfg, ["recursive_programming"], baselines, ["jit"], tmp_path)
    assert not (tmp_path / "gpt_plans.json").exists()


def test_gpt_plans_mesh_shape_must_match_the_devices(tmp_path, capsys):
    # --mesh 2x8 plans on make_mesh((2, 8)); a --devices that disagrees, or a shape that is no
    # shape, is refused before anything is traced.
    cfg = gpt_plans.Config(layers=1, **TINY, devices=8, mesh=(2, 8))
    with pytest.raises(ValueError, match="--mesh 2x8 has 16 devices and --devices is 8"):
        gpt_plans.run(cfg, ["recursive_programming"], [], ["jit"], tmp_path)
    with pytest.raises(SystemExit):
        gpt_plans.main(["--mesh", "2xa", "--out", str(tmp_path)])
    assert "'2xa': give the mesh's axis sizes joined by 'x'" in capsys.readouterr().err
    assert not (tmp_path / "gpt_plans.json").exists()


def test_gpt_plans_layouts_split_a_small_batch_as_far_as_it_divides(tmp_path):
    # A batch of 4 on 8 devices failed every data parallel and FSDP baseline (IndivisibleError
    # in the harness): the batch now takes the leading axes whose sizes it divides.
    from jax.sharding import PartitionSpec as P

    assert gpt_plans.data_parallel("tokens", (16, 8)) == P(("d0", "d1", "d2"), None)
    assert gpt_plans.data_parallel("tokens", (4, 8)) == P(("d0", "d1"), None)
    assert gpt_plans.fsdp("targets", (2, 8)) == P(("d0",), None)
    assert gpt_plans.data_parallel("tokens", (3, 8)) == P(None, None)
    assert gpt_plans.megatron("tokens", (8, 8)) == P(("dp",), None)
    assert gpt_plans.megatron("tokens", (2, 8)) == P(None, None)
    cfg = gpt_plans.Config(layers=1, **(TINY | {"batch": 4}))
    result = gpt_plans.run(cfg, [], list(gpt_plans.BASELINES), ["jit"], tmp_path)
    assert [r["status"] for r in result["rows"]] == ["ok"] * 3, result["rows"]
    dp = result["rows"][0]
    assert set(dp["measured"]) == {"all-reduce"}  # the gradients, as at a batch 8 divides
