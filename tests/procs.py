"""Which processes a test started: stages are forked by the stage zygote
(pipeserve/pipeline/zygote.py), so they are this process's grandchildren, not its children."""

from __future__ import annotations

from pathlib import Path


def descendants(pid: int) -> set[int]:
    """The live processes (zombies excluded) below ``pid``: children, their children, ..."""
    parent_of: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parent_of[int(stat.parent.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, parent in parent_of.items() if parent in frontier} - found
        found |= frontier
    return found


def stage_processes(pid: int) -> set[int]:
    """``descendants(pid)`` without this process's stage zygote, which outlives its stages."""
    from pipeserve.pipeline import zygote
    own = zygote._zygote
    return descendants(pid) - ({own.proc.pid} if own is not None else set())
