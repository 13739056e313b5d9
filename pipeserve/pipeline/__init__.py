"""Pipeline execution: stage processes behind the Executor interface.

executor.py (driver side: PipelineExecutor), stage_worker.py (one stage process),
launcher.py (spawning local stages; ``pipeserve worker`` nodes), spec.py (what
stages are told, placement), partition.py / part_costs.py / costs.py (which
layers each stage holds), synthetic.py (a fixed-time runner for schedule
measurements), cli.py (the ``worker`` subcommand).
"""
