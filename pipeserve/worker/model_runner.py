"""One pipeline stage's compute: its layers' weights, their paged KV cache, a forward step.

Used in-process for PP = 1 and inside each stage process for PP > 1. The
runner makes no decisions: the ``StepInput`` says which tokens to run, where
their KV lives and which blocks to move first.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import os
import sys
import threading
import time
import weakref

import torch

from pipeserve.model.attention import AttentionBackend, AttentionMetadata, KVCache
from pipeserve.model.config import ModelConfig
from pipeserve.model.kv_quant import cache_dtype, row_elements
from pipeserve.model.layers import Linear
from pipeserve.model.llama import LlamaModel
from pipeserve.model.loader import ModelSource, load_model
from pipeserve.model.quant.load import describe, weight_bytes
from pipeserve.model.quant.modules import QuantEmbedding, QuantLinear
from pipeserve.sampling.sampler import Sampler
from pipeserve.worker import thread_governor
from pipeserve.worker.step import SampledToken, StepInput, StepOutput

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, source: ModelSource, cfg: ModelConfig, *, start_layer: int, end_layer: int,
                 is_first: bool, is_last: bool, dtype: torch.dtype, device: torch.device,
                 num_blocks: int, num_host_blocks: int, block_size: int,
                 sampler_seed: int | None = None, attention_backend: str = "auto",
                 quantization: str = "auto", quantization_group_size: int = 32, kv_cache_dtype: str = "auto",
                 prepack_weights: bool = False,
                 tp=None, replacement: bool = False, head: bool = False) -> None:
        """``tp``: this stage's tensor-parallel group (``pipeserve.model.tensor_parallel``);
        the runner then holds its rank's slices and KV heads, and only TP rank 0 of the
        last stage samples (the others return an empty ``StepOutput``). ``kv_cache_dtype``:
        ``--kv-cache-dtype`` (auto: the model dtype; int8 / fp8: ``model/kv_quant.py``).
        ``replacement``: the stage replaces one that failed, and the engine waits on it: its
        KV cache is mapped in for at most ``POPULATE_REPLACEMENT_S`` before it serves, not
        ``POPULATE_UPFRONT_S`` (``populate_cache``). ``head``: a first stage that also holds the
        final norm and the LM head (its embedding, where the model ties them) and samples the
        steps whose head is its (``--pp-lm-head shared``: ``sample``, ``pipeline/lm_head.py``)."""
        if num_blocks < 1 or block_size < 1 or num_host_blocks < 0:
            raise ValueError(f"need num_blocks >= 1, block_size >= 1, num_host_blocks >= 0; got "
                             f"{num_blocks}, {block_size}, {num_host_blocks}")
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.kv_dtype = cache_dtype(kv_cache_dtype, dtype)   # refuses an unknown name
        self.is_first, self.is_last = is_first, is_last
        self.block_size, self.num_blocks, self.num_host_blocks = block_size, num_blocks, num_host_blocks
        self.model: LlamaModel = load_model(source, cfg, start_layer, end_layer, is_first, is_last or head,
                                            dtype, self.device, attention_backend, quantization,
                                            quantization_group_size, tp=tp)
        if self.device.type == "cpu" and os.environ.get("PIPESERVE_HUGE_WEIGHTS", "1") != "0":
            start = time.perf_counter()
            arena = weights_to_huge_pages(self.model)
            if arena:
                log.info("kept-quantized weights: one %.1f MiB arena advised for 2 MiB pages (%.2f s)",
                         arena / 2**20, time.perf_counter() - start)
        if prepack_weights:
            for module in self.model.modules():
                if isinstance(module, Linear):
                    module.prepack = True
                    module.packed.prepare(module.weight, module.bias)
        self.weight_bytes = weight_bytes(self.model)
        log.info("layers [%d, %d): %.1f MiB of weights resident (%s)", start_layer, end_layer,
                 self.weight_bytes / 2**20, describe(self.model))
        self.kv_caches = self._allocate(num_blocks, self.device, pin=False)
        self.host_caches = self._allocate(num_host_blocks, torch.device("cpu"), pin=self.device.type == "cuda")
        if self.device.type == "cpu":
            self._map_in(replacement)
        kv_bytes = sum(t.numel() * t.element_size() for pair in self.kv_caches for t in pair)
        log.info("KV cache: %d blocks of %d tokens, %s (%s), %.1f MiB", num_blocks, block_size, kv_cache_dtype,
                 str(self.kv_dtype).removeprefix("torch."), kv_bytes / 2**20)
        # One sampler for the runner's life: it owns the RNG of unseeded rows.
        self.sampler = Sampler(sampler_seed) if is_last or head else None

    def _map_in(self, replacement: bool) -> None:
        """Map a CPU stage's lazily mapped caches in at start-up (``populate_cache``): its own KV
        cache for up to POPULATE_UPFRONT_S (a replacement stage: POPULATE_REPLACEMENT_S) and the
        rest by a background thread; then the first POPULATE_HOST_BYTES of each of the host pool's
        tensors (none in a replacement stage), the rest faulting in as written."""
        populate_cache([t for pair in self.kv_caches for t in pair],
                       upfront_s=POPULATE_REPLACEMENT_S if replacement else POPULATE_UPFRONT_S)
        pool = [t for pair in self.host_caches for t in pair]
        if pool and pool[0].numel() and not replacement:
            head = max(1, POPULATE_HOST_BYTES // (pool[0][0].numel() * pool[0].element_size()))
            populate_cache([t[:head] for t in pool], upfront_s=POPULATE_HOST_UPFRONT_S, background=False,
                           what="host pool for swaps")

    def _allocate(self, blocks: int, device: torch.device, pin: bool) -> list[KVCache]:
        """The per-layer (K, V) tensors of ``blocks`` blocks (``_map_in`` maps a CPU stage's in)."""
        # The model's config: under tensor parallelism, this rank's KV heads only.
        row = row_elements(self.cfg.head_dim, self.kv_dtype)   # head_dim (+ a scale's bytes when 8-bit)
        shape = (blocks, self.block_size, self.model.cfg.num_kv_heads, row)

        if device.type == "cpu" and not pin and blocks:
            check_kv_fits(2 * self.model.num_layers * math.prod(shape) * self.kv_dtype.itemsize)

        def make() -> torch.Tensor:
            if device.type == "cpu" and not pin:
                return zeros_on_huge_pages(shape, self.kv_dtype, prefault=False)
            # torch.zeros has no float8 kernel on every device: zero the bytes.
            t = torch.zeros(shape, dtype=torch.uint8 if self.kv_dtype.itemsize == 1 else self.kv_dtype,
                            device=device).view(self.kv_dtype)
            return t.pin_memory() if pin else t

        return [(make(), make()) for _ in range(self.model.num_layers)]

    # -- one step ----------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: StepInput, hidden_states: torch.Tensor | None = None) -> torch.Tensor | StepOutput:
        """Non-last stage: hidden states [num_tokens, hidden]. Last stage: the sampled tokens, or,
        for a step whose head runs on the first stage (``head_first``), the hidden states of the
        rows that sample [S, hidden], for its ``sample``."""
        thread_governor.tick()
        self._move_blocks(step)
        hidden = self._forward(step, hidden_states)
        if not self.is_last:
            return hidden
        if not any(s.sampling is not None for s in step.seqs):
            return StepOutput(step.step_id, [])
        if step.head_first:
            return _sample_hidden(hidden, step)
        return self.sample(step, _sample_hidden(hidden, step))

    @torch.inference_mode()
    def sample(self, step: StepInput, rows: torch.Tensor) -> StepOutput:
        """The final norm, the head and the sampler on ``rows`` [S, hidden]: the last new token's
        hidden states of each sequence of ``step`` that samples, in order."""
        sampled_seqs = [s for s in step.seqs if s.sampling is not None]
        logits = self.model.compute_logits(rows, widen=False)  # [S, vocab]
        if logits is None:  # a tensor-parallel rank other than 0: rank 0 samples
            return StepOutput(step.step_id, [])
        results = self.sampler.sample(logits, [s.sampling for s in sampled_seqs])
        return StepOutput(step.step_id, [
            SampledToken(seq.seq_id, token, logprob, top)
            for seq, (token, logprob, top) in zip(sampled_seqs, results)])

    @torch.inference_mode()
    def forward_logits(self, step: StepInput, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [num sampled seqs, vocab] of the last token of each
        sequence with ``sampling`` set; for tests and scoring (last stage only)."""
        if not self.is_last:
            raise RuntimeError("forward_logits needs the last stage")
        self._move_blocks(step)
        hidden = self._forward(step, hidden_states)
        return self.model.compute_logits(_sample_hidden(hidden, step))

    @torch.inference_mode()
    def prepare_ahead(self, step: StepInput) -> None:
        """Build a step's attention metadata and positions before it runs: they do not depend on
        its input tokens, so a first stage builds them while it waits for a decode ahead's tokens
        (StageWorker), and the token's arrival starts the forward at once. Its forward uses them."""
        if step.seqs and "_prepared" not in step.__dict__:
            step.__dict__["_prepared"] = self._prepare(step)

    def _forward(self, step: StepInput, hidden_states: torch.Tensor | None) -> torch.Tensor:
        if not step.seqs:
            return torch.empty(0, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        prepared = step.__dict__.pop("_prepared", None)
        meta, positions = prepared if prepared is not None else self._prepare(step)
        if self.is_first:   # the ids as a list: the embedding makes a tensor of them where it needs one
            x = [t for s in step.seqs for t in s.token_ids]
        else:
            if hidden_states is None:
                raise ValueError("a stage that is not first needs the previous stage's hidden_states")
            x = hidden_states.to(self.device)                               # [num_tokens, hidden]
        return self.model.forward(x, positions, meta, self.kv_caches)   # no hooks: see LlamaModel.forward

    def _prepare(self, step: StepInput) -> tuple[AttentionMetadata, torch.Tensor]:
        return prepare_step(step, self.model.backend, self.block_size, self.device)

    # -- KV block movement ---------------------------------------------------
    def _move_blocks(self, step: StepInput) -> None:
        # Order matters: swap-outs free device blocks that swap-ins may reuse.
        if step.swap_out:
            self._copy_between(self.kv_caches, self.host_caches, step.swap_out, self.num_host_blocks)
        if step.swap_in:
            self._copy_between(self.host_caches, self.kv_caches, step.swap_in, self.num_blocks)
        if step.copies:
            self._copy_between(self.kv_caches, self.kv_caches, step.copies, self.num_blocks)

    @staticmethod
    def _copy_between(src_caches: list[KVCache], dst_caches: list[KVCache],
                      pairs: list[tuple[int, int]], dst_blocks: int) -> None:
        if not src_caches:  # a stage with no layers holds no KV
            return
        if any(not 0 <= d < dst_blocks for _, d in pairs):
            raise ValueError(f"block move {pairs} targets a block outside the pool of {dst_blocks}")
        src_device, dst_device = src_caches[0][0].device, dst_caches[0][0].device
        src_idx = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=src_device)
        dst_idx = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=dst_device)
        for src_pair, dst_pair in zip(src_caches, dst_caches):
            for src, dst in zip(src_pair, dst_pair):
                dst[dst_idx] = src[src_idx].to(dst_device)  # the gather copies first: safe for chains


def _sample_hidden(hidden: torch.Tensor, step: StepInput) -> torch.Tensor:
    """The rows of ``hidden`` [num_tokens, hidden] of the last new token of each sequence
    that samples this step."""
    rows, end = [], 0
    for s in step.seqs:
        end += len(s.token_ids)
        if s.sampling is not None:
            rows.append(end - 1)
    # Increasing and distinct, so as many as there are rows means all of them (every
    # sequence decodes and samples): no indexing copy (~10 us a step).
    return hidden if len(rows) == hidden.shape[0] else hidden[rows]


def prepare_step(step: StepInput, backend: AttentionBackend, block_size: int,
                 device: torch.device) -> tuple[AttentionMetadata, torch.Tensor]:
    """A step's attention metadata and token positions ([num_tokens] int64), as every
    stage builds them before its forward; public so that calibration times this code."""
    query_lens = [len(s.token_ids) for s in step.seqs]
    context_lens = [s.start_pos + q for s, q in zip(step.seqs, query_lens)]
    meta = backend.build_metadata(query_lens, context_lens, [s.block_table for s in step.seqs], block_size, device)
    meta.seq_lens = [s.seq_len or ctx for s, ctx in zip(step.seqs, context_lens)]
    pos = [p for s, q in zip(step.seqs, query_lens) for p in range(s.start_pos, s.start_pos + q)]
    return meta, torch.tensor(pos, dtype=torch.int64, device=device)


_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


def check_kv_fits(nbytes: int) -> None:
    """Refuse a CPU KV cache larger than the memory available now. Its pages are only
    touched as blocks are first written, so an oversized cache would not fail here but
    when the engine fills it, killed by the kernel mid-run and again after every restart.
    Each stage checks its own; the engine checks its local stages' before starting them."""
    available = available_bytes()
    if available is not None and nbytes > available:
        raise MemoryError(f"the KV cache needs {nbytes / 2**30:.1f} GiB on this stage but the node has "
                          f"{available / 2**30:.1f} GiB available: lower --kv-cache-memory (or --swap-space)")


def available_bytes() -> int | None:
    """The node's MemAvailable, or None where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, prefault: bool = True) -> torch.Tensor:
    """A zeroed CPU tensor whose memory the kernel may back with 2 MiB pages.

    Decode attention reads KV blocks scattered over the whole cache; with 4 KiB
    pages nearly every block costs a TLB miss. Where transparent huge pages are
    in ``madvise`` mode, advising the (still untouched) allocation before
    touching it makes the faults allocate huge pages. Best effort: elsewhere it
    is plain zeros.

    ``prefault=False`` (the engine's KV cache): the memory is a fresh anonymous
    mapping, zero by the kernel's guarantee, and is not written here: its pages
    fault in as blocks are first written, so a stage starts (and a restarted one
    rejoins) without writing its whole cache first (1 GiB by default, seconds in a
    VM whose host backs guest memory lazily), and untouched blocks cost no memory.
    Only for memory that is written before it is read: a read of an untouched page
    maps the shared zero page, so a benchmark reading cache it never wrote would
    time the cache, not memory (they keep the default).
    """
    storage = torch.uint8 if dtype.itemsize == 1 else dtype    # zero_() has no float8 kernel
    nbytes = math.prod(shape) * storage.itemsize
    huge = sys.platform.startswith("linux") and nbytes >= 2 * _HUGE_PAGE
    if not prefault and huge:
        # Private: Python's default for an anonymous map is MAP_SHARED, which is shmem and
        # gets no transparent huge pages. Zero-filled on first touch.
        buf = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        offset = -base % _HUGE_PAGE
        _advise_huge(base + offset, nbytes)
        return torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset).view(storage).view(shape).view(dtype)
    t = torch.empty(shape, dtype=storage)
    if huge:
        _advise_huge(t.data_ptr(), nbytes)
    return t.zero_().view(dtype)


_MADV_POPULATE_WRITE = 23   # Linux 5.14+
_POPULATE_CHUNK = 2 * _HUGE_PAGE
_POPULATE_RESERVE = 1 << 30     # the node's memory the background population leaves free
# A stage's start-up maps its KV cache in for at most this long (populate_cache), as vLLM's
# zeroed cache is committed at start: the default 1 GiB in 0.2-0.3 s where the host backs the
# guest's memory, in 2.1-2.6 s on this VM kind one day and 4.4-9.2 s another (page reporting
# hands the host back what the guest frees); a larger cache on such a host maps the rest in the
# background, and the stage still loads within the driver's --rendezvous-timeout (60 s).
POPULATE_UPFRONT_S = 20.0
# A stage that replaces a failed one (PipelineSpec.replacement): the engine's requests wait on
# it, so it serves after at most this long and maps the rest in the background.
POPULATE_REPLACEMENT_S = 3.0
# The host pool for swaps, after the cache: the first POPULATE_HOST_BYTES of each layer's K and V
# (the blocks HostBlockPool hands out first; swapped sequences come back, so they serve most runs),
# for at most POPULATE_HOST_UPFRONT_S and not in the background (the rest faults in as written).
# Unmapped, a reference run's first swap-outs stopped both stages for 0.18-0.80 s, each layer's K
# and V faulting in a 2 MiB page. A replacement stage maps none of it in.
POPULATE_HOST_BYTES = 2 * _HUGE_PAGE
POPULATE_HOST_UPFRONT_S = 1.0


def populate_cache(tensors: list[torch.Tensor], upfront_s: float = 0.0, background: bool = True,
                   what: str = "KV cache") -> threading.Thread | None:
    """Fault in the lazily mapped KV cache (``zeros_on_huge_pages(prefault=False)``), a chunk of
    each tensor in turn from the first block on, as the block manager hands blocks out: on the
    calling thread for up to ``upfront_s`` seconds, the rest on a thread of the lowest priority
    (SCHED_IDLE: it runs only where a core has nothing else to do; with ``background=False`` the
    rest faults in as written). Returns that thread, or None where nothing is left for it.
    ``what``: the memory's name in the log line.

    A page's first write costs its zeroing, and in a VM whose host backs guest memory lazily the
    host's fault too (0.1-10 s per GiB on the machines measured), paid by the attention's KV
    writes. The idle thread alone did not keep ahead of them when a benchmark starts at once (a
    stage busy 92 % of a reference run still had 2.7 s of faulting writes, 4.4 % of its time;
    with 2 MiB pages the step that first writes past a page's end faults one in every layer's
    K and V, and stopped a stage for 0.25-0.78 s in mid-run, the other stage idle meanwhile),
    and where it ran beside a stage it delayed the stage's next message (a hop's p99 4 ms): the
    engine maps the cache in at start-up, bounded so that a huge cache on a slow host, or a
    stage that replaces a failed one, still serves within its bound. MADV_POPULATE_WRITE maps the
    pages writable without changing what they hold, so the thread may run beside the stage's own
    writes. It stops where the node has less than 1 GiB available (the cache was checked against
    the memory available at start; other processes may have taken some since): the rest faults in
    as written. Best effort: nothing on kernels without it, or with PIPESERVE_KV_POPULATE=0."""
    if not sys.platform.startswith("linux") or os.environ.get("PIPESERVE_KV_POPULATE", "1") == "0":
        return None
    # weak references: a cache dropped meanwhile (a stage reset) is not populated further
    regions = [(weakref.ref(t), t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
    if not regions:
        return None
    chunks = _population_chunks(regions)
    deadline = time.perf_counter() + upfront_s
    if upfront_s > 0:
        t0, done = time.perf_counter(), 0
        for nbytes in chunks:
            if nbytes < 0:
                return None
            done += nbytes
            if time.perf_counter() >= deadline:
                break
        else:
            log.info("%s mapped in at start-up: %.1f MiB in %.2f s", what, done / 2**20, time.perf_counter() - t0)
            return None
        total = sum(n for _, _, n in regions)
        log.info("%s mapped in at start-up: %.1f of %.1f MiB in %.2f s; the rest %s", what, done / 2**20,
                 total / 2**20, time.perf_counter() - t0,
                 "in the background at idle priority" if background else "faults in as written")
    if not background:
        return None

    def run() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # this thread only
        except (AttributeError, OSError):
            pass
        for nbytes in chunks:
            if nbytes < 0:
                return
    thread = threading.Thread(target=run, name="kv-populate", daemon=True)
    thread.start()
    return thread


def _population_chunks(regions: list[tuple[weakref.ref, int, int]]):
    """Map in _POPULATE_CHUNK bytes of each region in turn, yielding the bytes of each; -1 (and
    stop) where the node's reserve is reached, a region is gone or madvise refuses."""
    madvise = _madvise()
    page = mmap.PAGESIZE
    for offset in range(0, max(n for _, _, n in regions), _POPULATE_CHUNK):
        available = available_bytes()
        if available is not None and available < _POPULATE_RESERVE + len(regions) * _POPULATE_CHUNK:
            yield -1
            return
        for alive, address, nbytes in regions:
            start = (address + offset) // page * page
            stop = min(address + nbytes, address + offset + _POPULATE_CHUNK)
            if start >= stop:
                continue
            if alive() is None or madvise(start, stop - start, _MADV_POPULATE_WRITE) != 0:
                yield -1    # the cache is gone, or the kernel has no MADV_POPULATE_WRITE (EINVAL)
                return
            yield stop - start


def _advise_huge(address: int, nbytes: int) -> None:
    """MADV_HUGEPAGE on the whole 2 MiB pages of [address, address + nbytes); best effort."""
    start = (address + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    end = (address + nbytes) & ~(_HUGE_PAGE - 1)
    if end <= start:
        return
    try:
        _madvise()(start, end - start, _MADV_HUGEPAGE)
    except (OSError, AttributeError):
        pass


@functools.cache
def _madvise():
    """libc's madvise(address, length, advice) through ctypes, bound once."""
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


def weights_to_huge_pages(model: torch.nn.Module) -> int:
    """The stage's kept-quantized weights (every ``QuantLinear`` / ``QuantEmbedding`` buffer:
    codes, scales, minimums) moved into one arena that the kernel may back with 2 MiB pages
    (``zeros_on_huge_pages``), in module order, each 64-byte aligned; returns the arena's bytes
    (0: left where they were, under 4 MiB in all).

    A decode step streams every weight byte once; on 4 KiB pages each page is a TLB miss and
    the hardware prefetchers stop at its end (one request, 2 threads: SmolLM2's Q4_1 file
    1.06-1.12x the tokens a second, a 2048-wide Q4_K_M 1.12x; dense bfloat16 SmolLM2, whose
    decode is not bound by its weight stream, 1.01x, so dense weights stay where they are;
    benchmarks/README.md). One tensor at a time: each is copied, every module holding it
    takes the copy and the old one goes, so a stage peaks at its weights plus one tensor, not
    twice its weights. A tensor two modules share (a tied head) stays shared; values are
    copied bit for bit."""
    key = lambda t: (t.data_ptr(), t.dtype, tuple(t.shape))   # noqa: E731
    holders: dict = {}     # key -> [(module, buffer name)]
    sizes: dict = {}
    modules = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    for module in modules:
        for name, t in module._buffers.items():
            if t is not None and t.device.type == "cpu" and t.is_contiguous() and t.numel():
                holders.setdefault(key(t), []).append((module, name))
                sizes[key(t)] = t.numel() * t.element_size()
    total = sum((n + 63) & ~63 for n in sizes.values())
    if total < 2 * _HUGE_PAGE:
        return 0
    arena = zeros_on_huge_pages((total,), torch.uint8, prefault=False)
    offset = 0
    for k, where in holders.items():
        module, name = where[0]
        old = module._buffers[name]
        view = arena[offset:offset + sizes[k]].view(old.dtype).view(old.shape)
        view.copy_(old)
        del old
        for module, name in where:
            module._buffers[name] = view
        offset += (sizes[k] + 63) & ~63
    for module in modules:
        module._apply(lambda t: t, recurse=False)   # forget what was derived from the old buffers
    return total
