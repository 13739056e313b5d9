"""The driver: requests in, micro-batches out to the stages, tokens back, outputs up.

The engine owns every decision (which sequences run, which KV blocks they use);
the executor behind it only runs the steps it is given.
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time

import torch

from pipeserve.chat_options import resolve_chat_template
from pipeserve.config import EngineConfig
from pipeserve.engine.guides import Guides
from pipeserve.engine.input_processor import PromptType, RequestRejected, make_group, prompt_to_ids
from pipeserve.engine.output_processor import OutputProcessor
from pipeserve.engine.recovery import RecoveryLog
from pipeserve.engine.step_builder import build_step
from pipeserve.model.kv_quant import cache_dtype, row_bytes
from pipeserve.model.loader import resolve_model
from pipeserve.outputs import RequestOutput
from pipeserve.pipeline.lm_head import HeadBalance, resolve_lm_head
from pipeserve.sampling_params import SamplingParams
from pipeserve.scheduler.scheduler import Scheduler, SchedulerOutput, micro_batch_limits
from pipeserve.sequence import SequenceGroup
from pipeserve.tokenizer import load_tokenizer
from pipeserve.worker.executor import Executor, ExecutorError
from pipeserve.worker import thread_governor
from pipeserve.worker.cpu_bind import DriverCpus
from pipeserve.worker.model_runner import available_bytes, check_kv_fits
from pipeserve.worker.step import StepInput, StepOutput

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        """``executor``: run the steps on this one instead of the stages ``config`` describes
        (no weights are loaded then); calibration uses an executor that answers at once
        to time the driver alone."""
        if config.dtype == "auto":   # resolved once here, so every stage (and host) computes in one dtype
            config = config.replace(dtype=config.torch_dtype_name)
            logger.info("--dtype auto: %s on %s", config.dtype, config.device)
        self.config = config
        self.source = resolve_model(config.model)
        self.model_config = self.source.load_config()
        tokenizer_source = resolve_model(config.tokenizer) if config.tokenizer else self.source
        chat_template = resolve_chat_template(config.chat_template) if config.chat_template else None
        self.dtype = DTYPES[config.torch_dtype_name]
        if config.tensor_parallel_size > 1:   # refuse before any process starts
            from pipeserve.model.loader import split_alignment
            from pipeserve.model.tensor_parallel import check_tensor_parallel, check_tensor_parallel_config
            check_tensor_parallel(self.model_config, config.tensor_parallel_size)
            self._tp_align = split_alignment(self.source, self.model_config, config.quantization,
                                             config.quantization_group_size)
            check_tensor_parallel_config(config, self.model_config, self._tp_align)
        self.max_model_len = self._max_model_len()
        lm_head = resolve_lm_head(config, self.model_config)   # refuses shared where it cannot apply
        if config.pp_lm_head == "auto" and config.pipeline_parallel_size > 1:
            logger.info("--pp-lm-head auto: %s%s", lm_head, " (stage 0 uses its embedding as the head)"
                        if lm_head == "shared" else "")
        self.config = config = config.replace(pp_lm_head=lm_head)
        self.partition = self._partition()
        self._head_balance = HeadBalance(self.model_config, self.partition) if lm_head == "shared" else None
        self.num_blocks, host_pool, block_bytes = self._kv_blocks()
        if config.preemption_mode == "auto":   # resolved once here, as --dtype auto
            mode = resolve_preemption_mode(config, self.num_blocks * block_bytes, host_pool * block_bytes,
                                           available_bytes(), self._weight_bytes_estimate())
            logger.info("--preemption-mode auto: %s", mode)
            self.config = config = config.replace(preemption_mode=mode)
        self.num_host_blocks = host_pool if config.preemption_mode == "swap" else 0
        # The one record of each unfinished request, by id; the scheduler reads it too.
        self.requests: dict[str, SequenceGroup] = {}
        self.scheduler = Scheduler(config, self.num_blocks, self.num_host_blocks, self.requests,
                                   rope_switch_len=self.model_config.rope_switch_len)
        # The tokenizer loads (transformers' import, seconds) while the stages start. Whatever
        # fails, the thread is joined first: transformers' lazy import is not safe to race.
        tokenizer = _Background(load_tokenizer, tokenizer_source)
        try:
            self.executor = executor or self._make_executor()
        except BaseException:
            tokenizer.join()
            raise
        try:
            self.tokenizer = tokenizer.result()
        except BaseException:
            self.executor.shutdown()
            raise
        if chat_template is not None:
            self.tokenizer.hf_tokenizer.chat_template = chat_template
            logger.info("chat template: --chat-template's (%d characters), not the model's", len(chat_template))
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.guides = Guides(self.tokenizer.hf_tokenizer, self.model_config.vocab_size)
        self._inflight: dict[int, SchedulerOutput] = {}
        # While one request is alone, this process's threads on the last stage's CPUs (cpu_bind.py).
        last = config.pipeline_parallel_size - 1
        self._driver_cpus = (DriverCpus(lambda: getattr(self.executor, "stage_pids", {}).get(last))
                             if last > 0 and hasattr(self.executor, "max_inflight") else None)
        self._forwarding: set[int] = set()   # steps in flight whose tokens go to stage 0 too (decode ahead)
        self._early: dict[int, StepOutput] = {}   # results back before an older step of their sequences
        self._follows: dict[int, int] = {}   # a decode ahead's step id -> the step whose tokens it takes in
        self._dead: str | None = None
        self.recovery = RecoveryLog()
        self.profiler = None
        if config.profile:     # timers on this engine's calls; none without --profile
            from pipeserve.engine.driver_profile import DriverProfiler
            self.profiler = DriverProfiler()
            self.profiler.instrument(self)
        # Objects made so far (model, tokenizer, tables) live as long as the
        # engine: take them out of the cyclic collector's scans, as vLLM does.
        gc.freeze()
        logger.info("engine ready: %d KV blocks of %d tokens (%d host blocks), max_model_len=%d; %s",
                    self.num_blocks, config.block_size, self.num_host_blocks, self.max_model_len,
                    kv_concurrency(self.num_blocks, config.block_size, self.max_model_len, config.max_num_seqs))

    # -- set-up ------------------------------------------------------------
    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len
        if wanted is None:
            return limit
        if wanted < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {wanted}")
        return wanted

    def _partition(self) -> list[tuple[int, int]]:
        num_layers = self.model_config.num_layers
        if self.config.pipeline_parallel_size == 1:
            return [(0, num_layers)]
        from pipeserve.pipeline.partition import partition_for_config
        return partition_for_config(self.config, self.model_config, self.dtype)

    def _kv_blocks(self) -> tuple[int, int, int]:
        """Blocks per stage from the memory budget: M_KV = 2·layers·kv_heads·row bytes per token,
        a row being head_dim values (8-bit caches: head_dim codes and a float32 scale); the
        blocks --swap-space would hold, and a block's bytes on the busiest stage."""
        kv = self._kv_config()
        row = row_bytes(kv.head_dim, cache_dtype(self.config.kv_cache_dtype, self.dtype))
        most_layers = max(self._layers_per_worker())
        block_bytes = self.config.block_size * 2 * most_layers * kv.num_kv_heads * row
        num_blocks = self.config.num_gpu_blocks_override or self.config.kv_cache_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(f"--kv-cache-memory {self.config.kv_cache_memory} holds no KV block "
                             f"(one block takes {block_bytes} bytes per stage)")
        if self.config.nnodes == 1 and self.config.device == "cpu":   # refused before the stages start
            check_kv_fits(int(num_blocks) * block_bytes)
        return int(num_blocks), int(self.config.swap_space_bytes // block_bytes), int(block_bytes)

    def _weight_bytes_estimate(self) -> int:
        """The weights' bytes once loaded, before any stage has loaded them: a GGUF kept in its
        own types holds about its file; anything else its parameters in --dtype (int8/int4 hold
        less: an upper bound)."""
        if self.source.kind == "gguf" and self.config.quantization == "auto":
            return self.source.path.stat().st_size
        return self.model_config.total_params() * self.dtype.itemsize

    def _kv_config(self):
        """The model as the busiest KV holder sees it: with tensor parallelism a rank holds
        only its KV heads, so --kv-cache-memory is a per-rank budget."""
        t = self.config.tensor_parallel_size
        if t == 1:
            return self.model_config
        from dataclasses import replace

        from pipeserve.model.tensor_parallel import plan_shard
        heads = max(plan_shard(self.model_config, r, t, self._tp_align).num_kv_heads for r in range(t))
        return replace(self.model_config, num_kv_heads=heads)

    def _layers_per_worker(self) -> list[int]:
        """Chunk c of the partition runs on worker c mod P (V chunks each when interleaved)."""
        workers = self.config.pipeline_parallel_size
        layers = [0] * workers
        for chunk, (start, end) in enumerate(self.partition):
            layers[chunk % workers] += end - start
        return layers

    def _make_executor(self) -> Executor:
        if self.config.pipeline_parallel_size == 1 and self.config.tensor_parallel_size == 1:
            from pipeserve.worker.local_executor import LocalExecutor
            from pipeserve.worker.model_runner import ModelRunner
            thread_governor.start(self.config.stage_threads, self.config.adaptive_threads)
            runner = ModelRunner(self.source, self.model_config, start_layer=0,
                                 end_layer=self.model_config.num_layers, is_first=True, is_last=True,
                                 dtype=self.dtype, device=torch.device(self._device(0)),
                                 num_blocks=self.num_blocks, num_host_blocks=self.num_host_blocks,
                                 block_size=self.config.block_size,
                                 attention_backend=self.config.attention_backend,
                                 quantization=self.config.quantization,
                                 quantization_group_size=self.config.quantization_group_size,
                                 kv_cache_dtype=self.config.kv_cache_dtype,
                                 prepack_weights=self.config.prepack_weights)
            if self.config.profile:
                from pipeserve.worker.profiler import StageProfiler
                runner.profiler = StageProfiler(0)
                runner.profiler.instrument(runner)
            return LocalExecutor(runner)
        from pipeserve.pipeline.executor import PipelineExecutor
        return PipelineExecutor(self.config, self.source, self.model_config, self.partition,
                                self.num_blocks, self.num_host_blocks)

    def _device(self, stage: int) -> str:
        return f"cuda:{stage}" if self.config.device == "cuda" else self.config.device

    # -- requests ----------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None, *,
                    priority: int = 0, user: str | None = None, arrival_time: float | None = None) -> None:
        """Queue a request. Raises ``ValueError`` (``RequestRejected``) if it can never be served."""
        if self._dead:
            raise RuntimeError(f"the engine is unhealthy: {self._dead}")
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        if params.n > self.config.max_n:
            raise RequestRejected(f"n={params.n} is over the limit of {self.config.max_n} sequences per "
                                  "request (--max-n)")
        text, ids = prompt_to_ids(prompt, self.tokenizer)
        group = make_group(request_id, text, ids, params, vocab_size=self.model_config.vocab_size,
                           max_model_len=self.max_model_len, eos_token_ids=self.tokenizer.eos_token_ids,
                           fits_in_cache=self.scheduler.can_ever_fit, priority=priority, user=user,
                           arrival_time=arrival_time)
        self._start_guides(group)
        self.requests[request_id] = group
        self.outputs.add(group)
        self.scheduler.add_request(group)

    def _start_guides(self, group: SequenceGroup) -> None:
        """Grammar matchers (and first masks) for a constrained request; a bad grammar is refused."""
        try:
            for seq in group.seqs:
                self.guides.start(seq)
        except ValueError as exc:
            for seq in group.seqs:
                self.guides.drop(seq.seq_id)
            raise RequestRejected(str(exc)) from None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        group = self.requests.get(request_id)
        if group is None:
            return None
        self.scheduler.abort_request(request_id)
        return self._finish_group(group, reason="abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the loop ----------------------------------------------------------
    def step(self, partial_outputs: bool = True) -> list[RequestOutput]:
        """Fill the pipeline, wait for at least one micro-batch, return updated requests.

        ``partial_outputs=False``: return only the requests that finished (an offline
        caller that reads nothing else skips building an output per token)."""
        if self._dead:
            return self._fail_all(self._dead)
        gpipe = self._gpipe
        try:
            if not (gpipe and self._inflight):
                self._fill_pipeline()
            if not self._inflight:
                self.executor.wait(timeout=0)     # raises if a stage died while nothing ran
                return []
            results = self.executor.wait(timeout=self.config.stage_timeout)
            while gpipe and len(results) < len(self._inflight):
                # gpipe: the step is done only when all its micro-batches are.
                results += self.executor.wait(timeout=self.config.stage_timeout)
        except ExecutorError as exc:
            return self._on_pipeline_failure(str(exc), exc.step_id)
        updated: dict[str, RequestOutput] = {}
        for result in self._in_order(results) if self._head_balance is not None else results:
            for out in self._process(result, partial_outputs):
                updated[out.request_id] = out
        if not self.requests and not self._inflight:
            # Just went idle: every block must be free or cached. O(blocks), once per idle spell;
            # a KVCacheIntegrityError here is a bookkeeping bug, caught before it serves wrong KV.
            self.scheduler.block_manager.check_integrity()
        return list(updated.values())

    @property
    def _gpipe(self) -> bool:
        return self.config.pp_schedule == "gpipe" and self.config.pipeline_parallel_size > 1

    def _fill_pipeline(self) -> None:
        """async / interleaved: top the pipeline up to ``max_inflight`` micro-batches.
        gpipe: split the step's batch into M micro-batches, all submitted at once."""
        slots = self.executor.max_inflight - len(self._heads())
        if self._gpipe:
            slots = min(slots, self.config.pp_micro_batches or self.config.pipeline_parallel_size)
        for i in range(slots):
            sched = self.scheduler.schedule(**self._micro_batch_limits(slots - i))
            if sched.is_empty:
                break
            self._submit(sched)
        if self._forwarding and self._ahead_allowed():
            # A decode ahead's own follower waits until it holds a slot (its source is back):
            # its sequences have two items in flight until then. A chain keeps its sequences
            # in one micro-batch, so one that holds more than its share (others' sequences
            # finished) is not continued: back in the normal schedule they are spread again.
            share = math.ceil(self.scheduler.num_running / self.executor.max_inflight)
            for step_id in [i for i in self._heads() if i in self._forwarding]:
                self._forwarding.discard(step_id)     # one decode ahead per step
                seqs = [item.seq for item in self._inflight[step_id].scheduled
                        if item.sample and self._may_follow(item.seq, 1)]
                if len(seqs) > share:
                    continue
                sched = self.scheduler.schedule_ahead(seqs)
                if not sched.is_empty:
                    self._follows[self._submit(sched, tokens_from=step_id)] = step_id

    def _submit(self, sched: SchedulerOutput, tokens_from: int = -1) -> int:
        forward = self._forwards_tokens(sched, pending=1 if tokens_from < 0 else 2)
        step = self._build_step(sched, tokens_from=tokens_from, forward_tokens=forward)
        self._inflight[step.step_id] = sched
        if forward:
            self._forwarding.add(step.step_id)
        self.executor.submit(step)
        return step.step_id

    def _heads(self) -> list[int]:
        """The steps in flight that hold a micro-batch slot: all but a decode ahead whose
        source step is still in flight (it takes that step's slot when the source returns)."""
        return [i for i in self._inflight if self._follows.get(i) not in self._inflight]

    def _build_step(self, sched: SchedulerOutput, **ahead) -> StepInput:
        step = build_step(sched.scheduled, sched.swap_in, sched.swap_out, sched.copies,
                          self.guides.mask if len(self.guides) else None, **ahead)
        if self._head_balance is not None or self._driver_cpus is not None:
            alone = self.scheduler.num_live < self.executor.max_inflight
            if self._head_balance is not None:
                self._head_balance.place(step, alone=alone)
            if self._driver_cpus is not None:
                self._driver_cpus.follow(alone)
        return step

    # -- decode ahead (pp_decode_ahead) -------------------------------------
    # A micro-batch's next decode could only be sent after its result reached the driver:
    # each round would cross last stage -> driver -> stage 0, with the driver's step
    # between, while stage 0 waits (one request alone: every token; many: whenever stage 0
    # runs out of micro-batches). Instead, while every live sequence is in flight, the
    # engine sends the next decode of a micro-batch's sequences at once, its input tokens
    # not known yet (``StepInput.tokens_from``), beside the micro-batch slots (it takes its
    # source's slot when that returns); the last stage sends the tokens to stage 0 directly
    # (``forward_tokens``), which runs it as soon as they arrive. If a sequence stops on its
    # token (EOS, a stop string, an abort), the decode ahead computed one position for
    # nothing and that result is dropped. A waiting request (or one between its prompt's
    # chunks) ends the chains: the next normal micro-batch takes it in beside the running
    # sequences' decodes.
    @property
    def _decodes_ahead(self) -> bool:
        return self.executor.decodes_ahead and self.executor.max_inflight > 1

    def _may_follow(self, seq, pending: int) -> bool:
        """Whether a decode may be scheduled after ``pending`` tokens ``seq`` has sampled in
        flight: not if they may end it by length, nor if its sampling reads its output tokens
        (penalties) or the driver must see each token first (a grammar)."""
        p = seq.params
        return (not seq.is_finished and not p.needs_penalties and p.structured_outputs is None
                and (p.max_tokens is None or seq.num_output_tokens + pending < p.max_tokens)
                and seq.num_tokens + pending < self.max_model_len)

    def _ahead_allowed(self) -> bool:
        """Decodes ahead only while every live sequence is in flight: one that waits, is swapped
        out or is between its prompt's chunks needs the next normal micro-batch, and decodes
        ahead would keep every slot taken."""
        return self._decodes_ahead and self.scheduler.all_in_flight()

    def _forwards_tokens(self, sched: SchedulerOutput, pending: int) -> bool:
        """Whether the last stage should send this micro-batch's tokens to stage 0 too: a
        decode ahead may follow it."""
        return self._ahead_allowed() and any(item.sample and self._may_follow(item.seq, pending)
                                             for item in sched.scheduled)

    def _micro_batch_limits(self, free_slots: int) -> dict:
        """Spread the work evenly over the micro-batches in flight (``micro_batch_limits``)."""
        return micro_batch_limits(self.scheduler, [self._inflight[i] for i in self._heads()],
                                  self.executor.max_inflight, self._gpipe, free_slots)

    def _in_order(self, results: list[StepOutput]):
        """``results`` and those held back before, each once every older step of its sequences
        is processed: with the LM head shared, a step whose head ran on stage 0 comes back by a
        longer way (last stage -> stage 0 -> driver) than a later step whose head the last stage
        ran, and a sequence's steps (a prompt's pipelined chunks, a decode ahead) must be taken
        in the order they run. What cannot be taken yet stays in ``_early``."""
        early = self._early
        early.update((r.step_id, r) for r in results)
        while early:
            ready = next((r for r in early.values() if self.scheduler.may_finish(self._inflight[r.step_id])), None)
            if ready is None:
                return
            del early[ready.step_id]
            yield ready

    def _process(self, result: StepOutput, partial_outputs: bool = True) -> list[RequestOutput]:
        sched = self._inflight.pop(result.step_id)
        self._forwarding.discard(result.step_id)
        self._follows.pop(result.step_id, None)
        self.scheduler.on_step_done(sched)
        if self.scheduler.isolated:
            for item in sched.scheduled:              # it ran (alone) without the model raising
                self.scheduler.release(item.seq.request_id)
        by_id = {s.seq.seq_id: s.seq for s in sched.scheduled}
        touched: dict[str, RequestOutput] = {}
        for tok in result.sampled:
            seq = by_id[tok.seq_id]
            group = self.requests.get(seq.request_id)
            if group is None or seq.is_finished:
                continue  # aborted while in flight
            seq.append_token(tok.token_id)
            reason = self.outputs.on_token(group, seq, tok)
            if reason is None and not self.guides.advance(seq, tok.token_id):
                reason = "stop"  # the grammar has no way on (every allowed token was banned)
            if reason is not None:
                self.guides.drop(seq.seq_id)
                self.scheduler.finish_seq(seq, reason)
            touched[group.request_id] = group
        if not partial_outputs:
            return [self._finish_group(g, reason=None) for g in touched.values() if g.is_finished]
        return [self._output(group) for group in touched.values()]

    def _output(self, group: SequenceGroup) -> RequestOutput:
        if group.is_finished:
            return self._finish_group(group, reason=None)
        return self.outputs.request_output(group)

    def _finish_group(self, group: SequenceGroup, reason: str | None,
                      error: str | None = None) -> RequestOutput:
        self.requests.pop(group.request_id, None)
        self.scheduler.release(group.request_id)
        for seq in group.seqs:
            self.guides.drop(seq.seq_id)
        if not self.requests and self._driver_cpus is not None:
            self._driver_cpus.follow(False)   # the caller's threads back on every CPU: it may stop stepping
        return self.outputs.finish(group, reason, error)

    def _on_pipeline_failure(self, message: str, step_id: int | None = None) -> list[RequestOutput]:
        """A stage died or stalled: replace the stages and replay every sequence from its
        token ids (its KV died with the stage), or, once ``--max-stage-restarts`` are
        spent (within ``--stage-restart-window``), end every request with an error.

        ``step_id``: the step a stage's runner raised on. Its requests are isolated (each
        runs its next micro-batch alone); if the model raises on such a micro-batch, its one
        request ends with the error and the others are replayed: a request that makes the
        model raise whenever it runs costs two restarts, not every request."""
        logger.error("pipeline failed: %s", message)
        culprit = self._suspect(step_id)
        self._discard_inflight()
        ended = []
        if culprit is not None and culprit in self.requests:
            logger.error("request %s ends: the model raised on it running alone", culprit)
            ended.append(self._fail_group(self.requests[culprit], f"the model raised on this request twice, the "
                                          f"second time running alone: {message}"))
        while self._restarts_left:
            failed = self._recover(message)
            if failed is None:
                return ended
            message = failed
        if self.recovery.restarts:
            message += f" (restarts used: {self._restarts_used()})"
        self._dead = message
        return ended + self._fail_all(message)

    def _suspect(self, step_id: int | None) -> str | None:
        """The request to end for the step a runner raised on: its only request, if that one
        was isolated already (it raised before too). Otherwise the step's requests are
        isolated, and None."""
        sched = self._inflight.get(step_id) if step_id is not None else None
        if sched is None:
            return None           # a death, a stall, a link: no step to blame
        batch = {item.seq.request_id for item in sched.scheduled}
        if len(batch) == 1 and batch <= self.scheduler.isolated:
            return next(iter(batch))
        self.scheduler.isolate(batch)
        return None

    def _recover(self, message: str) -> str | None:
        """One restart and replay; None when it worked, else why it did not."""
        start = time.monotonic()
        self.recovery.begin(message)
        try:
            self.executor.recover()
        except ExecutorError as exc:
            self.recovery.end(time.monotonic() - start, ok=False)
            logger.error("restarting the pipeline failed (restarts %s): %s", self._restarts_used(), exc)
            return str(exc)
        replayed = self.scheduler.replay_all()
        self.recovery.end(time.monotonic() - start, ok=True)
        logger.warning("pipeline restarted in %.1f s (restarts %s); replaying %d sequences",
                       self.recovery.durations[-1], self._restarts_used(), replayed)
        return None

    @property
    def _restarts_left(self) -> bool:
        return self.recovery.recent(self.config.stage_restart_window) < self.config.max_stage_restarts

    def _restarts_used(self) -> str:
        """E.g. "1 of 3 within 600 s: --max-stage-restarts 3, --stage-restart-window 600"."""
        window, most = self.config.stage_restart_window, self.config.max_stage_restarts
        used = self.recovery.recent(window)
        if window <= 0:
            return f"{used} of {most} in the engine's life: --max-stage-restarts {most}, --stage-restart-window 0"
        return f"{used} of {most} within {window:g} s: --max-stage-restarts {most}, --stage-restart-window {window:g}"

    def _fail_all(self, message: str) -> list[RequestOutput]:
        """The pipeline is gone: every request ends with finish_reason "error"."""
        self._discard_inflight()
        return [self._fail_group(group, message) for group in list(self.requests.values())]

    def _discard_inflight(self) -> None:
        """Every micro-batch in flight is lost with the pipeline: nothing it computed counts (the
        results held back for an older step of their sequences included)."""
        for sched in self._inflight.values():
            self.scheduler.on_step_failed(sched)
        self._inflight.clear()
        self._forwarding.clear()
        self._follows.clear()
        self._early.clear()

    def _fail_group(self, group: SequenceGroup, message: str) -> RequestOutput:
        """End one request with finish_reason "error" and ``message``."""
        unfinished = [s for s in group.seqs if not s.is_finished]
        self.scheduler.abort_request(group.request_id)
        for seq in unfinished:
            seq.finish_reason = "error"
        return self._finish_group(group, reason="error", error=message)

    # -- health and stats --------------------------------------------------
    @property
    def healthy(self) -> bool:
        """False while the pipeline is failed or being restarted (readable from any thread)."""
        return self._dead is None and not self.recovery.recovering and self.executor.healthy

    @property
    def recovering(self) -> bool:
        """The pipeline is being restarted, or a stage just failed and a restart is left."""
        return self.recovery.recovering or \
            (self.needs_recovery and self._restarts_left)

    @property
    def needs_recovery(self) -> bool:
        """A stage failed and the engine has not acted yet (it acts in ``step()``)."""
        return self._dead is None and not self.executor.healthy

    @property
    def stage_pids(self) -> dict[int, int]:
        """``{stage: pid}`` of the local stage processes now serving (PP > 1; {} otherwise)."""
        return self.executor.stage_pids

    def stats(self) -> dict:
        return {"scheduler": self.scheduler.stats(), "pipeline": self.executor.stats(),
                "num_kv_blocks": self.num_blocks, "num_host_blocks": self.num_host_blocks,
                "partition": self.partition, "healthy": self.healthy, "recovery": self.recovery.stats(),
                "weight_bytes": self.executor.weight_bytes(), "lm_head": self._lm_head_stats()}

    def _lm_head_stats(self) -> dict:
        """--pp-lm-head as resolved, and with ``shared`` how many steps' heads ran on stage 0."""
        balance = self._head_balance
        return {"mode": self.config.pp_lm_head, "steps_sampled": balance.heads if balance else None,
                "first_stage": balance.first_heads if balance else None}

    def profile(self) -> dict | None:
        """``--profile``: each stage's cumulative ``StageProfile`` and the driver's snapshot
        (``engine.driver_profile``); None without it."""
        if self.profiler is None:
            return None
        return {"stages": self.executor.profiles(), "driver": self.profiler.snapshot()}

    def write_trace(self, path: str) -> list[str]:
        """Chrome trace (and PNG Gantt chart beside it) of the stage timelines; PP > 1 only."""
        write = getattr(self.executor, "write_trace", None)
        if write is None:
            raise ValueError("timelines are recorded by the pipeline runtime: use pipeline_parallel_size > 1")
        return [str(p) for p in write(path)]

    def shutdown(self) -> None:
        """Stops the stages; the pipeline executor writes ``--trace-file`` as it stops."""
        self.executor.shutdown()


class _Background:
    """``fn(*args)`` on a thread; ``result()`` waits for it and returns or raises what it did."""

    def __init__(self, fn, *args) -> None:
        self._out: list = []
        self._thread = threading.Thread(target=self._run, args=(fn, args), name="pipeserve-init", daemon=True)
        self._thread.start()

    def _run(self, fn, args) -> None:
        try:
            self._out.append((True, fn(*args)))
        except BaseException as e:      # handed to result()'s caller
            self._out.append((False, e))

    def join(self) -> None:
        self._thread.join()

    def result(self):
        self._thread.join()
        ok, value = self._out[0]
        if not ok:
            raise value
        return value


def kv_concurrency(num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int) -> str:
    """How many sequences the KV cache holds at once (vLLM logs this "maximum concurrency"), at
    max_model_len tokens each and at a quarter of it; with a hint when the latter is below
    max_num_seqs, since that many sequences of such lengths then preempt each other."""
    tokens = num_blocks * block_size
    quarter = max(1, max_model_len // 4)
    text = (f"KV cache of {tokens} tokens: maximum concurrency {tokens / max_model_len:.2f} at max_model_len "
            f"({max_model_len} tokens), {tokens / quarter:.1f} at {quarter} tokens")
    if tokens < max_num_seqs * quarter:
        text += (f"; fewer than max_num_seqs ({max_num_seqs}): a larger --kv-cache-memory keeps that many "
                 "long sequences from preempting each other")
    return text


def resolve_preemption_mode(config: EngineConfig, kv_bytes: int, host_bytes: int, available: int | None,
                            weight_bytes: int = 0) -> str:
    """``--preemption-mode auto``: swap where the host pool is the same memory as the cache, i.e.
    CPU stages that all run on this host, and the weights (``weight_bytes``, not loaded yet) and
    the busiest stage's cache and pool for every stage fit in the memory available now
    (unknown: assumed to); else recompute, as before, so the pool never takes memory that a
    start without it had. A swap there is a copy of the sequence's blocks within RAM where a
    recompute is its whole prefill again: the reference workload at 256 requests ran 1.10x
    faster at PP = 2 (benchmarks/README.md, thirty-third session). On CUDA the pool is across
    PCIe, and remote stages' memory is not known here."""
    if config.device != "cpu" or config.nnodes != 1 or host_bytes <= 0:
        return "recompute"
    ranks = config.pipeline_parallel_size * config.tensor_parallel_size
    if available is not None and weight_bytes + ranks * (kv_bytes + host_bytes) > available:
        return "recompute"
    return "swap"
