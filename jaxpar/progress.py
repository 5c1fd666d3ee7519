"""What jaxpar is doing, shown on the terminal while it plans or compiles: one progress line.

Planning a deep model takes seconds (a 48-layer GPT step: 2 to 11 s by search mode) and its
first compile longer. A user at a terminal then sees the stage and the step it is at, with a
bar where the number of steps is known, rather than silence:

  ⠏ planning step · searching (recursive_programming) · axis d1, pass 2 of 2 ━━━━╺━━━━ 6/13 4.5 s

The line appears only once the work has run DELAY seconds (a quick plan shows nothing), goes
to stderr, and is erased when the work ends. JAXPAR_PROGRESS decides whether it shows: "1"
always (where stderr is no terminal, a log file or a CI job's output, as plain lines: one per
step, and one when the work ends), "0" never; unset, when stderr is a terminal, the "jaxpar"
logger is not at debug level (recursive_programming's decisions are logged there: the log is the
progress then) and this is the first process of a multi-process run (the others plan the same
program at the same time).

Code drawing its own live display (a training loop's progress bar, whose first step plans and
compiles) keeps jaxpar's line off it with `with progress.quiet(): ...`.

The same calls time the work: under `with progress.timed() as t: ...` nothing shows, and
t.seconds holds the wall time of every stage and step by its path (benchmarks/search_time.py
reports where each search's time goes so).

Library code reports through three calls, which cost next to nothing when nothing is shown:

    with progress.activity("planning train_step"):   # the outermost owns the line; one
        with progress.stage("tracing"):              # inside another becomes a stage of it
            ...
        with progress.stage("searching", total=12):
            progress.step("axis d0, pass 1")         # the stage's next step begins
            ...
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import jax
from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, Task, TextColumn
from rich.text import Text

ENV = "JAXPAR_PROGRESS"
DELAY = 0.5  # seconds of work before the line appears

_current: contextvars.ContextVar[_Activity | _Quiet | _Timer | None] = contextvars.ContextVar(
    "jaxpar_progress", default=None)
_clock = time.perf_counter  # what timed() reads (tests replace this)


def _console() -> Console:
    """The console the line goes to (tests replace this)."""
    return Console(stderr=True)


def enabled(console: Console) -> bool:
    """Whether a line shows on `console`, from JAXPAR_PROGRESS (see the module doc).

    Raises:
      ValueError: JAXPAR_PROGRESS is set to something other than "0" or "1".
    """
    raw = os.environ.get(ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{ENV}={raw!r}: set it to 1 (always show jaxpar's progress line), "
                         "0 (never), or leave it unset (show it on a terminal).")
    if raw:
        return raw == "1"
    return (console.is_terminal and not logging.getLogger("jaxpar").isEnabledFor(logging.DEBUG)
            and jax.process_index() == 0)


@contextlib.contextmanager
def activity(title: str) -> Iterator[None]:
    """One piece of long work (planning or compiling a function). Outermost, it owns the line
    (shown after DELAY seconds, erased on exit); inside another activity it is a stage of it."""
    outer = _current.get()
    if outer is not None:
        with stage(title):
            yield
        return
    console = _console()
    if not enabled(console):
        yield
        return
    act = _Activity(title, console)
    token = _current.set(act)
    try:
        yield
    finally:
        _current.reset(token)
        act.close()


@contextlib.contextmanager
def stage(name: str, total: int | None = None) -> Iterator[None]:
    """A stage of the current activity (none: nothing shows). name: "" adds none to the line
    (a search counting the steps of the stage its caller named). total: its number of steps
    (step() begins each), for a bar; None: a stage without steps."""
    act = _current.get()
    if act is None:
        yield
        return
    act.push(name, total)
    try:
        yield
    finally:
        act.pop()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Nothing jaxpar does inside shows a line (the caller draws a live display of its own:
    two on one terminal overwrite each other)."""
    token = _current.set(_Quiet())
    try:
        yield
    finally:
        _current.reset(token)


@dataclass
class Timings:
    """What timed() measured. seconds: {path: wall seconds}, a path being the names of the
    activities, stages and steps it ran inside, outermost first, its own last (a stage named
    "" adds none: its steps are its parent's); a stage's or step's time includes what ran
    inside it, and a path met several times (an axis solved again from two plans) adds up,
    `runs` counting them."""

    seconds: dict[tuple[str, ...], float] = field(default_factory=dict)
    runs: dict[tuple[str, ...], int] = field(default_factory=dict)

    def add(self, path: tuple[str, ...], seconds: float) -> None:
        self.seconds[path] = self.seconds.get(path, 0.0) + seconds
        self.runs[path] = self.runs.get(path, 0) + 1

    def under(self, *path: str) -> dict[str, float]:
        """{name: seconds} of the stages and steps directly inside `path`, in the order they
        first ran."""
        n = len(path)
        return {p[n]: t for p, t in self.seconds.items() if len(p) == n + 1 and p[:n] == path}


@contextlib.contextmanager
def timed() -> Iterator[Timings]:
    """Time every stage and step of the work inside (activities become stages of it);
    nothing shows meanwhile. Yields the Timings, filled as the work runs.

    Example:
        >>> with progress.timed() as t:
        ...     plan = jaxpar.shard(step).plan(*args)
        >>> t.under("planning step", "searching (recursive_programming)")
    """
    timer = _Timer(Timings())
    token = _current.set(timer)
    try:
        yield timer.timings
    finally:
        _current.reset(token)
        while timer.stages:  # the work raised: what ran until then
            timer.pop()


def step(name: str) -> None:
    """The current stage's next step begins (the one before it is done)."""
    act = _current.get()
    if act is not None:
        act.begin(name)


