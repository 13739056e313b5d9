"""The host (CPU) block pool that holds the KV of sequences preempted by swap.

Each swapped sequence owns its host blocks alone: sharing is a device-side
optimisation, and a swapped sequence's blocks are only read back once.
"""

from __future__ import annotations


class HostBlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # Popping from the end hands out low ids first; only tidiness, not correctness.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}   # seq_id -> host block ids

    @property
    def num_free(self) -> int:
        return len(self._free)

    def holds(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def table(self, seq_id: int) -> list[int]:
        return self._tables[seq_id]

    def allocate(self, seq_id: int, num_blocks: int) -> list[int]:
        if seq_id in self._tables:
            raise RuntimeError(f"sequence {seq_id} is already swapped out")
        if num_blocks > len(self._free):
            raise RuntimeError(f"host pool has {len(self._free)} free blocks, {num_blocks} needed; "
                               "check can_swap_out() first")
        blocks = [self._free.pop() for _ in range(num_blocks)]
        self._tables[seq_id] = blocks
        return blocks

    def release(self, seq_id: int) -> None:
        """Return a sequence's host blocks to the pool (no-op if it holds none)."""
        self._free.extend(reversed(self._tables.pop(seq_id, [])))

    def check_integrity(self) -> list[str]:
        """Problems found (empty when consistent)."""
        problems: list[str] = []
        held = [b for table in self._tables.values() for b in table]
        if len(set(held)) != len(held):
            problems.append("a host block is held twice")
        if len(set(self._free)) != len(self._free):
            problems.append("a host block is free twice")
        if set(held) & set(self._free):
            problems.append("a host block is both free and held")
        if len(held) + len(self._free) != self.num_blocks:
            problems.append(f"host blocks: {len(held)} held + {len(self._free)} free "
                            f"!= {self.num_blocks} total")
        return problems
