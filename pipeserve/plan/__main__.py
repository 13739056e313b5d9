"""``python -m pipeserve.plan``: the plan subcommand on its own."""

from __future__ import annotations

import argparse
import sys

from pipeserve.plan.cli import register


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipeserve")
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
