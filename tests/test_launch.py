"""`jaxpar launch` and `jaxpar.init()`: real multi-process runs on CPU devices.

The scripts the launches run are in tests/multiprocess/. Launches that need no signal to the
launcher run in this process (launch()); the others start `python -m jaxpar launch`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar import cli
from jaxpar.analysis import collective_ops
from jaxpar.distributed import ENV_NUM_PROCESSES, init, launch_environment
from jaxpar.launch import LaunchConfig, _Launch, launch
from jaxpar.mesh import abstract_mesh

SCRIPTS = Path(__file__).parent / "multiprocess"
REPO = Path(__file__).parent.parent


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxpar", "launch", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(pid_dir.glob("rank_*.pid"))]


def _assert_all_gone(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _train_step_module():
    spec = importlib.util.spec_from_file_location("train_step", SCRIPTS / "train_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- acceptance: 2 processes x 4 devices train like 1 process x 8 devices --------------------


def test_two_processes_train_like_one_process(tmp_path):
    out = tmp_path / "result.npz"
    proc = _cli("-n", "2", "--devices-per-process", "4",
                str(SCRIPTS / "train_step.py"), str(out))
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout + stderr
    for rank in (0, 1):
        assert f"[rank {rank}] step 1 loss" in stdout, stdout
    multi = np.load(out)
    assert (int(multi["processes"]), int(multi["devices"])) == (2, 8)

    ts = _train_step_module()
    f = ts.sharded_step()  # the same program in this process, on its 8 devices
    w1, w2, x, y, lr = ts.problem()
    losses = []
    for _ in range(ts.STEPS):
        w1, w2, loss = f(w1, w2, x, y, lr)
        losses.append(float(loss))
    np.testing.assert_allclose(multi["losses"], losses, rtol=1e-5)
    np.testing.assert_allclose(multi["w1"], np.asarray(w1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(multi["w2"], np.asarray(w2), rtol=1e-5, atol=1e-7)
    _, _, unsharded = jax.jit(ts.step)(*ts.problem())
    np.testing.assert_allclose(multi["losses"][0], float(unsharded), rtol=1e-5)


def test_train_step_reduces_across_the_process_axis():
    """Mesh (dp=2, tp=4): devices 0-3 are process 0's, 4-7 process 1's. The batch and w1's
    contraction dimension are cut over dp, so some all-reduce spans both processes."""
    ts = _train_step_module()
    f = ts.sharded_step()
    plan = f.plan(*ts.problem())
    assert plan.in_specs == (P("dp", "tp"), P("tp"), P("dp"), P("dp"), P())
    groups = [g for op in collective_ops(f.lower(*ts.problem()).compile())
              if op.kind == "all-reduce" for g in (op.groups or ())]
    assert any(min(g) < 4 <= max(g) for g in groups), groups


# --- failures: the whole launch ends within seconds, naming the rank --------------------------


@pytest.mark.parametrize("mode, status, message", [
    ("exit", 3, "rank 1 exited with status 3"),
    ("kill", 128 + signal.SIGKILL, "rank 1 was killed by SIGKILL"),
    ("raise", 1, "rank 1 exited with status 1"),
])
def test_failing_rank_ends_the_launch(tmp_path, capsys, mode, status, message):
    start = time.monotonic()
    code = launch(2, [str(SCRIPTS / "fail.py"), mode, str(tmp_path)], devices_per_process=1)
    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == status, err
    assert f"jaxpar launch: {message}" in err
    assert elapsed < 30
    pids = _pids(tmp_path)
    assert len(pids) == 2
    _assert_all_gone(pids)


def test_blame_names_a_rank_killed_by_a_signal_before_a_peer_that_failed_with_it():
    """Rank 1 killed, rank 0's collective failing with it a moment later: each death is timed
    when a thread of the launcher wakes, and on a loaded machine rank 0's came first ("rank 0
    exited with status 1" for a SIGKILL of rank 1). Deaths that close are not ordered by
    time: the signal names the cause. Far apart, the first death is named whatever it was."""
    from jaxpar.launch import SETTLE_S

    assert _blame({0: 10.0, 1: 10.1}, {0: 1, 1: -signal.SIGKILL}) == \
        ("rank 1 was killed by SIGKILL", 128 + signal.SIGKILL)
    assert _blame({0: 10.0, 1: 10.1}, {0: 1, 1: 3}) == ("rank 0 exited with status 1", 1)
    # Rank 0, the coordinator, raising: JAX aborts its peers (SIGABRT), which were named.
    assert _blame({0: 10.1, 1: 10.0}, {0: 1, 1: -signal.SIGABRT}) == \
        ("rank 0 exited with status 1", 1)
    assert _blame({0: 10.0, 1: 10.0 + 2 * SETTLE_S}, {0: 1, 1: -signal.SIGKILL}) == \
        ("rank 0 exited with status 1", 1)


def test_blame_orders_python_failures_by_the_times_the_ranks_wrote():
    """A rank that fails in Python writes when it did to its lifeline (exact), where the
    launcher's own times are when its threads woke. Rank 1 leaving by os._exit(3) (no time
    written), rank 0's collective raising because of it: on a loaded machine rank 0 was seen
    first, and the launch named it. A death outside Python is now named before a Python
    failure close to it; two Python failures in the order they wrote."""
    assert _blame({0: 10.0, 1: 10.1}, {0: 1, 1: 3}, wrote={0: 9.99}) == \
        ("rank 1 exited with status 3", 3)
    assert _blame({0: 10.0, 1: 10.1}, {0: 1, 1: 2}, wrote={0: 9.99, 1: 9.98}) == \
        ("rank 1 exited with status 2", 2)
    assert _blame({0: 10.1, 1: 10.0}, {0: 1, 1: 2}, wrote={0: 9.97, 1: 9.98}) == \
        ("rank 0 exited with status 1", 1)


def _blame(died: dict[int, float], codes: dict[int, int],
           wrote: dict[int, float] | None = None) -> tuple[str, int]:
    """What _Launch._blame names for ranks whose lifelines closed at `died`, reaped 10 ms
    later with statuses `codes`, the ranks in `wrote` having written that failure time."""
    from jaxpar.launch import _Rank

    run = _Launch(LaunchConfig(2, ("x.py",)))
    run.ranks = [_Rank(i, None, None, died[i], (wrote or {}).get(i)) for i in sorted(died)]
    run._blame([(i, codes[i], died[i] + 0.01) for i in sorted(died)], set())
    return run.failure, run.status


def test_rank_ignoring_sigterm_is_killed_after_the_grace(tmp_path, capsys):
    start = time.monotonic()
    code = launch(2, [str(SCRIPTS / "sleep.py"), str(tmp_path), "stubborn", "exit3-on-rank1"],
                  grace_s=1.0)
    assert code == 3
    assert time.monotonic() - start < 20
    assert "rank 1 exited with status 3; stopping rank(s) 0" in capsys.readouterr().err
    _assert_all_gone(_pids(tmp_path))


def test_sigint_is_forwarded_to_every_rank(tmp_path):
    # A long grace: on a loaded machine a rank may take seconds to print its traceback, and
    # one killed at the end of the grace would print none.
    stdout = _signalled(tmp_path, signal.SIGINT)
    assert stdout.count("KeyboardInterrupt") == 2  # each rank got it and exited


def _signalled(pid_dir: Path, sig: int) -> str:
    """Launch two sleeping ranks, send the launcher `sig` once both are ready, check that it
    stopped every rank and said so; the ranks' output."""
    proc = _cli("-n", "2", "--grace", "60", str(SCRIPTS / "sleep.py"), str(pid_dir))
    ready = [proc.stdout.readline() for _ in range(2)]
    assert sorted(ready) == ["[rank 0] ready\n", "[rank 1] ready\n"]
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 128 + sig, stderr
    assert f"received {signal.Signals(sig).name}; stopped all ranks" in stderr
    _assert_all_gone(_pids(pid_dir))
    return stdout


