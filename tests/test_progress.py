"""The progress line jaxpar shows while it plans and compiles (jaxpar/progress.py)."""

import io
import logging
import re
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rich.console import Console

import jaxpar
from jaxpar import progress
from jaxpar.models.mlp import init_mlp, make_sgd_step


def _frames(buf: io.StringIO) -> list[str]:
    """Every text the line was drawn with: styles removed, cursor moves end a line."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue())
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "\n", text)
    return [line.strip() for line in re.split(r"[\r\n]", text) if line.strip()]


@pytest.fixture
def debug_log():
    """The "jaxpar" logger at debug level for one test."""
    logger = logging.getLogger("jaxpar")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    yield
    logger.setLevel(level)


@pytest.fixture
def terminal(monkeypatch) -> io.StringIO:
    """A terminal that records what is drawn on it; the line shows at once."""
    buf = io.StringIO()
    monkeypatch.setattr(progress, "_console",
                        lambda: Console(file=buf, force_terminal=True, width=300))
    monkeypatch.setattr(progress, "DELAY", 0.0)
    monkeypatch.delenv(progress.ENV, raising=False)
    return buf


def _sgd_problem():
    params = init_mlp(jax.random.PRNGKey(0), [32, 64, 64, 16])
    x = jax.random.normal(jax.random.PRNGKey(1), (64, 32))
    y = jax.random.normal(jax.random.PRNGKey(2), (64, 16))
    return make_sgd_step(0.1), (params, x, y)


def _no_refresh_thread() -> bool:
    """rich's drawing threads end once the line is stopped (it does not wait for them)."""
    drawing = [t for t in threading.enumerate() if type(t).__name__ == "_RefreshThread"]
    for t in drawing:
        t.join(timeout=5)
    return not any(t.is_alive() for t in drawing)


def test_planning_shows_each_stage_and_step_of_the_search(terminal):
    step, args = _sgd_problem()
    f = jaxpar.shard(step, mesh=jaxpar.make_mesh(4), search_mode="recursive_programming")
    f.plan(*args)
    frames = _frames(terminal)
    for want in ("planning step · tracing", "planning step · building the op graph",
                 "planning step · searching (recursive_programming) · axis d0, pass 1 of 2",
                 "searching (recursive_programming) · axis d1, pass 2 of 2",
                 "placing the carried state",
                 "axis d1 solved again exactly · pricing strategies and resharding",
                 "planning step · building the plan"):
        assert any(want in fr for fr in frames), want
    # The bar counts recursive_programming's steps (the exact searches inside them do not
    # count): 1 + 2 x (2 axes + 1) + 1 + 1 + 2 + 1 = 12 on a 2 x 2 mesh (the two axes solved
    # again once each, from the walk's plan and the lockstep plan at once).
    for k, now in [(0, "pricing the units' cuts"), (1, "axis d0, pass 1 of 2"),
                   (3, "planning the other ops, pass 1 of 2"), (7, "placing the carried state"),
                   (8, "every axis used together, solved exactly"),
                   (9, "axis d1 solved again exactly"), (10, "axis d0 solved again exactly"),
                   (11, "neighbourhood of the largest carried state solved again exactly")]:
        assert any(now in fr and f" {k}/12 " in fr for fr in frames), now
    assert not any("building the plan" in fr and "/12" in fr for fr in frames)  # count gone
    assert _no_refresh_thread()  # the line is gone with the work
    assert progress._current.get() is None


def test_sharding_propagation_shows_its_steps(terminal):
    step, args = _sgd_problem()
    jaxpar.shard(step, mesh=jaxpar.make_mesh(4)).plan(*args)  # the default mode
    frames = _frames(terminal)
    for want in ("propagating", "refining, the step's tail solved again exactly",
                 "every axis used together, solved exactly", "axis d1 solved again exactly",
                 "the step's tail solved again where its reductions wait on one another"):
        assert any(f"searching (sharding_propagation) · {want}" in fr for fr in frames), want
    with progress.timed() as t:
        jaxpar.shard(step, mesh=jaxpar.make_mesh(4)).plan(*args)
    (planning,) = [p for p in t.seconds if len(p) == 1]
    steps = t.under(*planning, "searching (sharding_propagation)")
    assert list(steps)[:3] == ["propagating", "refining, the step's tail solved again exactly",
                               "latency-bound collectives solved again exactly"]
    # the exact searches' own steps are inside the step that runs them
    assert "solving" not in steps and "solving" in t.under(
        *planning, "searching (sharding_propagation)", "every axis used together, solved exactly")


