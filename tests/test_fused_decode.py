"""The fused C decode stage (pipeserve/model/cpu_decode.py) against the Python layers it replaces.

With one thread it must be bit for bit the Python path (same kernels, same order);
with two, the attention's work is cut over the threads and merged, so logits move
by float32 rounding only and greedy tokens stay the same. Steps it does not take
(prefills, more rows than the decode kernel, other dtypes, families, backends) run
the Python layers.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeserve.model.loader import resolve_model
from pipeserve.worker.model_runner import ModelRunner
from pipeserve.worker.step import SeqSampling, SeqStep, StepInput
from tests.checkpoints import build_checkpoint, layer_matmul_flops

def _fused_stage_available() -> str | None:
    """Why the fused stage cannot run on this machine, or None."""
    from pipeserve.kernels.build import KernelBuildError, load_kernel
    from pipeserve.model.quant.cpu_kernels import cpu_kernels
    kernels = cpu_kernels()
    if kernels is None or not kernels.has_integer_activations:
        return "this CPU's decode gemv has no integer activations (portable build): the fused stage does not apply"
    try:
        load_kernel("decode_stage")
    except KernelBuildError as exc:
        return f"decode_stage.c does not build here: {exc}"
    return None


_WHY_NOT = _fused_stage_available()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=_WHY_NOT or "")

BLOCK = 16
GREEDY = SeqSampling(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, step_index=0)


def _runner(source, cfg, quantization="auto", dtype=torch.float32, start=0, end=None, backend="auto",
            group=32, kv_cache_dtype="auto", num_blocks=64) -> ModelRunner:
    end = cfg.num_layers if end is None else end
    return ModelRunner(source, cfg, start_layer=start, end_layer=end, is_first=start == 0,
                       is_last=end == cfg.num_layers, dtype=dtype, device=torch.device("cpu"), num_blocks=num_blocks,
                       num_host_blocks=0, block_size=BLOCK, quantization=quantization, attention_backend=backend,
                       quantization_group_size=group, kv_cache_dtype=kv_cache_dtype)


def _decode_logits(runners, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Prefill each prompt (as its own sequence), then ``steps`` greedy decode steps of all of
    them together through the stages ``runners`` (chained); the logits of every decode step."""
    tables, used = [], 0
    for p in prompts:                       # just the blocks each sequence fills
        n = -(-(len(p) + steps) // BLOCK)
        tables.append(list(range(used, used + n)))
        used += n

    def run(step: StepInput) -> torch.Tensor:
        hidden = None
        for r in runners[:-1]:
            hidden = r.execute(step, hidden)
        return runners[-1].forward_logits(step, hidden)

    last = [int(run(StepInput(0, [SeqStep(i, p, 0, tables[i], GREEDY)])).argmax()) for i, p in enumerate(prompts)]
    pos = [len(p) for p in prompts]
    out = []
    for s in range(steps):
        step = StepInput(s + 1, [SeqStep(i, [last[i]], pos[i], tables[i], GREEDY) for i in range(len(prompts))])
        logits = run(step)
        out.append(logits)
        last = [int(t) for t in logits.argmax(-1)]
        pos = [p + 1 for p in pos]
    return out


def _compare(fused, python, exact: bool) -> float:
    worst = 0.0
    for a, b in zip(fused, python, strict=True):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        worst = max(worst, (a - b).abs().max().item())
    if exact:
        assert worst == 0.0
    else:   # float32 rounding of the attention's merge order, carried through the layers
        assert worst < 2e-2 * max(b.abs().max().item() for b in python), worst
    return worst


def _fused_equals_python(make_runner, dtype, threads: int, steps: int, sequences: int | None = None) -> ModelRunner:
    """The runner ``make_runner`` builds at ``threads`` threads decodes 13 float32 sequences
    (the gemv in two passes on VNNI, one on AVX2) or 3 bfloat16 ones (the gemv: the 8-bit kernel
    takes bfloat16 from 4 rows at the earliest but IQ4's 2; or ``sequences``) ``steps`` steps
    through the fused stage and through the Python layers: bit for bit at one thread, else up to
    the merge order."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runner = make_runner()
        n = sequences or (13 if dtype == torch.float32 else 3)
        prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(n)]
        fused = _decode_logits([runner], prompts, steps)
        assert runner.model.fused_decode and runner.model.fused_decode.max_rows >= n   # every step its own
        runner.model.fused_decode = False
        _compare(fused, _decode_logits([runner], prompts, steps), exact=threads == 1)
        return runner
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def smollm2():
    """The built-in GGUF (kept Q4_1) as one stage and as two: loaded once for the module."""
    source = resolve_model("smollm2-135m-instruct")
    cfg = source.load_config()
    return _runner(source, cfg), [_runner(source, cfg, start=0, end=16), _runner(source, cfg, start=16)]


@pytest.mark.parametrize("threads", [1, 2])
def test_smollm2_kept_q4_1_fused_equals_python_layers(smollm2, threads):
    """One sequence, then three of different lengths in one step, at one stage and split
    over two stages (the second stage's input is hidden states)."""
    whole, halves = smollm2
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        prompts = [list(range(1000, 1040)), list(range(2000, 2007)), list(range(3000, 3100))]
        for stages, batch in (([whole], prompts[:1]), ([whole], prompts), (halves, prompts)):
            fused = _decode_logits(stages, batch, 4)
            assert all(r.model.fused_decode for r in stages), "the fused stage should apply here"
            for r in stages:
                r.model.fused_decode = False
            python = _decode_logits(stages, batch, 4)
            for r in stages:
                r.model.fused_decode = None   # decided again at the next forward
            _compare(fused, python, exact=threads == 1)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("kind, mode, window, dtype", [
    ("qwen2_bias", "int8", None, torch.float32), ("mistral", "int4", 12, torch.float32),
    ("llama3_rope", "int8", None, torch.float32), ("qwen2_bias", "int4", 12, torch.bfloat16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_tiny_families_fused_equals_python_layers(kind, mode, window, dtype, threads, tmp_path):
    """q/k/v bias (Qwen2), a sliding window shorter than the context (Mistral-style, one KV
    head), Llama 3 RoPE, bfloat16 activations and cache; float32 steps of 13 sequences (the
    gemv in two passes), bfloat16 ones of 4."""
    source = resolve_model(str(build_checkpoint(kind, tmp_path)))
    cfg = source.load_config()
    if window is not None:
        cfg = dataclasses.replace(cfg, sliding_window=window)
    _fused_equals_python(lambda: _runner(source, cfg, quantization=mode, dtype=dtype), dtype, threads, 10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_qwen3_q_k_norms_fused_equal_python_layers(dtype, threads, tmp_path):
    """Qwen3: an RMSNorm over each head of q and k before RoPE (head_dim 24, not hidden /
    heads), sliding layers; 13 float32 sequences (two gemv passes), 4 bfloat16 ones."""
    from tests.test_families import build_family
    source = resolve_model(str(build_family("qwen3", tmp_path)))
    cfg = source.load_config()
    assert cfg.qk_norm
    _fused_equals_python(lambda: _runner(source, cfg, quantization="int8", dtype=dtype), dtype, threads, 8)


@pytest.mark.parametrize("kind, dtype", [("llama_tied_gqa", torch.float32), ("qwen2_bias", torch.float32),
                                         ("qwen2_bias", torch.bfloat16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_layers_of_mixed_gguf_types_fused_equal_python_layers(kind, dtype, threads, tmp_path):
    """A GGUF whose q, k and v have three types (Q8_0, Q4_1, Q4_0: two layouts, the last two
    one kind of activations) and gate and up two, as K-quant mixes write them: each linear
    stays in parts, and the fused stage multiplies each part in its own layout (with the
    bias across the parts' columns, Qwen2) as the Python layers do."""
    from tests.checkpoints import write_llama_gguf
    gguf = write_llama_gguf(build_checkpoint(kind, tmp_path / "hf"), tmp_path / "mixed.gguf", qtype="Q8_0",
                            qtypes={"attn_k": "Q4_1", "attn_v": "Q4_0", "ffn_up": "Q4_1"})
    source = resolve_model(str(gguf))
    cfg = source.load_config()
    layer = _fused_equals_python(lambda: _runner(source, cfg, dtype=dtype), dtype, threads, 6).model.layers[0]
    assert [p.source for p in layer.self_attn.qkv_proj.parts] == ["Q8_0", "Q4_1", "Q4_0"]
    assert [p.source for p in layer.mlp.gate_up_proj.parts] == ["Q8_0", "Q4_1"]


@pytest.mark.parametrize("threads", [1, 2])
def test_avx2_q8_parts_take_48_decodes_fused(threads, tmp_path):
    """AVX2: a linear with a q8 part takes up to PROMPT_INT8_MAX_ROWS["q8"] decodes in the fused
    stage, in one call of the integer gemv (q8_rows_many from 16 rows), as the Python layers'
    matmul gives them to it: 40 sequences bit for bit at one thread, up to the merge order at two."""
    from pipeserve.model.quant.cpu_kernels import PROMPT_INT8_MAX_ROWS, cpu_kernels
    from tests.checkpoints import write_llama_gguf
    kernels = cpu_kernels()
    if kernels is None or kernels.isa != "avx2":
        pytest.skip("AVX2 builds' q8 rows (quant_gemv_avx2.h); this CPU's kernels are "
                    f"{kernels.isa if kernels else 'not built'}")
    gguf = write_llama_gguf(build_checkpoint("llama_tied_gqa", tmp_path / "hf"), tmp_path / "q8.gguf", qtype="Q8_0",
                            qtypes={"attn_k": "Q4_1"})
    source = resolve_model(str(gguf))
    cfg = source.load_config()
    runner = _fused_equals_python(lambda: _runner(source, cfg, num_blocks=1024), torch.float32, threads, 3,
                                  sequences=40)
    runner.model.fused_decode = None   # built again at the next step
    _decode_logits([runner], [[3, 4, 5]], 1)
    assert runner.model.fused_decode.max_rows == PROMPT_INT8_MAX_ROWS["q8"] == 48


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_iq4_nl_parts_fused_equal_python_layers(dtype, threads, tmp_path):
    """IQ4_NL q/k and gate kept as i4 beside a Q4_0 v and a Q8_0 up: the fused stage multiplies the
    i4 parts with their own int8 activations (prepared once per layout kind), as the Python
    layers do."""
    from pipeserve.model.quant.gguf_widen import keeps
    from tests.checkpoints import write_llama_gguf
    assert keeps("i4"), "every build's quantized kernels take i4"
    gguf = write_llama_gguf(build_checkpoint("llama_tied_gqa", tmp_path / "hf"), tmp_path / "iq4.gguf",
                            qtype="IQ4_NL", qtypes={"attn_v": "Q4_0", "ffn_up": "Q8_0"})
    source = resolve_model(str(gguf))
    cfg = source.load_config()
    layer = _fused_equals_python(lambda: _runner(source, cfg, dtype=dtype), dtype, threads, 6).model.layers[0]
    assert [p.kind for p in layer.self_attn.qkv_proj.parts] == ["i4", "i4", "q4"]   # q and k: one act_slot
    assert [p.kind for p in layer.mlp.gate_up_proj.parts] == ["i4", "q8"]
    assert layer.self_attn.o_proj.parts[0].kind == "i4" and layer.mlp.down_proj.parts[0].kind == "i4"


@pytest.mark.parametrize("threads", [1, 2])
def test_q2_q3_parts_fused_equal_python_layers(threads, tmp_path):
    """A Q2_K-mix GGUF (Q2_K q/k/gate/up, Q3_K v and down, Q4_K o) kept as q2 / q3 / q4: the fused
    stage multiplies the q2 and q3 parts with their integer sub-scales (quant_k2.h, through
    pipeserve_quant_rows) as the Python layers do."""
    from pipeserve.model.quant.gguf_widen import keeps
    from tests.test_tensor_parallel_quant import Q2_K_TYPES, _kquant_gguf
    assert keeps("q2") and keeps("q3"), "every build's quantized kernels take q2/q3"
    source = resolve_model(str(_kquant_gguf(tmp_path, Q2_K_TYPES, "Q2_K", "q2_k")))
    cfg = source.load_config()
    layer = _fused_equals_python(lambda: _runner(source, cfg), torch.float32, threads, 6).model.layers[0]
    assert [p.kind for p in layer.self_attn.qkv_proj.parts] == ["q2", "q2", "q3"]   # q and k: one act_slot
    assert [p.kind for p in layer.mlp.gate_up_proj.parts] == ["q2"] and layer.mlp.down_proj.parts[0].kind == "q3"


def _fused_equals_spied_python(runner, kernels, name: str, spy, prompts: list[list[int]], steps: int,
                               threads: int) -> int:
    """``runner``'s hidden states through the fused stage, then through the Python layers with
    ``kernels.<name>`` replaced by ``spy``: bit for bit at one thread, else up to the merge order.
    Returns the fused stage's max_rows (it is built again at the next step)."""
    fused = _decode_logits_hidden(runner, prompts, steps)
    max_rows = runner.model.fused_decode.max_rows
    runner.model.fused_decode = False
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, name, spy)
        python = _decode_logits_hidden(runner, prompts, steps)
    runner.model.fused_decode = None
    for a, b in zip(fused, python, strict=True):
        if threads == 1:
            assert torch.equal(a, b), len(prompts)
        else:
            assert (a.float() - b.float()).abs().max().item() < 5e-2 * b.float().abs().max().item(), len(prompts)
    return max_rows


@pytest.mark.parametrize("threads", [1, 2])
def test_smollm2_bfloat16_many_decodes_take_the_8_bit_kernel_fused(threads):
    """bfloat16 on AVX512-VNNI: steps of more than GEMV_MAX_ROWS decodes multiply in one pass of the
    8-bit many-row kernel (quant_gemm_i8.c) inside the fused stage, as the Python layers' matmul
    does: bit for bit at one thread (3, 13 and 27 sequences: the gemv, then the kernel's row
    tails and blocks; AMX CPUs take 32 and more on tiles, tested below), up to the merge order at
    two; the stage takes up to GEMV_ONE_CALL_MAX_ROWS."""
    from pipeserve.model.quant.cpu_kernels import GEMV_ONE_CALL_MAX_ROWS, cpu_kernels
    kernels = cpu_kernels()
    if kernels is None or kernels.gemm_i8_isa is None:
        pytest.skip("the 8-bit many-row kernel needs AVX512-VNNI (quant_gemm_i8.c)")
    source = resolve_model("smollm2-135m-instruct")
    cfg = source.load_config()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runner = _runner(source, cfg, dtype=torch.bfloat16, start=0, end=8)   # 8 layers: quicker, same kernels
        calls = []
        real = kernels.gemm_i8
        for n in (3, 13, 27):
            prompts = [list(range(100 + 7 * i, 108 + 7 * i + i % 5)) for i in range(n)]   # 8-12 tokens
            spy = lambda w, x: calls.append(len(x)) or real(w, x)   # noqa: E731
            assert _fused_equals_spied_python(runner, kernels, "gemm_i8", spy, prompts, 3, threads) \
                == GEMV_ONE_CALL_MAX_ROWS
        # the Python layers' decodes took the kernel from its rows (3, below q4's and q8's 4: the gemv);
        # prompts too
        assert {13, 27} <= set(calls) and 3 not in calls, sorted(set(calls))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
def test_smollm2_bfloat16_amx_decodes_fused_equal_python_layers(threads):
    """On CPUs with AMX-BF16: steps of amx_from's rows of decodes (32 and more) multiply in quant_gemm.c's
    AMX kernel inside the fused stage (pipeserve_quant_amxm_*), as the Python layers' matmul gives
    them to it: bit for bit at one thread (70 sequences: a partial block of x; 100), up to the merge
    order at two; 24 take the 8-bit kernel in both."""
    from pipeserve.model.quant.cpu_kernels import AMX_MIN_ROWS, cpu_kernels
    kernels = cpu_kernels()
    if kernels is None or kernels.gemm_i8_isa is None or kernels.gemm_amx_isa is None:
        pytest.skip("no AMX-BF16 on this CPU/compiler (or no AVX512-VNNI): the fused stage's steps take the "
                    "8-bit kernel, tested above")
    source = resolve_model("smollm2-135m-instruct")
    cfg = source.load_config()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runner = _runner(source, cfg, dtype=torch.bfloat16, start=0, end=4, num_blocks=128)   # a block a sequence
        calls = []
        real = kernels.gemm
        for n in (24, 70, 100):
            prompts = [list(range(100 + 7 * i, 104 + 7 * i + i % 5)) for i in range(n)]   # 4-8 tokens
            spy = lambda w, x, amx=False: calls.append((len(x), amx)) or real(w, x, amx)   # noqa: E731
            assert _fused_equals_spied_python(runner, kernels, "gemm", spy, prompts, 2, threads) >= n
        decode_rows = {rows for rows, amx in calls if amx and rows < 4 * 100}
        assert {70, 100} <= decode_rows and all(rows >= AMX_MIN_ROWS for rows, amx in calls if amx), sorted(set(calls))
        assert 24 not in decode_rows
    finally:
        torch.set_num_threads(previous)


# name -> (tensor types, the rest's type, layer 0's qkv parts, its down part): K-quant and IQ4 mixes
I8_MIXES = {"q4_k_m": (None, "Q4_K", ["Q4_K", "Q4_K", "Q6_K"], "Q6_K"),
            "q2_k": ("Q2_K_TYPES", "Q2_K", ["Q2_K", "Q2_K", "Q3_K"], "Q3_K"),
            "iq4_xs": ({"output": "Q6_K"}, "IQ4_XS", ["IQ4_XS"], "IQ4_XS")}   # one type: q/k/v one part


@pytest.mark.parametrize("mix", sorted(I8_MIXES))
@pytest.mark.parametrize("threads", [1, 2])
def test_k_quant_mixes_bfloat16_many_decodes_take_the_8_bit_kernel_fused(mix, threads, tmp_path):
    """Q4_K_M-, Q2_K- and IQ4_XS-style GGUFs in bfloat16: every layer weight (Q6_K's and Q2_K's /
    Q3_K's groups of 16, IQ4's codebook too) is the 8-bit many-row kernel's, so 13 decodes run in
    one fused call per step (such stages took 4 before), as the Python layers run them."""
    from pipeserve.model.quant.cpu_kernels import GEMV_ONE_CALL_MAX_ROWS, cpu_kernels
    from tests import test_tensor_parallel_quant as tpq
    if cpu_kernels() is None or cpu_kernels().gemm_i8_isa is None:
        pytest.skip("the 8-bit many-row kernel needs AVX512-VNNI (quant_gemm_i8.c)")
    types, default, qkv, down = I8_MIXES[mix]
    types = getattr(tpq, types) if isinstance(types, str) else types or tpq.KQUANT_TYPES
    source = resolve_model(str(tpq._kquant_gguf(tmp_path, types, default, mix)))
    cfg = source.load_config()
    runner = _fused_equals_python(lambda: _runner(source, cfg, dtype=torch.bfloat16), torch.bfloat16, threads, 3,
                                  sequences=13)
    layer = runner.model.layers[0]
    assert [p.source for p in layer.self_attn.qkv_proj.parts] == qkv
    assert layer.mlp.down_proj.parts[0].source == down
    runner.model.fused_decode = None                      # built again at the next step, as at start-up
    runner.execute(StepInput(0, [SeqStep(0, [5, 6, 7], 0, [0], GREEDY)]))
    assert runner.model.fused_decode.max_rows == GEMV_ONE_CALL_MAX_ROWS


@pytest.mark.parametrize("threads", [1, 2])
def test_iq4_bfloat16_three_decodes_take_the_8_bit_kernel_fused(threads, tmp_path):
    """IQ4_XS (i4) linears take the 8-bit kernel from 2 rows (its gemv here is AVX2's), in the
    fused stage as in the Python layers; a linear with a Q8_0 part (v beside IQ4 q/k, up beside an
    IQ4 gate) keeps the gemv up to 3 rows in both (Q8_0 takes the 8-bit kernel from 4)."""
    from pipeserve.model.quant.cpu_kernels import cpu_kernels
    from tests import test_tensor_parallel_quant as tpq
    kernels = cpu_kernels()
    if kernels is None or kernels.gemm_i8_isa is None:
        pytest.skip("the 8-bit many-row kernel needs AVX512-VNNI (quant_gemm_i8.c)")
    source = resolve_model(str(tpq._kquant_gguf(tmp_path, {"attn_v": "Q8_0", "ffn_up": "Q8_0", "output": "Q6_K"},
                                                "IQ4_XS", "iq4_mixed")))
    cfg = source.load_config()
    calls = []
    real = kernels.gemm_i8
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "gemm_i8", lambda w, x: calls.append((w.source, len(x))) or real(w, x))
        runner = _fused_equals_python(lambda: _runner(source, cfg, dtype=torch.bfloat16), torch.bfloat16, threads,
                                      2, sequences=3)
    layer = runner.model.layers[0]
    assert [p.source for p in layer.self_attn.qkv_proj.parts] == ["IQ4_XS", "IQ4_XS", "Q8_0"]
    assert [p.source for p in layer.mlp.gate_up_proj.parts] == ["IQ4_XS", "Q8_0"]
    # the Python layers' 3-row decodes: o and down (IQ4 alone) through the kernel, qkv and gate_up not
    assert {s for s, n in calls if n == 3} == {"IQ4_XS"} and len([1 for s, n in calls if n == 3]) == 2 * 2 * len(
        runner.model.layers), calls


def _decode_logits_hidden(runner, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """A first stage's output hidden states for each prompt's prefill then ``steps`` decode steps of
    all of them (fixed next tokens: the stage has no head)."""
    tables = [[i] for i in range(len(prompts))]   # one block each: prompts of at most BLOCK - steps tokens
    runner.execute(StepInput(0, [SeqStep(i, p, 0, tables[i], GREEDY) for i, p in enumerate(prompts)]))
    pos, out = [len(p) for p in prompts], []
    for s in range(steps):
        step = StepInput(s + 1, [SeqStep(i, [(7 * i + s) % 500 + 10], pos[i], tables[i], GREEDY)
                                 for i in range(len(prompts))])
        out.append(runner.execute(step).clone())
        pos = [p + 1 for p in pos]
    return out


def test_steps_it_does_not_take_run_the_python_layers(smollm2):
    from pipeserve.model.quant.cpu_kernels import cpu_kernels
    runner = smollm2[0]
    n = cpu_kernels().fused_max_rows + 1   # SmolLM2's layers hold no q8 part
    prompts = [list(range(100 + 5 * i, 110 + 5 * i)) for i in range(n)]
    tables = [[i % 64] for i in range(n)]   # one block each (more sequences than blocks share some)
    runner.execute(StepInput(0, [SeqStep(i, p, 0, tables[i], GREEDY) for i, p in enumerate(prompts)]))
    fused = runner.model.fused_decode
    assert fused and fused.max_rows == n - 1
    calls = []
    original = fused._run
    fused._run = lambda *args: calls.append(1) or original(*args)
    # more decodes than the fused stage takes
    runner.execute(StepInput(1, [SeqStep(i, [7], len(p), tables[i], GREEDY) for i, p in enumerate(prompts)]))
    # a decode beside a prefill chunk
    runner.execute(StepInput(2, [SeqStep(0, [7], 11, tables[0], GREEDY), SeqStep(1, [8, 9], 11, tables[1], GREEDY)]))
    assert calls == []
    runner.execute(StepInput(3, [SeqStep(0, [7], 12, tables[0], GREEDY)]))
    assert calls == [1]
    runner.model.fused_decode = None


@pytest.mark.parametrize("kind, kv", [("llama_tied_gqa", "auto"), ("qwen2_bias", "auto"), ("llama_tied_gqa", "int8"),
                                      ("mistral", "auto"), ("qwen3", "auto")])
@pytest.mark.parametrize("threads", [1, 2])
def test_plain_bfloat16_weights_fused_equal_python_layers(kind, kv, threads, tmp_path):
    """A bfloat16 safetensors checkpoint (``--quantization auto`` keeps its weights plain): steps of
    up to 8 decodes through the fused stage, its matmuls by bf16_gemv.c as ``layers.Linear``
    multiplies them (Qwen2's q/k/v bias added before the rounding in both); the stage takes at
    most ``GEMV_MAX_ROWS`` decodes a step (``max_rows``: more take the Python layers, whose matmuls
    F.linear multiplies from there)."""
    from pipeserve.model import packed_linear
    if packed_linear.gemv_kernel() is None:
        pytest.skip("bf16_gemv.c is not usable here (no AVX-512): plain weights keep the Python layers")
    if kind == "qwen3":   # q/k norms, head_dim 24 (widths not multiples of 32), sliding layers
        from tests.test_families import build_family
        source = resolve_model(str(build_family("qwen3", tmp_path)))
    else:
        source = resolve_model(str(build_checkpoint(kind, tmp_path)))
    cfg = source.load_config()
    if kind == "mistral":
        cfg = dataclasses.replace(cfg, sliding_window=12)   # shorter than the contexts
    make = lambda: _runner(source, cfg, quantization="auto", dtype=torch.bfloat16, kv_cache_dtype=kv)   # noqa: E731
    _fused_equals_python(make, torch.bfloat16, threads, 8, sequences=packed_linear.GEMV_MAX_ROWS)
    runner = make()
    _decode_logits([runner], [list(range(3, 12))], 1)
    assert runner.model.fused_decode.max_rows == packed_linear.GEMV_MAX_ROWS


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_an_8bit_kv_cache_fused_equals_python_layers(kv, dtype, threads, tmp_path):
    """--kv-cache-dtype int8 | fp8: the fused stage quantizes the new rows in C as kv_quant does
    (the caches byte for byte the Python layers', at any thread count: one thread writes them) and
    reads them with the same attention kernel (logits bit for bit at one thread). Sequences of
    different lengths over block boundaries; Qwen2's q/k/v bias and a sliding window beside
    Llama's plain layers."""
    for kind, window in (("llama_tied_gqa", None), ("qwen2_bias", 12)):
        source = resolve_model(str(build_checkpoint(kind, tmp_path / kind)))
        cfg = source.load_config()
        if window is not None:
            cfg = dataclasses.replace(cfg, sliding_window=window)
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            runner = _runner(source, cfg, quantization="int8", dtype=dtype, kv_cache_dtype=kv)
            prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(3)]
            fused = _decode_logits([runner], prompts, 8)
            assert runner.model.fused_decode, "the fused stage should apply to an 8-bit cache"
            caches = [t.view(torch.uint8).clone() for pair in runner.kv_caches for t in pair]
            runner.model.fused_decode = False
            python = _decode_logits([runner], prompts, 8)
            _compare(fused, python, exact=threads == 1)
            for a, b in zip(caches, (t.view(torch.uint8) for pair in runner.kv_caches for t in pair), strict=True):
                assert torch.equal(a, b)
        finally:
            torch.set_num_threads(previous)


def test_the_8bit_row_quantizer_rounds_as_torch():
    """decode_stage.c's quantizer of a cache row against kv_quant.quantize on rows that hit its
    cases: ties between int8 codes, fp8 subnormals and ties, the clamp, a zero row."""
    import ctypes
    from pipeserve.kernels.build import load_kernel
    from pipeserve.model.kv_quant import quantize
    fn = load_kernel("decode_stage").pipeserve_quantize_kv_row
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p], None
    D = 64
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(D, generator=gen)
    spread[0] = 448.0                                    # the rest: e4m3 subnormals after the scale
    # scale 1 (max 127 for int8, 448 for fp8): codes of exact ties, k + 0.5, and e4m3 midpoints
    int8_ties = torch.cat([torch.tensor([127.0]), torch.arange(-31, 32, dtype=torch.float32) + 0.5])
    step = 2.0 ** -9                                     # e4m3's subnormal step
    fp8_ties = torch.tensor([448.0, 1.0625, 1.1875, 2.125, 2.375, -1.0625, 0.5 * step, 1.5 * step, 2.5 * step,
                             -1.5 * step, 7.5 * step, 0.015625 + 0.5 * step, 232.0, 240.0] + [0.0] * (D - 14))
    rows = [torch.zeros(D), torch.full((D,), -3.0), torch.arange(D, dtype=torch.float32) - D / 2,
            int8_ties, fp8_ties, torch.randn(D, generator=gen) * 1e-3,
            torch.randn(D, generator=gen) * 50, spread, torch.randn(D, generator=gen) * 448 / 3]
    for dtype in (torch.int8, torch.float8_e4m3fn):
        for x in rows:
            got = torch.empty(D + 4, dtype=torch.uint8)
            fn(x.data_ptr(), D, int(dtype == torch.float8_e4m3fn), got.data_ptr())
            assert torch.equal(got, quantize(x, dtype).view(torch.uint8)), (dtype, x[:4])


@pytest.mark.parametrize("setting", ["dense", "torch-backend", "disabled"])
def test_stages_it_does_not_apply_to_say_why(setting, tmp_path, monkeypatch, caplog):
    source = resolve_model(str(build_checkpoint("llama_tied_gqa", tmp_path)))
    cfg = source.load_config()
    options = {"dense": dict(quantization="none"), "torch-backend": dict(quantization="int8", backend="torch"),
               "disabled": dict(quantization="int8")}[setting]
    if setting == "disabled":
        monkeypatch.setenv("PIPESERVE_FUSED_DECODE", "0")
    runner = _runner(source, cfg, **options)
    with caplog.at_level("INFO", logger="pipeserve.model.cpu_decode"):
        _decode_logits([runner], [list(range(3, 12))], 1)
    assert runner.model.fused_decode is False
    assert "the fused C stage does not apply" in caplog.text


def test_profile_splits_the_fused_stage_by_class(tmp_path):
    """--profile on a stage whose decodes take the fused path: the one C call's time goes to
    decode_gemm / decode_attention / kv_write / elementwise by the clock its C code keeps,
    the gemm FLOPs are exact, and the tokens are the unprofiled ones."""
    from pipeserve.worker.profiler import StageProfiler
    source = resolve_model(str(build_checkpoint("llama_tied_gqa", tmp_path)))
    cfg = source.load_config()
    prompts, steps = [list(range(3, 20)), list(range(30, 41))], 6
    tables = [[0, 1], [2, 3]]

    def generate(runner) -> list[list[int]]:
        out = [runner.execute(StepInput(0, [SeqStep(i, p, 0, tables[i], GREEDY) for i, p in enumerate(prompts)]))]
        for s in range(steps):
            last = {t.seq_id: t.token_id for t in out[-1].sampled}
            out.append(runner.execute(StepInput(s + 1, [SeqStep(i, [last[i]], len(p) + s, tables[i], GREEDY)
                                                        for i, p in enumerate(prompts)])))
        return [[t.token_id for t in o.sampled] for o in out]

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = _runner(source, cfg, quantization="int8")
        profiled = _runner(source, cfg, quantization="int8")
        profiler = StageProfiler(0)
        profiler.instrument(profiled)
        assert generate(profiled) == generate(plain)
    finally:
        torch.set_num_threads(previous)
    assert plain.model.fused_decode and profiled.model.fused_decode
    snap = profiler.snapshot()
    for name in ("decode_gemm", "decode_attention", "kv_write", "elementwise"):
        assert snap.ns[name] > 0, name
    per_token = layer_matmul_flops(cfg)
    assert snap.flops["decode_gemm"] == pytest.approx(steps * len(prompts) * cfg.num_layers * per_token)
    assert snap.flops["prefill_gemm"] == pytest.approx(sum(map(len, prompts)) * cfg.num_layers * per_token)
    # the classes and the runner's own Python add up to the busy time, nothing counted twice; a
    # pause in the wrappers' few µs that no class holds (a preemption, a collection) is not the
    # profiler's: at least 0.2 ms of slack, the 2 % of this test's usual 9 ms busy time (a full
    # suite run once measured 4.3 ms, 0.1 ms of it in no class)
    assert sum(snap.ns.values()) == pytest.approx(snap.busy_ns, rel=0.02, abs=200_000)
