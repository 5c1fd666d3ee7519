"""The `jaxpar` command line: `jaxpar demo`, `jaxpar launch -n N script.py`, `jaxpar --help`.

Each subcommand is a pair of functions: `_add_NAME(subparsers)` declares its arguments and sets
`run=_run_NAME`, which takes the parsed arguments and returns the exit status. To add one,
write the pair and list `_add_NAME` in SUBCOMMANDS.
"""

from __future__ import annotations

import argparse
import sys


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="plan, run and check the reference examples on 8 simulated "
                                    "CPU devices")
    p.set_defaults(run=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from jaxpar.demo import main as demo
    return demo()


def _add_launch(sub) -> None:
    p = sub.add_parser(
        "launch", help="run a script in N processes joined by jaxpar.init()",
        description="Start N processes of a Python script on this machine. Each one finds its "
                    "rank, the process count and the coordinator in the environment that "
                    "jaxpar.init() reads. If a rank fails, the others are stopped.",
        usage="jaxpar launch -n N [--devices-per-process K] [--port P] [--log-dir DIR] "
              "(script.py | -m module) [args ...]")
    p.add_argument("-n", "--num-processes", type=int, required=True, metavar="N",
                   help="number of processes (ranks)")
    p.add_argument("--devices-per-process", type=int, metavar="K",
                   help="simulated CPU devices per process (default: the platform's count)")
    p.add_argument("--port", type=int, metavar="P",
                   help="coordinator port on 127.0.0.1 (default: a free port)")
    p.add_argument("--log-dir", metavar="DIR",
                   help="write DIR/rank_i.log per rank instead of prefixing stdout lines")
    p.add_argument("-m", dest="module", metavar="module",
                   help="run a module, as python -m (put -- before module arguments that start "
                        "with a dash)")
    p.add_argument("program", nargs=argparse.REMAINDER,
                   help="the script and its arguments (after -m: the module's arguments)")
    p.set_defaults(run=_run_launch, parser=p)


def _run_launch(args: argparse.Namespace) -> int:
    from jaxpar.launch import launch
    rest = args.program[1:] if args.program[:1] == ["--"] else args.program
    program = ["-m", args.module, *rest] if args.module else rest
    try:
        return launch(args.num_processes, program, devices_per_process=args.devices_per_process,
                      port=args.port, log_dir=args.log_dir)
    except (ValueError, TypeError) as err:
        args.parser.error(str(err))  # prints the usage and the error, exits with status 2


SUBCOMMANDS = (_add_demo, _add_launch)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxpar", description="Automatic sharding for JAX.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the `jaxpar` command line with argv (default sys.argv[1:]); returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