def test_dynamic_programming_shows_its_steps(terminal):
    step, args = _sgd_problem()
    jaxpar.shard(step, mesh=jaxpar.make_mesh(4), search_mode="dynamic_programming").plan(*args)
    frames = _frames(terminal)
    assert any("searching (dynamic_programming) · pricing strategies and resharding" in fr
               for fr in frames)
    assert any("searching (dynamic_programming) · solving" in fr for fr in frames)


def test_the_first_call_shows_the_compile_and_later_calls_nothing(terminal):
    f = jaxpar.shard(lambda x, w: jnp.tanh(x @ w), mesh=jaxpar.make_mesh(8))
    x, w = jnp.ones((16, 8)), jnp.ones((8, 8))
    want = np.tanh(np.ones((16, 8)) @ np.ones((8, 8)))
    np.testing.assert_allclose(f(x, w), want, rtol=1e-6)
    assert any("compiling <lambda> (first call)" in fr for fr in _frames(terminal))
    terminal.truncate(0)
    terminal.seek(0)
    np.testing.assert_allclose(f(x, w), want, rtol=1e-6)
    assert terminal.getvalue() == ""


def test_a_quick_plan_shows_nothing(terminal, monkeypatch):
    monkeypatch.setattr(progress, "DELAY", 60.0)
    step, args = _sgd_problem()
    jaxpar.shard(step, mesh=jaxpar.make_mesh(4)).plan(*args)
    assert terminal.getvalue() == ""
    timers = [t for t in threading.enumerate() if isinstance(t, threading.Timer)]
    for t in timers:  # cancelled with the work, each ends without waiting out the delay
        t.join(timeout=5)
    assert not any(t.is_alive() for t in timers)


def test_a_long_step_that_reports_nothing_shows_once_the_delay_passes(terminal, monkeypatch):
    monkeypatch.setattr(progress, "DELAY", 0.05)
    with progress.activity("waiting"), progress.stage("one long step"):
        time.sleep(0.5)  # (XLA compiling, HiGHS solving: nothing reports meanwhile)
    assert any("waiting · one long step" in fr for fr in _frames(terminal))


@pytest.mark.parametrize("how", ["off", "not a terminal", "debug log", "not process 0"])
def test_nothing_shows_when_switched_off(terminal, monkeypatch, request, how):
    if how == "off":
        monkeypatch.setenv(progress.ENV, "0")
    elif how == "not a terminal":
        monkeypatch.setattr(progress, "_console",
                            lambda: Console(file=terminal, force_terminal=False))
    elif how == "debug log":  # recursive_programming's decisions: the log is the progress
        request.getfixturevalue("debug_log")
    else:  # the other processes of a multi-process run plan the same program at once
        monkeypatch.setattr(jax, "process_index", lambda: 1)
    step, args = _sgd_problem()
    jaxpar.shard(step, mesh=jaxpar.make_mesh(4), search_mode="recursive_programming"
                 ).plan(*args)
    assert terminal.getvalue() == ""


def test_nothing_shows_inside_quiet_even_forced_on(terminal, monkeypatch):
    monkeypatch.setenv(progress.ENV, "1")
    step, args = _sgd_problem()
    with progress.quiet():  # a caller drawing its own live display
        jaxpar.shard(step, mesh=jaxpar.make_mesh(4), search_mode="recursive_programming"
                     ).plan(*args)
    assert terminal.getvalue() == ""
    assert progress._current.get() is None


