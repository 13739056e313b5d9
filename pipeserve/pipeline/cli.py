"""``pipeserve worker``: run this node's pipeline stages for a driver on another host.

    node 0:  pipeserve serve --model M -pp 4 --nnodes 2 --master-addr 10.0.0.1 --master-port 29533
    node 1:  pipeserve worker --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29533

The worker needs no model flags: it reads the driver's pipeline spec (model,
partition, dtype, ...) from the driver's store. Stages are split evenly over
nodes in order; node 0 (the driver's) takes the first ones.
"""

from __future__ import annotations

import argparse
import logging
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser("worker", help="run this node's pipeline stages (multi-host)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=int, required=True, help="number of nodes in the pipeline")
    parser.add_argument("--node-rank", type=int, required=True, help="this node's rank, 1 .. nnodes-1")
    parser.add_argument("--master-addr", required=True, help="the driver node's address")
    parser.add_argument("--master-port", type=int, default=29533, help="the driver's store port")
    parser.add_argument("--rendezvous-timeout", type=float, default=60.0,
                        help="seconds to wait for the driver")


def run(args: argparse.Namespace) -> int:
    from pipeserve.pipeline.launcher import run_node  # torch only when actually running
    try:
        return run_node(args.nnodes, args.node_rank, args.master_addr, args.master_port,
                        args.rendezvous_timeout)
    except (ValueError, ConnectionError) as exc:
        print(f"pipeserve worker: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipeserve worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