def _running(pid: int) -> bool:
    """The process lives and is no zombie (one whose parent died waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def test_sighup_is_forwarded_to_every_rank(tmp_path):
    """SIGHUP (the terminal or SSH session closed) killed the launcher before it could stop
    the ranks, which run in sessions of their own and never got it: both ranks ran on."""
    _signalled(tmp_path, signal.SIGHUP)


def test_a_launcher_killed_outright_leaves_no_rank_running(tmp_path):
    """SIGKILL gives the launcher no handler to run: each rank now notices its launcher gone
    and kills its own process group (launch._end_with)."""
    proc = _cli("-n", "2", str(SCRIPTS / "sleep.py"), str(tmp_path))
    ready = [proc.stdout.readline() for _ in range(2)]
    assert sorted(ready) == ["[rank 0] ready\n", "[rank 1] ready\n"]
    pids = _pids(tmp_path)
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 20
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in pids)


def test_signal_while_starting_reaches_the_rank_being_started(tmp_path, monkeypatch, capsys):
    # The handler can run between a rank's Popen and its entry in the launch's list of ranks
    # (so CI once saw: the test above sent SIGINT once both ranks said "ready", rank 1 was
    # missed and slept until the grace ran out). Run the handler in that window.
    start_rank = _Launch._start

    def start_then_interrupted(self, index, env):
        rank = start_rank(self, index, env)
        self._on_signal(signal.SIGINT, None)
        return rank

    monkeypatch.setattr(_Launch, "_start", start_then_interrupted)
    begin = time.monotonic()
    code = _Launch(LaunchConfig(2, (str(SCRIPTS / "sleep.py"), str(tmp_path)), grace_s=60)).run()
    assert time.monotonic() - begin < 30  # not stopped by the grace's SIGKILL
    assert code == 128 + signal.SIGINT
    assert "received SIGINT; stopped all ranks" in capsys.readouterr().err
    assert len(_pids(tmp_path)) <= 1  # no rank is started after the signal
    _assert_all_gone(_pids(tmp_path))


# --- output: prefixed lines, or one log file per rank -----------------------------------------


def test_output_lines_are_prefixed_with_the_rank(capsys):
    assert launch(2, [str(SCRIPTS / "echo.py"), "a", "--flag"], devices_per_process=3) == 0
    lines = capsys.readouterr().out.splitlines()
    for rank in (0, 1):
        mine = [line for line in lines if line.startswith(f"[rank {rank}] ")]
        assert len(mine) == 2, lines
        assert f"[rank {rank}] rank {rank} to stderr" in mine
        argv_line = next(line for line in mine if "argv=" in line)
        assert "argv=['a', '--flag']" in argv_line
        assert f"'JAXPAR_PROCESS_ID': '{rank}'" in argv_line
        assert "'JAXPAR_NUM_PROCESSES': '2'" in argv_line
        assert "'JAXPAR_LOCAL_DEVICES': '3'" in argv_line
        assert "'JAXPAR_COORDINATOR': '127.0.0.1:" in argv_line


def test_log_dir_gets_one_file_per_rank(tmp_path, capsys):
    logs = tmp_path / "logs"
    assert launch(2, [str(SCRIPTS / "echo.py")], port=23456, log_dir=str(logs)) == 0
    assert "[rank" not in capsys.readouterr().out
    assert sorted(p.name for p in logs.iterdir()) == ["rank_0.log", "rank_1.log"]
    for rank in (0, 1):
        text = (logs / f"rank_{rank}.log").read_text()
        assert f"rank {rank} to stderr" in text
        assert "'JAXPAR_COORDINATOR': '127.0.0.1:23456'" in text
        assert "JAXPAR_LOCAL_DEVICES" not in text  # no --devices-per-process: platform default


# --- argument errors, before anything starts --------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["-n", "0", "S"], "-n/num_processes=0 must be between 1 and 4096"),
    (["-n", "2", "--devices-per-process", "0", "S"],
     "--devices-per-process=0 must be between 1 and 4096"),
    (["-n", "2", "--port", "70000", "S"], "--port=70000 must be between 1 and 65535"),
    (["-n", "2", "--grace", "nan", "S"], "--grace/grace_s=nan must be a number of seconds >= 0"),
    (["-n", "2", "--grace", "-1", "S"], "--grace/grace_s=-1.0 must be a number of seconds >= 0"),
    (["-n", "2", "missing.py"], "script 'missing.py' does not exist"),
    (["-n", "2", "."], "script '.' is a directory"),
    (["-n", "2"], "give a script path"),
    (["-n", "2", "-m", "not-a-module"], "give a module name"),
    # each rank printed runpy's traceback, and the launch exited 1
    (["-n", "2", "-m", "no_such_module_xyz.train"],
     "-m no_such_module_xyz.train: no module named 'no_such_module_xyz'"),
])
def test_bad_arguments_fail_before_starting(tmp_path, capsys, argv, message):
    argv = [str(SCRIPTS / "echo.py") if a == "S" else a for a in argv]
    logs = tmp_path / "logs"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["launch", "--log-dir", str(logs), *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not logs.exists()


@pytest.mark.parametrize("address", ["127.0.0.1", "0.0.0.0"])
def test_a_port_something_listens_on_is_a_usage_error(tmp_path, capsys, address):
    # Rank 0's coordinator died of SIGSEGV ("Failed to add port"), naming no port.
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind((address, 0))
        held.listen()
        port = held.getsockname()[1]
        logs = tmp_path / "logs"
        with pytest.raises(SystemExit) as exit_:
            cli.main(["launch", "--log-dir", str(logs), "-n", "2", "--port", str(port),
                      str(SCRIPTS / "echo.py")])
        assert exit_.value.code == 2
        assert f"--port {port} cannot be bound" in capsys.readouterr().err
        assert not logs.exists()


def test_launch_rejects_bad_types():
    with pytest.raises(TypeError, match="num_processes='2' must be an integer"):
        launch("2", [str(SCRIPTS / "echo.py")])
    with pytest.raises(ValueError, match="is not a directory"):
        launch(1, [str(SCRIPTS / "echo.py")], log_dir=str(SCRIPTS / "echo.py"))
    with pytest.raises(TypeError, match="grace_s=True must be a number of seconds"):
        launch(1, [str(SCRIPTS / "echo.py")], grace_s=True)
    # No bound: -n 100000 started processes until the machine gave out.
    with pytest.raises(ValueError, match="num_processes=100000 must be between 1 and 4096"):
        launch(100000, [str(SCRIPTS / "echo.py")])


# --- jaxpar.init() ----------------------------------------------------------------------------


def test_init_without_environment_is_a_quiet_no_op():
    code = ("import jax, jaxpar.distributed as d\n"
            "from jax._src import xla_bridge\n"
            "info = d.init()\n"
            "assert not xla_bridge.backends_are_initialized(), 'init started the backend'\n"
            "print(info.process_id, info.num_processes, jax.distributed.is_initialized(),\n"
            "      info.device_count, d.init().num_processes)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXPAR_")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1", "False", "8", "1"]
    assert done.stderr.strip() == ""


def test_init_reads_explicit_arguments_over_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_NUM_PROCESSES, "2")
    info = init(num_processes=1, auto=True)  # one process after all: nothing to join
    assert (info.process_id, info.num_processes) == (0, 1)
    assert not jax.distributed.is_initialized()


@pytest.mark.parametrize("env, error, match", [
    ({ENV_NUM_PROCESSES: "two"}, ValueError, r"\$JAXPAR_NUM_PROCESSES='two' is not an integer"),
    (launch_environment("127.0.0.1:1", 2, 2), ValueError, "process_id=2 must be below"),
    (launch_environment("localhost", 2, 0), ValueError, "must be 'host:port'"),
    ({ENV_NUM_PROCESSES: "2"}, ValueError, "also needs coordinator_address"),
    # This test process has started JAX's backend: too late to join a launch.
    (launch_environment("127.0.0.1:1", 2, 0), RuntimeError, r"Call jaxpar.init\(\) first"),
])
def test_init_errors(monkeypatch, env, error, match):
    jax.devices()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(error, match=match):
        init()
    assert not jax.distributed.is_initialized()


def test_uneven_local_batches_are_refused_in_every_process(capsys):
    # Before: rank 0 assembled a batch of 8 rows and rank 1 one of 6, and the step compiled for
    # them failed inside gloo (or hung).
    assert launch(2, [str(SCRIPTS / "uneven_batch.py")], devices_per_process=2) == 0
    out = capsys.readouterr().out
    assert out.count("even batch (8, 3) (8,)") == 2
    assert "placed" not in out
    assert ("[rank 0] refused: shard_batch: this process (process 0) passes local inputs "
            "[(4, 3) float32, (4,) int32], process 1 passes [(3, 3) float32, (3,) int32]") in out
    assert ("[rank 1] refused: shard_batch: this process (process 1) passes local inputs "
            "[(3, 3)") in out
    assert "global placed" not in out
    assert out.count("global refused: shard_batch: input 0 is a global jax.Array of shape "
                     "(8, 3) over other processes' devices too") == 2
    assert "[rank 1] one refused: TypeError: shard_batch: input 0 is a str" in out
    assert ("[rank 0] one refused: ValueError: shard_batch: process(es) [1] refused their "
            "batch") in out
    assert "one placed" not in out and out.count("next batch (8, 3)") == 2


def test_a_checkpoint_saved_by_two_processes_is_verified_by_both(tmp_path, capsys):
    # Before checksums, a flipped byte in the data gave rank 1 an orbax error and left rank 0
    # waiting in its restore until the launch was killed.
    assert launch(2, [str(SCRIPTS / "checkpoint.py"), str(tmp_path)], devices_per_process=2) == 0
    out = capsys.readouterr().out
    for rank in (0, 1):
        for line in ("checksums True", "restored equal True", "restored whole here True"):
            assert f"[rank {rank}] {line}" in out
    refused = sorted(line.split("refused: ")[1] for line in out.splitlines() if "refused" in line)
    assert refused == ["names the file", "names the rank that found it"]


def test_a_checkpoint_call_one_rank_refuses_is_refused_by_every_rank(tmp_path):
    # Before: rank 0 went on alone into orbax's barriers; they met rank 1's next call, so its
    # save took rank 1's second save for its own and its restores reported nonsense ("930760747
    # of its files ... were changed") until the launch died of a mismatched barrier.
    proc = _cli("-n", "2", "--devices-per-process", "2",
                str(SCRIPTS / "checkpoint_diverge.py"), str(tmp_path))
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("a rank waited for the other in a collective: " + proc.communicate()[0])
    assert proc.returncode == 0, out + err
    refused = ("refused this call (their errors say why) before anything was written or "
               "read, so this process stops too")
    assert "[rank 1] save refused: TypeError: save_checkpoint: state['name'] is a str" in out
    assert f"[rank 0] save refused: ValueError: save_checkpoint: process(es) [1] {refused}" in out
    assert "[rank 1] restore step refused: FileNotFoundError: restore_checkpoint: no step 2" in out
    assert "[rank 1] restore target refused: ValueError: restore_checkpoint: target['extra']" in out
    assert out.count(f"refused: ValueError: restore_checkpoint: process(es) [1] {refused}") == 2
    for rank in (0, 1):
        for line in ("save again done", "restore done", "both ranks at the end"):
            assert f"[rank {rank}] {line}" in out, out


def test_a_launched_rank_that_never_joined_is_refused(monkeypatch):
    # Before: each rank ran alone on its own devices (every rank training a model of its own).
    mesh = jaxpar.make_mesh(8)  # before the launch environment: fine
    monkeypatch.setenv(ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv("JAXPAR_PROCESS_ID", "1")
    with pytest.raises(RuntimeError, match=r"make_mesh: this process is rank 1 of 2 .*Call "
                                           r"jaxpar.init\(\) at the top"):
        jaxpar.make_mesh(8)
    with pytest.raises(RuntimeError, match=r"shard: this process is rank 1 of 2"):
        jaxpar.shard(lambda x: x, mesh=mesh)
    jaxpar.shard(lambda x: x, mesh=abstract_mesh(8))  # plans only: runs on no devices
    monkeypatch.setenv(ENV_NUM_PROCESSES, "1")  # a launch of one process: nothing to join
    assert jaxpar.make_mesh(8).size == 8


def test_a_launched_script_without_init_fails_naming_the_cause(capsys):
    # Before: each rank built a mesh of its own devices and ran alone, status 0.
    assert launch(2, [str(SCRIPTS / "no_init.py")], devices_per_process=1) != 0
    out, err = capsys.readouterr()  # each rank's lines, prefixed, on the launcher's stdout
    assert "ran alone" not in out
    # Both ranks fail at once; the launcher names whichever it saw first and stops the other.
    assert re.search(r"\[rank ([01])\] RuntimeError: make_mesh: this process is rank \1 of 2", out)
    assert re.search(r"jaxpar launch: rank [01] exited with status 1", err)


def test_init_refuses_another_device_count_once_started():
    jax.devices()
    assert init(local_device_count=8).num_processes == 1  # the count it has: fine
    with pytest.raises(RuntimeError, match="already started with 8 CPU devices"):
        init(local_device_count=4)



def test_a_log_dir_that_cannot_be_made_is_a_usage_error(tmp_path, capsys):
    # Under a file: os.makedirs raised NotADirectoryError with a traceback, exit status 1.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["launch", "--log-dir", str(blocker / "logs"), "-n", "2",
                  str(SCRIPTS / "echo.py")])
    assert exit_.value.code == 2
    assert "cannot be made" in capsys.readouterr().err
