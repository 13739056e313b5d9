"""How micro-batches are formed, for the simulator: the runtime's own scheduler.

``EngineBatcher`` drives ``pipeserve.scheduler.Scheduler`` (torch-free: sequences,
block tables, the prefix cache, preemption by recompute, or by swap where the engine has a
host pool: ``--preemption-mode auto`` on one CPU host) with the limits the engine
puts on each micro-batch (``scheduler.micro_batch_limits``, the same call as the
engine's), so a simulated run gets the engine's prefill/decode mix per
step, its admission bursts as KV blocks free up, its chunked prompts and its
preemptions, rather than a model of them. Token ids are made up: each request's are
unique, except the shared prefix of a ``shared-prefix`` trace, so the prefix cache hits
exactly where the engine's would.
"""

from __future__ import annotations

import itertools

from pipeserve.config import EngineConfig
from pipeserve.plan.roofline import EMPTY, BatchShape
from pipeserve.plan.workload import TraceRequest
from pipeserve.sampling_params import SamplingParams
from pipeserve.scheduler.scheduler import Scheduler, SchedulerOutput, micro_batch_limits
from pipeserve.sequence import Sequence, SequenceGroup

BLOCK_SIZE = 16
# Made-up token ids: request r's own tokens start at (r + 1) · _ID_STRIDE; prefix g's at g.
_ID_STRIDE = 1 << 20


class EngineBatcher:
    """The engine's scheduling decisions, step by step, without running a model."""

    def __init__(self, *, kv_capacity_tokens: float, max_num_seqs: int, max_num_batched_tokens: int,
                 max_inflight: int, gpipe: bool, enable_prefix_caching: bool = True,
                 block_size: int = BLOCK_SIZE, swap_capacity_tokens: float = 0.0) -> None:
        """``max_num_batched_tokens``: the engine's (all micro-batches in flight together);
        ``max_inflight``: micro-batches in flight (1 at PP = 1; gpipe: per step);
        ``swap_capacity_tokens``: the host pool a preemption swaps into (0: preemption by
        recompute). A swap's copies take no time here: on a CPU host they move a victim's
        blocks within RAM (the reference run at PP = 2: 41 victims of a few MB a stage, out and
        back, ~0.1 % of its 50 s), where a recompute is its whole prefill again, which the
        simulated steps do carry."""
        blocks = int(min(kv_capacity_tokens, 1 << 40) // block_size)
        host_blocks = int(min(swap_capacity_tokens, 1 << 40) // block_size)
        self.config = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   enable_prefix_caching=enable_prefix_caching,
                                   preemption_mode="swap" if host_blocks > 0 else "recompute")
        self.requests: dict[str, SequenceGroup] = {}
        self.scheduler = Scheduler(self.config, max(1, blocks), host_blocks, self.requests)
        self.max_inflight, self.gpipe = max_inflight, gpipe
        self.inflight: dict[int, SchedulerOutput] = {}
        self.trace: dict[str, TraceRequest] = {}
        self.first_token: dict[str, float] = {}
        self._keys = itertools.count()

    # -- requests ----------------------------------------------------------
    def add(self, rid: int, req: TraceRequest) -> None:
        own = req.prompt_len - req.prefix_len
        prefix = [req.prefix_id * _ID_STRIDE // 2 + i for i in range(req.prefix_len)] if req.prefix_id >= 0 else []
        base = (rid + 1) * _ID_STRIDE
        ids = prefix + list(range(base, base + own))
        params = SamplingParams(max_tokens=req.output_len, ignore_eos=True)
        name = str(rid)
        seq = Sequence(name, 0, ids, params, arrival_time=req.arrival)
        group = SequenceGroup(name, None, ids, params, [seq], req.arrival)
        self.requests[name] = group
        self.trace[name] = req
        self.scheduler.add_request(group)

    @property
    def has_work(self) -> bool:
        return self.scheduler.num_live > 0

    # -- forming micro-batches ----------------------------------------------
    def fill(self) -> list[tuple[int, BatchShape]]:
        """Top the pipeline up as ``LLMEngine._fill_pipeline``: new micro-batches
        (ids and shapes), formed one after the other."""
        if self.gpipe and self.inflight:
            return []
        slots = self.max_inflight - len(self.inflight)
        formed = []
        for i in range(slots):
            sched = self.scheduler.schedule(**self._limits(slots - i))
            if sched.is_empty:
                break
            key = next(self._keys)
            self.inflight[key] = sched
            formed.append((key, self._shape(sched)))
        return formed

    def _limits(self, free_slots: int) -> dict:
        """The engine's limits on each micro-batch (``micro_batch_limits``)."""
        return micro_batch_limits(self.scheduler, self.inflight.values(), self.max_inflight, self.gpipe,
                                  free_slots)

    @staticmethod
    def _shape(sched: SchedulerOutput) -> BatchShape:
        shape = EMPTY
        for item in sched.scheduled:
            n, start = item.num_new_tokens, item.start
            if n == 1 and start > 0 and item.sample:
                shape = shape + BatchShape.decode(1, item.seq_len)
            else:
                pairs = n * start + n * (n + 1) / 2
                shape = shape + BatchShape(1, n, pairs, start, 1 if item.sample else 0)
        return shape

    @staticmethod
    def carries_prefill(sched: SchedulerOutput) -> bool:
        return any(item.num_new_tokens > 1 for item in sched.scheduled)

    # -- results --------------------------------------------------------------
    def complete(self, key: int, now: float) -> list[tuple[TraceRequest, float, float]]:
        """The micro-batch's tokens are back: advance it as ``LLMEngine._process``.
        Returns (request, first-token time, finish time) of the requests it finished."""
        sched = self.inflight.pop(key)
        self.scheduler.on_step_done(sched)
        done = []
        for item in sched.scheduled:
            if not item.sample:
                continue
            seq = item.seq
            seq.append_token(0)
            name = seq.request_id
            self.first_token.setdefault(name, now)
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.scheduler.finish_seq(seq, "length")
                self.requests.pop(name, None)
                done.append((self.trace.pop(name), self.first_token.pop(name), now))
        return done

    @property
    def preemptions(self) -> int:
        return self.scheduler.stats().get("num_preemptions", 0)

    @property
    def swaps(self) -> int:
        """Of ``preemptions``, those by swap (the rest recomputed)."""
        return self.scheduler.stats().get("num_preemptions_swap", 0)
