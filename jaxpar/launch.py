"""`jaxpar launch`: start N processes of one script on this machine, like torchrun or msrun.

Before: a script that calls `jaxpar.init()` first. After `launch(...)`: each of N Python
processes ran the script with the environment `init()` reads (coordinator 127.0.0.1:PORT,
process count, its rank, CPU devices per process); their output went to our stdout, each line
prefixed `[rank i] `, or to DIR/rank_i.log. The launch returns 0 only when every rank exited 0.
When one rank fails, the others are stopped at once (SIGTERM, SIGKILL after a grace period),
since a peer blocked in a collective would otherwise wait for JAX's heartbeat timeout. The
rank named is the one that failed first: a rank failing in Python writes the time it did to the
launcher; of deaths too close to order otherwise, one killed by a signal or leaving outside
Python (its peers then fail with a Python error). Every rank runs in its own process group,
which is killed at the end: no process outlives the launch.
"""

from __future__ import annotations

import errno
import os
import queue
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import IO

POLL_S = 0.05
SETTLE_S = 0.5  # after a first failure, how long to wait for an earlier death to be reaped
REAP_S = 5.0    # past that, how long to wait still for a rank seen exiting to be reaped
LIFELINE_ENV = "JAXPAR_LAUNCH_LIFELINE"  # a rank's lifeline descriptor (see _Launch._start)
LAUNCHER_ENV = "JAXPAR_LAUNCHER_PID"     # the launcher's pid: a rank ends when it is gone
DRAIN_S = 10.0  # once every rank is gone, how long their output may take to be relayed (only
                # a process that left the rank's group can hold its pipe open longer)
# Each rank runs its program through _rank_main (see there why), loaded from this file alone:
# importing the jaxpar package would import JAX before the program could configure it (a script
# may set XLA_FLAGS before `import jax`). So this module imports jaxpar only inside functions.
RANK_MAIN = ("import importlib.util as u, sys; "
             f"s = u.spec_from_file_location('_jaxpar_rank', {__file__!r}); "
             "m = sys.modules[s.name] = u.module_from_spec(s); s.loader.exec_module(m); "
             "m._rank_main()")


# As context.MAX_DEVICES (MindSpore's device_num range), without importing JAX here: -n 100000
# started processes until the machine gave out.
MAX_PROCESSES = 4096

@dataclass(frozen=True)
class LaunchConfig:
    """One launch; `program` is what follows the interpreter: [script, args...] or
    ["-m", module, args...]."""

    num_processes: int
    program: tuple[str, ...]
    devices_per_process: int | None = None  # simulated CPU devices per process; None: default
    port: int | None = None                 # coordinator port; None: a free one
    log_dir: str | None = None              # DIR/rank_i.log instead of prefixed stdout
    grace_s: float = 5.0                    # SIGTERM -> SIGKILL delay when stopping ranks


@dataclass
class _Rank:
    index: int
    proc: subprocess.Popen
    reader: threading.Thread | None          # relays its output (None with a log dir)
    died_at: float | None = None             # when its lifeline pipe closed: it was exiting
    failed_at: float | None = None           # when it failed, by its own clock (_rank_main)
    lifeline: threading.Thread | None = None  # watches the lifeline (_watch_lifeline)


def launch(num_processes: int, program: list[str] | tuple[str, ...], *,
           devices_per_process: int | None = None, port: int | None = None,
           log_dir: str | None = None, grace_s: float = 5.0) -> int:
    """Run `python program...` in num_processes processes joined by `jaxpar.init()`.

    Args:
      num_processes: how many processes (ranks) to start, >= 1.
      program: [script.py, args...] or ["-m", module, args...].
      devices_per_process: simulated CPU devices in each process (JAXPAR_LOCAL_DEVICES);
        None keeps the platform's count.
      port: coordinator port on 127.0.0.1; None picks a free one.
      log_dir: write rank i's stdout and stderr to log_dir/rank_i.log instead of prefixing
        lines on stdout.
      grace_s: seconds between SIGTERM and SIGKILL when stopping ranks.

    Returns:
      0 when every rank exited 0; otherwise the first failure's status (128 + signal number
      for a rank killed by a signal), with `jaxpar launch: rank i ...` printed on stderr.

    Example:
      >>> launch(2, ["train.py", "--steps", "10"], devices_per_process=4)
      0
    """
    cfg = LaunchConfig(num_processes, tuple(program), devices_per_process, port, log_dir, grace_s)
    validate(cfg)
    return _Launch(cfg).run()


