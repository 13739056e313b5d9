"""Scheduling policies: who is admitted first, and who is preempted first.

A policy gives each sequence a sort key (lower runs first). Admission walks
the waiting queue in policy order; preemption takes the sequence with the
highest key, so the one the policy values least loses its blocks.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import defaultdict

from pipeserve.sequence import Sequence


class SchedulingPolicy(ABC):
    name: str = ""

    @abstractmethod
    def key(self, seq: Sequence) -> tuple:
        """Sort key: lower is served first and preempted last."""

    def order_waiting(self, seqs: list[Sequence]) -> list[Sequence]:
        return sorted(seqs, key=self.key)

    def order(self, seqs: list[Sequence]) -> list[Sequence]:
        return sorted(seqs, key=self.key)

    def pick_victim(self, candidates: list[Sequence]) -> Sequence:
        return max(candidates, key=self.key)

    def record_service(self, seq: Sequence, num_tokens: int) -> None:
        """Called once a step computed ``num_tokens`` tokens of ``seq``."""

    def stats(self) -> dict:
        return {}


class FcfsPolicy(SchedulingPolicy):
    """First come, first served; the newest arrival is preempted first."""

    name = "fcfs"

    def key(self, seq: Sequence) -> tuple:
        return (seq.arrival_time, seq.seq_id)


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` value first (as in vLLM), then arrival order."""

    name = "priority"

    def key(self, seq: Sequence) -> tuple:
        return (seq.priority, seq.arrival_time, seq.seq_id)


class FairPolicy(SchedulingPolicy):
    """Fair share between users: the user served the fewest tokens goes first.

    Admission interleaves users by virtual service (tokens already computed for
    the user plus the prompts queued ahead of this one), so a user with many
    queued requests cannot fill every free seat before a light user gets one.
    """

    name = "fair"

    def __init__(self) -> None:
        self.served: defaultdict[str, int] = defaultdict(int)

    def key(self, seq: Sequence) -> tuple:
        return (self.served[seq.user], seq.arrival_time, seq.seq_id)

    def order_waiting(self, seqs: list[Sequence]) -> list[Sequence]:
        queues: dict[str, list[Sequence]] = defaultdict(list)
        for seq in sorted(seqs, key=lambda s: (s.arrival_time, s.seq_id)):
            queues[seq.user].append(seq)
        heads = [(self.served[user], q[0].arrival_time, user, 0) for user, q in queues.items()]
        heapq.heapify(heads)
        ordered: list[Sequence] = []
        while heads:
            virtual, _, user, pos = heapq.heappop(heads)
            seq = queues[user][pos]
            ordered.append(seq)
            if pos + 1 < len(queues[user]):
                nxt = queues[user][pos + 1]
                heapq.heappush(heads, (virtual + seq.num_uncomputed_tokens, nxt.arrival_time, user, pos + 1))
        return ordered

    def record_service(self, seq: Sequence, num_tokens: int) -> None:
        self.served[seq.user] += num_tokens

    def stats(self) -> dict:
        return {"served_tokens_by_user": dict(self.served)}


_POLICIES: dict[str, type[SchedulingPolicy]] = {
    p.name: p for p in (FcfsPolicy, PriorityPolicy, FairPolicy)
}


def make_policy(name: str) -> SchedulingPolicy:
    if name not in _POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}: choose one of {', '.join(_POLICIES)}")
    return _POLICIES[name]()