def test_timed_adds_each_stage_and_step_by_its_path(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(progress, "_clock", lambda: now[0])

    def wait(seconds: float) -> None:
        now[0] += seconds

    with progress.timed() as t:
        with progress.activity("planning f"):  # inside timed(): a stage of it
            with progress.stage("searching", total=3):
                progress.step("pricing")
                wait(1.0)
                for _ in range(2):  # a step met twice adds up
                    progress.step("axis d0")
                    with progress.stage(""):  # adds no name: its steps are the step's
                        progress.step("solving")
                        wait(2.0)
                    wait(0.5)
            wait(0.25)
    searching = ("planning f", "searching")
    assert t.under(*searching) == {"pricing": 1.0, "axis d0": 5.0}
    assert t.runs[searching + ("axis d0",)] == 2
    assert t.under(*searching, "axis d0") == {"solving": 4.0}
    assert t.seconds[searching] == 6.0 and t.seconds[("planning f",)] == 6.25
    assert set(t.seconds) == {("planning f",), searching, searching + ("pricing",),
                              searching + ("axis d0",), searching + ("axis d0", "solving")}
    assert progress._current.get() is None


def test_timed_shows_nothing_and_times_a_real_search(terminal, monkeypatch):
    monkeypatch.setenv(progress.ENV, "1")
    step, args = _sgd_problem()
    f = jaxpar.shard(step, mesh=jaxpar.make_mesh(4), search_mode="recursive_programming")
    start = time.perf_counter()
    with progress.timed() as t:
        f.plan(*args)
    wall = time.perf_counter() - start
    assert terminal.getvalue() == ""
    (planning,) = [p for p in t.seconds if len(p) == 1]
    steps = t.under(*planning, "searching (recursive_programming)")
    assert list(steps)[:2] == ["pricing the units' cuts and links", "axis d0, pass 1 of 2"]
    assert "placing the carried state" in steps and all(s >= 0 for s in steps.values())
    assert sum(steps.values()) <= t.seconds[planning + ("searching (recursive_programming)",)]
    assert t.seconds[planning] <= wall


def test_forced_on_it_shows_off_a_terminal_and_with_a_debug_log(monkeypatch, debug_log):
    monkeypatch.setenv(progress.ENV, "1")
    assert progress.enabled(Console(file=io.StringIO(), force_terminal=False))


def test_forced_on_off_a_terminal_it_prints_plain_lines(monkeypatch):
    # A live line on a log file was never drawn: JAXPAR_PROGRESS=1 2>log left one newline.
    log = io.StringIO()
    monkeypatch.setattr(progress, "_console",
                        lambda: Console(file=log, force_terminal=False, width=300))
    monkeypatch.setattr(progress, "DELAY", 0.0)
    monkeypatch.setenv(progress.ENV, "1")
    step, args = _sgd_problem()
    jaxpar.shard(step, search_mode="recursive_programming").plan(*args)
    lines = log.getvalue().splitlines()
    assert "\x1b" not in log.getvalue()  # no cursor moves or styles
    assert any(re.fullmatch(r"planning \S+ · searching \(recursive_programming\) · axis d0, "
                            r"pass 1 of 2 \d+/\d+ \(\d+\.\d s\)", line) for line in lines), lines
    assert len(lines) == len(set(lines))  # a line only when it changes
    assert re.fullmatch(r"planning \S+ · done \(\d+\.\d s\)", lines[-1])


def test_a_bad_setting_is_a_clear_error_before_tracing(terminal, monkeypatch):
    monkeypatch.setenv(progress.ENV, "yes")

    def never_traced(x):
        raise AssertionError("traced")

    with pytest.raises(ValueError, match=r"JAXPAR_PROGRESS='yes': set it to 1 .*0 .*unset"):
        jaxpar.shard(never_traced, mesh=jaxpar.make_mesh(8)).plan(jnp.ones(8))


def test_an_activity_inside_another_is_one_of_its_stages(terminal):
    with progress.activity("outer"):
        with progress.stage("counted", total=4):
            progress.step("first")
            with progress.activity("inner"):
                with progress.stage("", total=9):  # an inner count does not take the bar
                    progress.step("deep")
                    act = progress._current.get()
                    assert act.text() == "outer · counted · first · inner · deep"
                    assert act.bar() == (4, 0)
            progress.step("second")
            assert act.bar() == (4, 1)
        assert act.text() == "outer"
    assert progress._current.get() is None
    progress.step("outside any activity: nothing happens")


def test_calibration_shows_each_measurement(terminal):
    from jaxpar.calibrate import KINDS, calibrate

    two = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    calibrate(two, quick=True)
    frames = _frames(terminal)
    n = len(KINDS) + 2
    for k, what in enumerate([f"{kind} over x" for kind in KINDS] +
                             ["peak flops", "memory bandwidth"]):
        assert any(f"calibrating 2 devices · {what}" in fr and f"{k}/{n}" in fr
                   for fr in frames), what