def validate(cfg: LaunchConfig) -> None:
    """Raise ValueError/TypeError for a launch that cannot start; nothing is started."""
    _check_int("-n/num_processes", cfg.num_processes, 1, MAX_PROCESSES)
    if cfg.devices_per_process is not None:
        _check_int("--devices-per-process", cfg.devices_per_process, 1, MAX_PROCESSES)
    if cfg.port is not None:
        _check_int("--port", cfg.port, 1, 65535)
        try:
            _bind(cfg.port)
        except OSError as err:  # else rank 0's coordinator died of SIGSEGV, naming no port
            raise ValueError(f"--port {cfg.port} cannot be bound ({err.strerror}): another "
                             "program or launch holds it. Pick another, or leave --port out "
                             "for a free one.") from None
    if isinstance(cfg.grace_s, bool) or not isinstance(cfg.grace_s, int | float):
        raise TypeError(f"--grace/grace_s={cfg.grace_s!r} must be a number of seconds.")
    if not cfg.grace_s >= 0:  # NaN too
        raise ValueError(f"--grace/grace_s={cfg.grace_s!r} must be a number of seconds >= 0.")
    _check_program(cfg.program)
    if cfg.log_dir is not None:
        _check_log_dir(cfg.log_dir)


def _check_log_dir(log_dir: str) -> None:
    """A ValueError unless log_dir is a directory, or one that can be made (its nearest
    existing ancestor is a writable directory)."""
    if os.path.exists(log_dir) and not os.path.isdir(log_dir):
        raise ValueError(f"--log-dir {log_dir!r} exists and is not a directory.")
    existing = os.path.abspath(log_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--log-dir {log_dir!r} cannot be made: {existing} is not a writable "
                         "directory. Pass a directory you can write to.")


def free_port() -> int:
    """A TCP port that nothing listens on right now, on any address."""
    return _bind(0)


def _bind(port: int) -> int:
    """Bind a TCP socket at `port` (0: one the system picks) on every address, as JAX's
    coordinator binds it ([::], IPv4 too; IPv4 alone where IPv6 is off), then let it go;
    returns the port. OSError when something holds it (a port in TIME_WAIT does not count:
    the coordinator reuses those)."""
    for family, host in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no such address family here
            continue
        with s:
            if family == socket.AF_INET6:
                try:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                except OSError:
                    pass
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as err:
                if err.errno == errno.EADDRINUSE or family == socket.AF_INET:
                    raise
                continue  # IPv6 present but off: IPv4 alone
            return s.getsockname()[1]
    raise OSError(errno.EAFNOSUPPORT, "no TCP socket can be made here")


def _check_int(name: str, value, least: int, most: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}={value!r} must be an integer.")
    if value < least or (most is not None and value > most):
        bound = f"between {least} and {most}" if most is not None else f">= {least}"
        raise ValueError(f"{name}={value} must be {bound}.")


def _check_program(program: tuple[str, ...]) -> None:
    if not program or not all(isinstance(a, str) for a in program):
        raise ValueError(f"program={list(program)!r}: give a script path (and its arguments), "
                         "e.g. `jaxpar launch -n 2 train.py`, or `-m package.module`.")
    if program[0] == "-m":
        if len(program) < 2 or not all(p.isidentifier() for p in program[1].split(".")):
            raise ValueError(f"-m {program[1] if len(program) > 1 else ''!r}: give a module "
                             "name, e.g. `-m mypackage.train`.")
        top = program[1].split(".")[0]
        if not _importable(top):
            raise ValueError(f"-m {program[1]}: no module named {top!r} (looked from "
                             f"{os.getcwd()} and this Python's path); give a module the ranks "
                             "can import, or the path of a script.")
    elif os.path.isdir(program[0]):
        raise ValueError(f"script {program[0]!r} is a directory; give the path of a Python "
                         "file in it, or `-m package.module`.")
    elif not os.path.isfile(program[0]):
        raise ValueError(f"script {program[0]!r} does not exist (looked from {os.getcwd()}); "
                         "give the path of a Python file.")


