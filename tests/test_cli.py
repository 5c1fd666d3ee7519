"""The `jaxpar` command line: plan, explain, demo, --help, and clean errors (exit status 2)."""

import json
import math
import os
from pathlib import Path

import pytest

from jaxpar import cli, demo

REPO = Path(__file__).parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
SUBCOMMANDS = ("demo", "plan", "explain", "launch", "calibrate")


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_no_command_is_a_usage_error_that_lists_every_subcommand(capsys):
    # It printed the help and exited 0, as if something had run.
    status, out, err = _main(capsys)
    assert status == 2 and not out
    for name in SUBCOMMANDS:
        assert f"    {name}" in err
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0 and "    demo" in capsys.readouterr().out


def test_calibrate_hands_its_arguments_to_jaxpar_calibrate(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["calibrate", "--help"])
    assert done.value.code == 0
    assert "jaxpar calibrate" in capsys.readouterr().out


def test_unknown_arguments_are_refused(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["plan", str(CONFIGS[0]), "--devicez", "4"])
    assert done.value.code == 2
    assert "--devicez" in capsys.readouterr().err


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_plan_prints_the_plan_memory_and_time(capsys, config):
    status, out, err = _main(capsys, "plan", str(config))
    assert status == 0, err
    assert "planned only (abstract mesh)" in out
    assert "per device (modeled): compute" in out and "peak memory" in out
    assert "step time" in out and "arguments" in out


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_plan_for_64_devices_as_json_then_explain(capsys, tmp_path, config):
    saved = tmp_path / "plan.json"
    status, out, err = _main(capsys, "plan", str(config), "--devices", "64", "--json",
                             "--out", str(saved))
    assert status == 0, err
    summary = json.loads(out)
    assert tuple(summary) == cli.PLAN_JSON_KEYS
    assert summary["devices"] == 64 == math.prod(summary["mesh"]["sizes"])
    assert summary["config"] == str(config) and summary["cost"]["total_s"] > 0
    assert summary["parameters"] and summary["ops"] and summary["mode"]
    status, out, err = _main(capsys, "explain", str(saved))
    assert status == 0, err
    assert "modeled per device" in out and "predicted collectives" in out
    assert f"logical mesh: {summary['layout']}" in out


def test_explain_prints_each_plan_of_a_file_holding_several(capsys, tmp_path):
    # An AutoParallel strategy file written for two argument signatures holds two plans; it
    # was "not a jaxpar plan file" to `jaxpar explain` and Plan.load.
    import jax.numpy as jnp

    import jaxpar
    from jaxpar.plan import save_plans

    f = jaxpar.shard(lambda x: jnp.tanh(x) @ x.T)
    path = tmp_path / "plans.json"
    save_plans([f.plan(jnp.ones((16, 8))), f.plan(jnp.ones((32, 8)))], path)
    status, out, err = _main(capsys, "explain", str(path))
    assert status == 0, err
    assert "plan 1 of 2" in out and "plan 2 of 2" in out and out.count("modeled per device") == 2
    with pytest.raises(ValueError, match="holds 2 plans, one per argument signature.*load_plans"):
        jaxpar.Plan.load(path)

def test_plan_overrides_mode_and_hardware(capsys):
    config = REPO / "configs" / "mlp_data_parallel.yaml"
    status, out, err = _main(capsys, "plan", str(config), "--mode", "recursive_programming",
                             "--hardware", "h100-nvlink", "--json")
    assert status == 0, err
    summary = json.loads(out)
    assert (summary["mode"], summary["search_mode"], summary["hardware"]) == (
        "recursive_programming", "recursive_programming", "h100-nvlink")


