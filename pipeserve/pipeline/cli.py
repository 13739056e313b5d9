"""``pipeserve worker``: run pipeline stages for a driver, here or on another host.

    node 0:  PIPESERVE_CLUSTER_KEY=s3cret pipeserve serve --model M -pp 4 --nnodes 2 \\
                 --master-addr 10.0.0.1 --master-port 29533
    node 1:  PIPESERVE_CLUSTER_KEY=s3cret pipeserve worker --nnodes 2 --node-rank 1 \\
                 --master-addr 10.0.0.1 --master-port 29533

The worker needs no model flags: the driver sends the pipeline spec (model,
partition, dtype, ...) once the worker has proved it knows the cluster key
($PIPESERVE_CLUSTER_KEY; never a flag, so it stays out of `ps`). A node worker
starts one stage process per stage of its node (stages are split evenly over
nodes in order; node 0, the driver's, takes the first ones); each is
``pipeserve worker --stage S``, the same program the driver starts for its own
node. A stage of another node that loses the driver joins again for up to
--stage-rejoin-timeout seconds, then exits with a message; a stage process
that dies (a signal, a crash) is started again, at most 5 times within 600 s,
and joins the driver's next generation.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser("worker", help="run pipeline stages for a driver (multi-host)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=int, default=None, help="number of nodes in the pipeline")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's rank, 1 .. nnodes-1")
    parser.add_argument("--stage", type=int, default=None,
                        help="run exactly this one stage (what a node worker and the driver start)")
    parser.add_argument("--tp-rank", type=int, default=None, help=argparse.SUPPRESS)       # a stage's
    parser.add_argument("--tp-store-port", type=int, default=None, help=argparse.SUPPRESS)  # TP follower
    parser.add_argument("--master-addr", required=True, help="the driver node's address")
    parser.add_argument("--master-port", type=int, default=29533, help="the driver's port")
    parser.add_argument("--rendezvous-timeout", type=float, default=60.0,
                        help="seconds to wait for the driver")
    parser.add_argument("--stage-rejoin-timeout", type=float, default=None,
                        help="after losing the driver, seconds to keep trying to join it again "
                             "(default: 300 on a node worker; a --stage alone exits at once)")


def run(args: argparse.Namespace) -> int:
    # torch only when actually running
    from pipeserve.comm.auth import KEY_ENV
    from pipeserve.pipeline.launcher import run_node
    from pipeserve.pipeline.stage_process import run_stage
    stage = getattr(args, "stage", None)
    rejoin = getattr(args, "stage_rejoin_timeout", None)
    try:
        if getattr(args, "cluster_key", None):   # `pipeserve serve --node-rank R` on another node
            os.environ.setdefault(KEY_ENV, args.cluster_key)
        if stage is not None:
            # Ctrl-C reaches the whole process group: it is the driver's (or node worker's) to
            # handle, which stops its stages once in-flight requests are done; a stage that
            # died of it would fail them. A stage whose parent is gone exits on its own.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            if not os.environ.get(KEY_ENV):
                raise ValueError(f"set ${KEY_ENV} to the driver's cluster key")
            key = os.environ[KEY_ENV].encode()
            if getattr(args, "tp_rank", None) is not None:   # started by the stage's TP rank 0
                from pipeserve.pipeline.tensor_group import run_follower
                code = run_follower(stage, args.tp_rank, args.tp_store_port, key, args.rendezvous_timeout)
            else:
                code = run_stage(stage, args.master_addr, args.master_port, key, args.rendezvous_timeout, rejoin)
            # Every message has left (the sender joined): skip the interpreter's slow torch teardown.
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        if args.nnodes is None or args.node_rank is None:
            raise ValueError("give --nnodes and --node-rank (a node's stages), or --stage S (one stage)")
        return run_node(args.nnodes, args.node_rank, args.master_addr, args.master_port, args.rendezvous_timeout,
                        300.0 if rejoin is None else rejoin)
    except (ValueError, ConnectionError) as exc:
        print(f"pipeserve worker: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipeserve worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    prefix = f"[stage {args.stage}] " if args.stage is not None else ""
    if args.stage is not None and args.tp_rank is not None:
        prefix = f"[stage {args.stage} tp {args.tp_rank}] "
    logging.basicConfig(level=logging.INFO, format=f"{prefix}%(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