def _importable(name: str) -> bool:
    """Whether a rank (`python -c`, started in this directory) finds top-level module `name`:
    in the current directory or where this Python finds it (its path and import hooks, an
    editable install's too), looked up without importing it."""
    from importlib.machinery import PathFinder
    from importlib.util import find_spec

    return PathFinder.find_spec(name, [os.getcwd()]) is not None or find_spec(name) is not None


class _Launch:
    """The running launch: its ranks, their output, and how they end."""

    def __init__(self, cfg: LaunchConfig):
        self.cfg = cfg
        self.ranks: list[_Rank] = []
        self.write_lock = threading.Lock()
        self.failure: str | None = None
        self.status = 0
        self.stop_deadline: float | None = None  # when stopping ranks: SIGKILL after this
        self.signalled: int | None = None        # the first signal the launcher received
        self.pending: list[int] = []             # signals received, not yet forwarded
        self.exits: queue.Queue[tuple[int, int, float]] = queue.Queue()  # (rank, status, when)

    def run(self) -> int:
        previous = self._forward_signals()
        try:
            self._start_all()
            self._watch()
        finally:
            self._kill_groups(signal.SIGKILL)  # leftovers: grandchildren, or a failed start
            self._restore_signals(previous)
            drained = time.monotonic() + DRAIN_S
            for rank in self.ranks:
                rank.proc.wait()
                if rank.reader is not None:
                    rank.reader.join(timeout=max(drained - time.monotonic(), 0.0))
        if self.failure:
            print(f"jaxpar launch: {self.failure}", file=sys.stderr, flush=True)
        return self.status

    def _start_all(self) -> None:
        from jaxpar.distributed import launch_environment

        cfg = self.cfg
        coordinator = f"127.0.0.1:{cfg.port or free_port()}"
        if cfg.log_dir is not None:
            os.makedirs(cfg.log_dir, exist_ok=True)
        for i in range(cfg.num_processes):
            if self.signalled is not None:
                break  # interrupted while starting: start no more; _watch stops the others
            env = os.environ | launch_environment(coordinator, cfg.num_processes, i,
                                                  cfg.devices_per_process)
            self.ranks.append(self._start(i, env | {"PYTHONUNBUFFERED": "1"}))

    def _start(self, index: int, env: dict[str, str]) -> _Rank:
        cmd = [sys.executable, "-c", RANK_MAIN, *self.cfg.program]
        lifeline, child_end = os.pipe()  # the child holds child_end open until it exits
        env = env | {LIFELINE_ENV: str(child_end),  # and writes its failure's time to it
                     LAUNCHER_ENV: str(os.getpid())}
        out = subprocess.PIPE
        if self.cfg.log_dir is not None:
            out = open(os.path.join(self.cfg.log_dir, f"rank_{index}.log"), "wb")
        try:
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, pass_fds=(child_end,),
                                    start_new_session=True)
        finally:
            os.close(child_end)
            if out is not subprocess.PIPE:
                out.close()  # the child has its own copy
        reader = None
        if out is subprocess.PIPE:
            reader = _thread(self._relay, index, proc.stdout)
        rank = _Rank(index, proc, reader)
        rank.lifeline = _thread(self._watch_lifeline, rank, lifeline)
        _thread(self._wait_for, rank)
        return rank

    @staticmethod
    def _watch_lifeline(rank: _Rank, lifeline: int) -> None:
        """Note when the rank starts exiting. Its pipes and sockets close at that moment, so
        peers blocked on it fail right after; the rank itself may be reaped later than they
        are (a process with many threads takes a while to exit). This time says who died
        first, roughly: it is when this thread woke. A rank that failed in Python (an uncaught
        exception, a non-zero exit) wrote the time it did by the machine's monotonic clock
        before it exited (_rank_main): that one is exact."""
        said = b""
        while chunk := os.read(lifeline, 4096):
            said += chunk
        rank.died_at = time.monotonic()
        os.close(lifeline)
        try:
            rank.failed_at = float(said.decode())
        except (UnicodeDecodeError, ValueError):
            pass  # nothing written: the rank died outside Python (os._exit, a signal, a crash)

    def _wait_for(self, rank: _Rank) -> None:
        self.exits.put((rank.index, rank.proc.wait(), time.monotonic()))

    def _relay(self, index: int, pipe: IO[bytes]) -> None:
        """Copy a rank's output to stdout line by line, each line prefixed with its rank."""
        prefix, writable = f"[rank {index}] ", True
        for raw in pipe:  # read to the end even when stdout is gone, so the rank never blocks
            line = raw.decode(errors="replace").rstrip("\r\n")
            with self.write_lock:
                writable = writable and _write(prefix + line + "\n")
        pipe.close()

    def _watch(self) -> None:
        """Wait for every rank; on a failure or a signal, stop the others."""
        running = set(range(len(self.ranks)))
        failed: list[tuple[int, int, float]] = []  # (rank, status, reaped at)
        settled = float("inf")
        while running:
            self._forward_pending()
            try:
                index, code, reaped = self.exits.get(timeout=POLL_S)
            except queue.Empty:
                pass
            else:
                running.discard(index)
                if code != 0 and self.failure is None:
                    failed.append((index, code, reaped))
                    settled = min(settled, time.monotonic() + SETTLE_S)
            if failed and self.failure is None and (not running or time.monotonic() > settled) \
                    and not self._exiting(running, settled):
                self._blame(failed, running)
            if self.stop_deadline is not None and time.monotonic() > self.stop_deadline:
                self._kill_groups(signal.SIGKILL)

    def _exiting(self, running: set[int], settled: float) -> bool:
        """Whether a rank not yet reaped has closed its lifeline (it is exiting: a process
        with many threads, killed, takes a while to be reaped) within REAP_S past the settle
        time: it may be the one that failed first, so _blame waits for its status."""
        return time.monotonic() <= settled + REAP_S and \
            any(self.ranks[i].died_at is not None for i in running)

    def _blame(self, failed: list[tuple[int, int, float]], running: set[int]) -> None:
        """Name the rank that failed first (the others likely failed because of it) and stop
        the ranks still running.

        Each death is timed when a thread of this process wakes (the lifeline closing, the
        rank reaped), which on a loaded machine can be long after it: deaths within SETTLE_S
        of the first are not ordered by those times. Among them a rank killed by a signal is
        named first, as its peers exit with an error once it is gone; then one that left
        with an error status outside Python (os._exit, a crash: its peers' collectives raise
        Python errors once it is gone; a rank of two that called os._exit(3) was seen reaped
        after its peer's exception on a loaded machine); then the ranks that failed in
        Python, in the order of the times they wrote themselves (exact, one clock); and one
        that aborted (SIGABRT) last: JAX aborts a process whose coordinator, rank 0, went
        away, so an error in rank 0 ends its peers with SIGABRT."""
        for i, _, _ in failed:  # reaped, so its lifeline is closed (unless a process it forked
            thread = self.ranks[i].lifeline  # holds it): let the watcher read what it wrote
            if thread is not None:
                thread.join(timeout=SETTLE_S)
        when = {}
        for i, _, reaped in failed:
            rank = self.ranks[i]
            when[i] = rank.failed_at or rank.died_at or reaped

        def likelier(f: tuple[int, int, float]) -> tuple:
            reported = self.ranks[f[0]].failed_at is not None
            return _cause_rank(f[1]), reported, when[f[0]]

        first = min(when.values())
        index, code, _ = min((f for f in failed if when[f[0]] <= first + SETTLE_S),
                             key=likelier)
        self.failure = f"rank {index} {_describe(code)}"
        self.status = code if code > 0 else 128 - code
        if running:
            self.failure += f"; stopping rank(s) {', '.join(map(str, sorted(running)))}"
            self._stop(running)

    def _stop(self, running: set[int]) -> None:
        """SIGTERM the running ranks' process groups now, SIGKILL them after the grace."""
        self.stop_deadline = time.monotonic() + self.cfg.grace_s
        for i in running:
            _signal_group(self.ranks[i].proc.pid, signal.SIGTERM)

    def _kill_groups(self, sig: int) -> None:
        for rank in self.ranks:
            _signal_group(rank.proc.pid, sig)

    def _forward_signals(self) -> dict[int, object]:
        """SIGINT, SIGTERM and SIGHUP (the terminal or SSH session closed) to the launcher go
        to every rank (then we stop them as on failure). The ranks run in sessions of their
        own, so the terminal's SIGHUP reaches the launcher alone; a launcher killed outright
        (SIGKILL) is noticed by each rank itself (_rank_main)."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is None:
                continue
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    def _on_signal(self, sig: int, frame) -> None:
        """Note the signal; _watch forwards it. Forwarding here would miss a rank that is
        started but not yet in self.ranks (this handler can run in the middle of _start_all)."""
        if self.signalled is None:
            self.signalled, self.status = sig, 128 + sig
            self.failure = f"received {signal.Signals(sig).name}; stopped all ranks"
            self.stop_deadline = time.monotonic() + self.cfg.grace_s
        self.pending.append(sig)

    def _forward_pending(self) -> None:
        """Send the signals received so far to every rank; ranks that ignore them (or sit in a
        collective) are killed after the grace period."""
        while self.pending:
            sig = self.pending.pop(0)
            for rank in self.ranks:
                _signal_group(rank.proc.pid, sig)

    @staticmethod
    def _restore_signals(previous: dict[int, object]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _thread(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def _rank_main() -> None:
    """One rank: run sys.argv[1:] as `python ...` would, and on failure leave at once.

    A failing Python program normally still runs its atexit handlers, and JAX's handler waits in
    jax.distributed's shutdown barrier for every other rank (up to five minutes): the launcher
    would see neither the failure nor an exit. So a non-zero exit or an uncaught exception ends
    the process with os._exit right after its traceback is printed.
    """
    lifeline = os.environ.pop(LIFELINE_ENV, None)  # not the program's: its children's fds differ
    launcher = os.environ.pop(LAUNCHER_ENV, None)
    if launcher is not None:
        threading.Thread(target=_end_with, args=(int(launcher),), daemon=True).start()
    code = _run_program(sys.argv[1:])
    if code != 0:
        _report_failure(lifeline, time.monotonic())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _end_with(launcher: int) -> None:
    """A rank's watch on its launcher: once the launcher is gone (killed outright: no handler
    stopped the ranks), the rank and what it started in its process group are killed, so no
    process outlives the launch. The rank is its group's leader (start_new_session); its
    parent changes when the launcher dies."""
    while os.getppid() == launcher:
        time.sleep(0.25)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _report_failure(lifeline: str | None, when: float) -> None:
    """Write the time this rank failed (taken after its traceback, still before it exits and
    its peers can see it gone) to its lifeline, descriptor number `lifeline`, for the
    launcher's _blame: the launcher's own timing of a death is when one of its threads woke,
    late on a loaded machine. CLOCK_MONOTONIC, which time.monotonic reads, is one clock for
    the whole machine."""
    try:
        os.write(int(lifeline), repr(when).encode())
    except (TypeError, ValueError, OSError):
        pass  # not started by the launcher (or its lifeline gone): nothing to tell


def _run_program(program: list[str]) -> int:
    """Run [script, args...] or ["-m", module, args...] as __main__; its exit status."""
    try:
        if program[0] == "-m":
            sys.argv = program[1:]
            runpy.run_module(program[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(program)
            sys.path[0] = os.path.dirname(os.path.abspath(program[0]))
            runpy.run_path(program[0], run_name="__main__")
    except SystemExit as exit_:
        return _exit_status(exit_.code)
    except KeyboardInterrupt as err:
        _print_exception(err)
        return 128 + signal.SIGINT
    except BaseException as err:  # noqa: B036 -- report it as python does, then exit 1
        _print_exception(err)
        return 1
    return 0


def _print_exception(err: BaseException) -> None:
    """The traceback python would print, without the frames of this runner and runpy."""
    tb, skip = err.__traceback__, (__file__, runpy.__file__, "<frozen runpy>")
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename in skip:
        tb = tb.tb_next
    traceback.print_exception(type(err), err, tb)


def _exit_status(code) -> int:
    """SystemExit.code as python's exit status: None -> 0, an int as is, else printed, 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _write(text: str) -> bool:
    """Write to stdout; False once it is closed (`jaxpar launch ... | head`)."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
        return True
    except (BrokenPipeError, ValueError):
        return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def _cause_rank(code: int) -> int:
    """How likely an exit status is the cause of a launch's failure (lower: likelier) among
    near-simultaneous deaths: killed by a signal, then an error status, then an abort."""
    if code == -signal.SIGABRT:
        return 2
    return 0 if code < 0 else 1


def _describe(code: int) -> str:
    """Popen.returncode in words: 3 -> 'exited with status 3', -9 -> 'was killed by SIGKILL'."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"
