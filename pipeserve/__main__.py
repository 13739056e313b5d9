"""``python -m pipeserve``: the ``pipeserve`` command. ``python -m pipeserve worker ...``
goes straight to the worker (what the driver starts for each local stage: no
server or bench modules to import on the way)."""

import sys

if sys.argv[1:2] == ["worker"]:
    from pipeserve.pipeline.cli import main as worker_main
    sys.exit(worker_main(sys.argv[2:]))

from pipeserve.entrypoints.cli import main  # noqa: E402

sys.exit(main())
