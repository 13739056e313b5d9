"""The CPU KV cache's allocation (worker/model_runner.zeros_on_huge_pages)."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from pipeserve.worker.model_runner import zeros_on_huge_pages


@pytest.mark.parametrize("prefault", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_zeroed_writable_and_independent(prefault: bool, dtype: torch.dtype) -> None:
    shape = ((5 << 20) // (16 * 2 * 64 * dtype.itemsize), 16, 2, 64)   # 5 MiB: past two huge pages (advised)
    a, b = zeros_on_huge_pages(shape, dtype, prefault), zeros_on_huge_pages(shape, dtype, prefault)
    assert a.shape == shape and a.dtype == dtype and a.is_contiguous()
    raw = a.view(torch.uint8)
    assert int(raw.sum()) == 0
    raw[7].fill_(1)
    assert int(raw.sum()) == raw[7].numel() and int(b.view(torch.uint8).sum()) == 0
    if not prefault:   # the engine's cache: a fresh mapping, its rows on 2 MiB boundaries
        assert a.data_ptr() % (2 << 20) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads MemAvailable from /proc/meminfo (Linux)")
def test_a_cache_larger_than_the_available_memory_is_refused_at_start() -> None:
    # The engine's cache is faulted in lazily: without this check an oversized one would be
    # killed by the kernel mid-run (and again after each restart) instead of failing here.
    from pipeserve import LLM
    with pytest.raises(MemoryError, match="lower --kv-cache-memory"):
        LLM("smollm2-135m-instruct", kv_cache_memory="40000GiB")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the mapping's flags from /proc/self/maps (Linux)")
def test_the_lazy_cache_is_a_private_mapping() -> None:
    # A shared anonymous mapping (Python's mmap default) is shmem: transparent huge pages
    # never back it, and decode attention then pays a TLB miss per scattered KV block.
    t = zeros_on_huge_pages((5 << 20,), torch.uint8, prefault=False)
    address = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                assert perms == "rw-p", line
                return
    pytest.fail(f"no mapping holds {address:#x}")


def _resident_pages(t: torch.Tensor) -> int:
    """Pages of t's memory that are mapped in (mincore)."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    n = t.numel() * t.element_size()
    pages = (n + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(t.data_ptr(), n, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE and mincore are Linux's")
def test_the_lazy_cache_is_populated_in_the_background_keeping_what_was_written() -> None:
    from pipeserve.worker.model_runner import populate_cache
    caches = [zeros_on_huge_pages((6 << 20,), torch.uint8, prefault=False) for _ in range(2)]
    caches[1][(5 << 20) + 3] = 7        # a KV row written before the thread gets there
    assert _resident_pages(caches[0]) == 0
    thread = populate_cache(caches)
    assert thread is not None
    thread.join(timeout=60)
    if _resident_pages(caches[0]) == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+): the cache faults in as written")
    pages = (6 << 20) // __import__("mmap").PAGESIZE
    assert [_resident_pages(c) for c in caches] == [pages, pages]
    assert int(caches[1].sum()) == 7 and int(caches[0].sum()) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore is Linux's")
def test_the_background_population_leaves_the_node_a_reserve(monkeypatch) -> None:
    from pipeserve.worker import model_runner
    monkeypatch.setattr(model_runner, "available_bytes", lambda: 512 << 20)   # under the 1 GiB reserve
    cache = zeros_on_huge_pages((6 << 20,), torch.uint8, prefault=False)
    model_runner.populate_cache([cache]).join(timeout=60)
    assert _resident_pages(cache) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE and mincore are Linux's")
def test_the_cache_is_mapped_in_up_front_within_the_time_given() -> None:
    """A stage maps its cache in before it starts for up to ``upfront_s`` (no thread left when
    that suffices); past it, the rest goes to the idle-priority thread."""
    from pipeserve.worker.model_runner import populate_cache
    pages = (6 << 20) // __import__("mmap").PAGESIZE
    caches = [zeros_on_huge_pages((6 << 20,), torch.uint8, prefault=False) for _ in range(2)]
    caches[0][123] = 5
    if populate_cache(caches, upfront_s=60.0) is not None:
        pytest.fail("6 MiB took over a minute to map in, or the background thread was started anyway")
    if _resident_pages(caches[0]) == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+): the cache faults in as written")
    assert [_resident_pages(c) for c in caches] == [pages, pages]
    assert int(caches[0].sum()) == 5 and int(caches[1].sum()) == 0
    late = [zeros_on_huge_pages((6 << 20,), torch.uint8, prefault=False) for _ in range(2)]
    thread = populate_cache(late, upfront_s=1e-9)   # one chunk up front, then the deadline
    assert thread is not None
    thread.join(timeout=60)
    assert [_resident_pages(c) for c in late] == [pages, pages]
    pool = [zeros_on_huge_pages((6 << 20,), torch.uint8, prefault=False) for _ in range(2)]
    assert populate_cache(pool, upfront_s=1e-9, background=False) is None   # the host pool: no thread
    time.sleep(0.2)
    assert 0 < _resident_pages(pool[0]) < pages and _resident_pages(pool[1]) == 0


def test_a_replacement_stage_maps_in_less_of_its_cache_before_it_serves(tiny_checkpoints, monkeypatch) -> None:
    """A first start maps the whole cache in for up to POPULATE_UPFRONT_S, then the host pool for
    swaps (its first POPULATE_HOST_BYTES a tensor) for up to POPULATE_HOST_UPFRONT_S; a stage that
    replaces a failed one (``PipelineSpec.replacement``: set by ``PipelineExecutor.recover``,
    carried to the stage by its ``SpecWire``) the cache for up to POPULATE_REPLACEMENT_S and none
    of the pool, as the engine waits on it."""
    import dataclasses

    from pipeserve.config import EngineConfig
    from pipeserve.model.loader import resolve_model
    from pipeserve.pipeline.spec import PipelineSpec, SpecWire
    from pipeserve.pipeline.stage_process import build_runners
    from pipeserve.worker import model_runner
    seen = []
    mapped = []
    monkeypatch.setattr(model_runner, "populate_cache",
                        lambda tensors, upfront_s=0.0, **kw: (seen.append((upfront_s, kw.get("background", True))),
                                                              mapped.append(sum(t.nbytes for t in tensors))))
    source = resolve_model(str(tiny_checkpoints("llama_tied_gqa")))
    cfg = source.load_config()
    block_bytes = 16 * cfg.num_kv_heads * cfg.head_dim * 4                 # float32 K (or V), 16 tokens
    pool_blocks = 2 * model_runner.POPULATE_HOST_BYTES // block_bytes     # twice what is mapped in
    spec = PipelineSpec(EngineConfig(dtype="float32", threads_per_stage=1), source, cfg, [(0, cfg.num_layers)],
                        4, pool_blocks)
    assert not spec.replacement
    for replacement in (False, True):
        wire = SpecWire.of(dataclasses.replace(spec, replacement=replacement))
        build_runners(wire.to_spec(), 0, torch.device("cpu"))
    assert seen == [(model_runner.POPULATE_UPFRONT_S, True), (model_runner.POPULATE_HOST_UPFRONT_S, False),
                    (model_runner.POPULATE_REPLACEMENT_S, True)]
    tensors = 2 * cfg.num_layers
    assert mapped == [tensors * 4 * block_bytes, tensors * model_runner.POPULATE_HOST_BYTES, tensors * 4 * block_bytes]
    assert model_runner.POPULATE_REPLACEMENT_S < model_runner.POPULATE_UPFRONT_S
