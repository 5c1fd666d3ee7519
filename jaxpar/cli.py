"""The `jaxpar` command line."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxpar", description="Automatic sharding for JAX.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("demo", help="plan, run and check the reference examples on 8 simulated "
                                "CPU devices")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        from jaxpar.demo import main as demo
        return demo()
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
