"""The scheduler's record of what is in flight: per sequence, its items in schedule order.

A sequence may have several items in flight at once while it computes a
prompt (or a recompute's prefill) in chunks: chunk k + 1 is scheduled before
chunk k returns, and goes into a later micro-batch; and with a decode
scheduled ahead (``Scheduler.schedule_ahead``) after the item that samples
its input token. That is right only because
every schedule runs a sequence's micro-batches on each layer range in the
order they were submitted (each stage handles its messages in arrival order,
except that stage 0 lets a step pass one waiting for its decode-ahead tokens
when they share no sequence, and a link delivers them in the order they were
sent), so chunk k's KV is written on a stage before chunk k + 1 reads it there. Results come back in that order too;
``take_done`` refuses any other, since a later chunk computed first would have
read KV that did not exist.
"""

from __future__ import annotations

from pipeserve.scheduler.output import ScheduledSeq
from pipeserve.sequence import Sequence


class InFlight:
    def __init__(self) -> None:
        self._items: dict[int, list[ScheduledSeq]] = {}   # seq_id -> its items, oldest first
        self.num_pipelined = 0      # items scheduled while an earlier one of their sequence was in flight

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._items

    def __bool__(self) -> bool:
        return bool(self._items)

    @property
    def num_seqs(self) -> int:
        return len(self._items)

    @property
    def num_items(self) -> int:
        return sum(len(items) for items in self._items.values())

    def num_items_of(self, seq: Sequence) -> int:
        return len(self._items.get(seq.seq_id, ()))

    def end(self, seq: Sequence) -> int:
        """Where ``seq``'s next item starts: the end of its last item in flight, else
        its computed tokens."""
        items = self._items.get(seq.seq_id)
        if not items:
            return seq.num_computed_tokens
        last = items[-1]
        return last.start + last.num_new_tokens

    def add(self, item: ScheduledSeq, ahead: bool = False) -> None:
        """``ahead``: a decode after the item that samples its input token (not a chunk)."""
        expected = self.end(item.seq)
        if item.start != expected:
            raise RuntimeError(f"{item.seq}: a chunk from {item.start} scheduled where the next one "
                               f"starts at {expected}")
        items = self._items.setdefault(item.seq.seq_id, [])
        if items and not ahead:
            self.num_pipelined += 1
        items.append(item)

    def is_oldest(self, item: ScheduledSeq) -> bool:
        """Whether ``item`` is its sequence's oldest item in flight (``take_done`` may take it)."""
        items = self._items.get(item.seq.seq_id)
        return bool(items) and items[0] is item

    def take_done(self, item: ScheduledSeq) -> None:
        """``item``'s step is done: it must be its sequence's oldest item in flight."""
        items = self._find(item)
        if items[0] is not item:
            raise RuntimeError(f"{item.seq}: the chunk from {item.start} came back before the one from "
                               f"{items[0].start}; its KV would have been computed out of order")
        self._pop(item, items)

    def take_failed(self, item: ScheduledSeq) -> None:
        """``item``'s step was lost: take it out wherever it is (a failure loses every step
        in flight, and the engine reports them all)."""
        self._pop(item, self._find(item))

    def _find(self, item: ScheduledSeq) -> list[ScheduledSeq]:
        items = self._items.get(item.seq.seq_id, [])
        if not any(it is item for it in items):
            raise RuntimeError(f"{item.seq} is not in flight in this micro-batch: "
                               "was its step reported done twice?")
        return items

    def _pop(self, item: ScheduledSeq, items: list[ScheduledSeq]) -> None:
        items[:] = [it for it in items if it is not item]
        if not items:
            del self._items[item.seq.seq_id]