@pytest.mark.parametrize("text, match", [
    ("model: {name: mlp, sizes: [8, 8]}\ntrian: {batch_size: 8}\n", "unknown key 'trian'"),
    ("model: {name: mlp, sizes: [8, 8]}\ntrain: {optimizer: lamb}\n", "train.optimizer='lamb'"),
    ("train: {batch_size: 8}\nparallel: {parallel_mode: 2}\n", "no 'model:' block"),
    ("model: {name: gpt}\n", "parallel_mode is 'stand_alone'"),
    ("model: {name: gpt}\nparallel: {parallel_mode: 2}\nmesh: 0\n", "mesh=0"),
    ("model: {name: gpt\n", "not valid YAML"),
])
def test_bad_config_files_exit_2_with_one_line(capsys, tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    status, out, err = _main(capsys, "plan", str(path))
    assert status == 2 and out == ""
    assert err.startswith(f"jaxpar plan: error: {path}") and match in err
    assert "Traceback" not in err and err.count("\n") == 1


def test_missing_files_exit_2(capsys, tmp_path):
    status, _, err = _main(capsys, "plan", str(tmp_path / "none.yaml"))
    assert status == 2 and "no such file" in err
    (tmp_path / "x.json").write_text("{}")
    status, _, err = _main(capsys, "explain", str(tmp_path / "x.json"))
    assert status == 2 and "not a jaxpar plan file" in err


def test_plan_refuses_an_out_path_it_cannot_write_before_planning(capsys, tmp_path):
    status, out, err = _main(capsys, "plan", str(CONFIGS[0]), "--out",
                             str(tmp_path / "missing" / "plan.json"))
    assert status == 2 and out == ""  # nothing planned: it had planned, then failed to save
    assert err.startswith("jaxpar plan: error: --out") and "does not exist" in err


def test_plan_refuses_full_with_json_before_planning(capsys):
    # --full was ignored silently beside --json
    status, out, err = _main(capsys, "plan", str(CONFIGS[0]), "--json", "--full")
    assert status == 2 and out == "" and "--full prints the per-op table" in err


def test_plan_piped_into_a_reader_that_stops_early_ends_quietly(tmp_path):
    """`jaxpar plan cfg --json | head -1` ended "jaxpar plan: error: [Errno 32] Broken pipe"
    with status 2, as if the config were bad."""
    import subprocess
    import sys

    argv = ["plan", str(CONFIGS[0]), "--json"]
    code = f"import sys; from jaxpar import cli; sys.exit(cli.main({argv!r}))"
    run = subprocess.run(["bash", "-c", f"set -o pipefail; {sys.executable} -c \"{code}\" | true"],
                         capture_output=True, text=True, timeout=300)  # true reads nothing
    assert run.returncode == 1 and "Broken pipe" not in run.stderr, run.stderr
    assert "error" not in run.stderr


def test_plan_names_an_empty_hardware_or_out(capsys):
    # Both were ignored: the plan ran on cpu, and saved nothing.
    status, out, err = _main(capsys, "plan", str(CONFIGS[0]), "--hardware", "")
    assert status == 2 and "hardware='': no such profile" in err
    status, out, err = _main(capsys, "plan", str(CONFIGS[0]), "--out", "")
    assert status == 2 and err.startswith("jaxpar plan: error: --out ''") and out == ""


def test_demo_quick_trains_like_one_device(capsys):
    status, out, err = _main(capsys, "demo", "--quick", "--steps", "3")
    assert status == 0, out + err
    for section in ("1. the plan", "2. predicted collectives", "3. against hand-written",
                    "4. 3 training steps"):
        assert section in out
    assert "data parallel" in out and "Megatron" in out and "dp4 x tp2" in out
    assert "PASS: sharded training loss matches single-device jax.jit" in out
    assert "FAIL" not in out


@pytest.mark.parametrize("given,want", [(None, "cpu"), ("cuda", "cuda,cpu"),
                                         ("cuda,cpu", "cuda,cpu"), ("", "")])
def test_demo_keeps_the_cpu_platform_on_an_accelerator_machine(monkeypatch, given, want):
    # The demo runs on simulated CPU devices; on a GPU machine whose environment names its
    # platform (JAX_PLATFORMS=cuda) it adds the CPU rather than fail for want of 8 devices.
    if given is None:
        monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    else:
        monkeypatch.setenv("JAX_PLATFORMS", given)
    monkeypatch.setenv("XLA_FLAGS", "")
    updates = []
    monkeypatch.setattr(demo.jax.config, "update", lambda *a: updates.append(a))
    demo.ensure_devices(8)
    assert os.environ["JAX_PLATFORMS"] == want
    assert updates == ([] if want == given else [("jax_platforms", want)])
    assert "--xla_force_host_platform_device_count=8" in os.environ["XLA_FLAGS"]


@pytest.mark.parametrize("n,error", [("x", TypeError), (True, TypeError), (2.5, TypeError),
                                     (0, ValueError), (-3, ValueError)])
def test_ensure_devices_refuses_a_count_xla_cannot_take(monkeypatch, n, error):
    # Written into XLA_FLAGS unchecked, these killed the process at JAX's start ("x": XLA's
    # fatal flag error) or failed there with XLA's own words (0, -3).
    monkeypatch.setenv("XLA_FLAGS", "")
    with pytest.raises(error, match=rf"ensure_devices\(n={n!r}\)"):
        demo.ensure_devices(n)
    assert os.environ["XLA_FLAGS"] == ""


def test_demo_refuses_bad_arguments(capsys):
    status, _, err = _main(capsys, "demo", "--quick", "--steps", "0")
    assert status == 2 and "steps=0" in err
    status, _, err = _main(capsys, "demo", "--quick", "--hardware", "abacus")
    assert status == 2 and "abacus" in err


def test_loss_curves_must_agree_at_every_step():
    assert demo.losses_match([2.0, 1.0], [2.0, 1.00001]) == (True, pytest.approx(1e-5, rel=1e-3))
    ok, worst = demo.losses_match([2.0, 1.0], [2.0, 1.001])
    assert not ok and worst == pytest.approx(1e-3, rel=1e-3)
    assert not demo.losses_match([float("nan")], [1.0])[0]
    with pytest.raises(ValueError, match="equally long"):
        demo.losses_match([1.0], [1.0, 2.0])


def test_a_mismatch_exits_1(capsys, monkeypatch):
    class Mismatch:
        def __init__(self, *args):
            pass

        def run(self, steps):
            return False

    monkeypatch.setattr(demo, "_Demo", Mismatch)
    status, out, _ = _main(capsys, "demo", "--quick")
    assert status == 1


@pytest.mark.parametrize("env,cpus,want", [
    ({"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}, 4,
     "the environment fixes the CPU device count to 4 (XLA_FLAGS's "
     "--xla_force_host_platform_device_count=4); unset it or set it to at least 8."),
    ({"JAX_NUM_CPU_DEVICES": "2"}, 2,  # JAX takes it over XLA_FLAGS's count (conftest's 8)
     "the environment fixes the CPU device count to 2 (JAX_NUM_CPU_DEVICES=2); unset it or set "
     "it to at least 8."),
    ({"XLA_FLAGS": ""}, 4, "Run it in a fresh process (`jaxpar demo`)"),  # JAX started earlier
])
def test_too_few_demo_devices_name_what_fixed_their_count(env, cpus, want, monkeypatch, capsys):
    # A fresh `jaxpar demo` under XLA_FLAGS=--xla_force_host_platform_device_count=4 was told
    # to run in a fresh `jaxpar demo`: ensure_devices leaves a count in the environment alone.
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    some = demo.jax.devices("cpu")[:cpus]
    monkeypatch.setattr(demo.jax, "devices", lambda *platform: some)
    status, _, err = _main(capsys, "demo", "--quick")
    assert status == 2 and err.count("\n") == 1
    assert err.startswith(f"jaxpar demo: error: the demo needs 8 CPU devices; JAX has {cpus}")
    assert want in err


def test_the_op_table_shows_modelled_time_not_the_search_score(monkeypatch):
    # Its "modeled cost" column summed the search's scores (memory weighed in): one matmul
    # row of a replicated MLP read 802 us for a 371 us step. Ops inside a loop are timed in
    # the loop's row, not twice.
    import jax

    import jaxpar
    from jaxpar.run_config import load_run_config, plan_run

    monkeypatch.setattr(cli, "fmt_seconds", repr)
    with pytest.warns(UserWarning, match="does not divide into 3 devices"):  # replicated
        plan = plan_run(load_run_config(REPO / "configs" / "mlp_data_parallel.yaml"),
                        devices=3).plan
    table = cli._ops_table(plan, top=100)
    assert table.columns[-1].header == "modeled time"
    times = [float(t) for t in table.columns[-1]._cells]
    assert sum(times) == pytest.approx(plan.cost.compute_s + plan.cost.comm_s, rel=1e-6)

    def scanned(w, x):
        return jax.lax.scan(lambda h, wi: (jax.numpy.tanh(h @ wi), None), x, w)[0]

    plan = jaxpar.shard(scanned).plan(jax.ShapeDtypeStruct((4, 64, 64), "float32"),
                                      jax.ShapeDtypeStruct((32, 64), "float32"))
    table = cli._ops_table(plan, top=100)
    rows = dict(zip(table.columns[0]._cells, table.columns[-1]._cells, strict=True))
    assert float(rows["dot_general"]) == 0.0 and float(rows["scan"]) > 0  # the body's
    assert table.caption == "ops inside a loop or cond: timed in its row"


def test_a_peak_over_the_devices_memory_is_said_to_not_fit():
    # "peak memory 281 GB of 80 GB" was printed as any other figure
    import jax

    import jaxpar

    plan = jaxpar.shard(lambda x: x * 2).plan(jax.ShapeDtypeStruct((1024, 1024), "float32"))
    peak = plan.cost.peak_memory_bytes
    assert "does not fit" not in cli.cost_text(plan, peak)
    text = cli.cost_text(plan, peak / 2)
    assert f"of {cli.fmt_bytes(peak / 2)}; step time" in text
    assert "the peak is over the device's" in text and "memory_budget: hardware" in text