@dataclass
class _Stage:
    name: str
    total: int | None
    done: int = -1  # steps begun before the one running (-1: none begun yet)
    now: str = ""   # the step running


@dataclass
class _Activity:
    """The line's state, and the rich Progress that draws it once DELAY has passed (started
    by a timer thread, so a long step that reports nothing still shows)."""

    title: str
    console: Console
    start: float = field(default_factory=time.perf_counter)
    stages: list[_Stage] = field(default_factory=list)

    def __post_init__(self):
        self._lock = threading.Lock()
        self._progress: Progress | None = None
        self._lines: str | None = None  # no terminal: the last line printed (None: none yet)
        self._task = None
        self._closed = False
        self._timer = threading.Timer(DELAY, self._show)
        self._timer.daemon = True
        if DELAY > 0:
            self._timer.start()
        else:  # no delay: shown at once
            self._show()

    def push(self, name: str, total: int | None) -> None:
        with self._lock:
            self.stages.append(_Stage(name, total))
            self._draw()

    def pop(self) -> None:
        with self._lock:
            self.stages.pop()
            self._draw(ended=True)

    def begin(self, name: str) -> None:
        with self._lock:
            if self.stages:
                s = self.stages[-1]
                s.done, s.now = s.done + 1, name
                self._draw()

    def text(self) -> str:
        parts = [self.title]
        for s in self.stages:
            parts += [p for p in (s.name, s.now) if p]
        return " · ".join(parts)

    def bar(self) -> tuple[int | None, int]:
        """(total, completed) of the outermost stage that counts its steps (the exact
        searches recursive_programming runs inside its own steps show as text only)."""
        for s in self.stages:
            if s.total is not None:
                return s.total, max(s.done, 0)
        return None, 0

    def _show(self) -> None:
        with self._lock:
            if self._closed:
                return
            if not self.console.is_terminal:  # a live line would never be drawn: plain lines
                self._line()
                return
            self._progress = Progress(
                SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=20),
                _Count(), _Elapsed(self.start), console=self.console, transient=True,
                redirect_stdout=False, redirect_stderr=False)
            total, completed = self.bar()
            self._task = self._progress.add_task(self.text(), total=total, completed=completed)
            self._progress.start()

    def _line(self, end: bool = False) -> None:
        """No terminal: the line as plain text, printed when it changes (`end`: the work's
        last line, with its time)."""
        text = self.text()
        total, completed = self.bar()
        if total is not None:
            text += f" {completed}/{total}"
        if end:
            text = f"{self.title} · done"
        elif text == self._lines:
            return
        self._lines = text
        elapsed = time.perf_counter() - self.start
        self.console.print(f"{text} ({elapsed:.1f} s)", markup=False, highlight=False,
                           soft_wrap=True)

    def _draw(self, ended: bool = False) -> None:
        """The line as it now stands (`ended`: a stage has just ended, which a plain line
        does not report: the next stage's will)."""
        if self._lines is not None:
            if not ended:
                self._line()
            return
        if self._progress is None:
            return
        total, completed = self.bar()
        p = self._progress
        if total != p.tasks[0].total:  # rich's update cannot take a total away: a new task
            p.remove_task(self._task)
            self._task = p.add_task(self.text(), total=total, completed=completed)
        p.update(self._task, description=self.text(), completed=completed,
                 refresh=True)  # every step drawn

    def close(self) -> None:
        self._timer.cancel()  # (a timer never started cancels too)
        with self._lock:
            self._closed = True
            if self._lines is not None:
                self._line(end=True)
            if self._progress is not None:
                self._progress.stop()
                self._progress = None


class _Quiet:
    """An activity that shows nothing (quiet())."""

    def push(self, name: str, total: int | None) -> None:
        pass

    def pop(self) -> None:
        pass

    def begin(self, name: str) -> None:
        pass


class _Timer:
    """An activity that shows nothing and times each stage and step (timed())."""

    def __init__(self, timings: Timings):
        self.timings = timings
        self.stages: list[list] = []  # per open stage: [its path, its step's name, when that
                                      # step began, when the stage began]

    def _path(self) -> tuple[str, ...]:
        """The path of what runs now: the innermost stage's, with its step's name."""
        if not self.stages:
            return ()
        path, now = self.stages[-1][0], self.stages[-1][1]
        return path + (now,) if now else path

    def push(self, name: str, total: int | None) -> None:
        now = _clock()
        self.stages.append([self._path() + ((name,) if name else ()), "", now, now])

    def _end_step(self, now: float) -> None:
        path, name, began, _ = self.stages[-1]
        if name:
            self.timings.add(path + (name,), now - began)

    def pop(self) -> None:
        now = _clock()
        self._end_step(now)
        path, _, _, began = self.stages.pop()
        if path and (not self.stages or path != self._path()):  # a stage named "": none
            self.timings.add(path, now - began)

    def begin(self, name: str) -> None:
        if self.stages:
            now = _clock()
            self._end_step(now)
            self.stages[-1][1:3] = [name, now]


class _Count(ProgressColumn):
    """"5/12" when the stage counts its steps, else nothing."""

    def render(self, task: Task) -> Text:
        if task.total is None:
            return Text("")
        return Text(f"{int(task.completed)}/{int(task.total)}", style="progress.download")


class _Elapsed(ProgressColumn):
    """Seconds since the activity began (the line itself appears DELAY later)."""

    def __init__(self, start: float):
        super().__init__()
        self.start = start

    def render(self, task: Task) -> Text:
        return Text(f"{time.perf_counter() - self.start:.1f} s", style="progress.elapsed")
