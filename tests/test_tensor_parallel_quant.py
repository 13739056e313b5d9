"""Tensor parallelism with weights kept quantized (--tensor-parallel-size 2 with
--quantization auto on GGUF files, and int8/int4): the shard plan's cuts fall on
quantization blocks, each rank holds the file's blocks of its slice only (about half the
bytes), its layers are exactly the cut of the TP = 1 layers, and greedy output equals
TP = 1 kept-quantized, or, where the decode kernel rounds activations to int8 (AVX2's q4,
q5, q6), is close to it as vLLM compares quantized runs (``assert_logprobs_close``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeserve import LLM, SamplingParams
from pipeserve.model.config import ModelConfig
from pipeserve.model.quant.cpu_kernels import cpu_kernels
from pipeserve.model.tensor_parallel import SplitAlign, parameter_slices, plan_shard, take_slices
from pipeserve.outputs import CompletionOutput
from tests.test_engine_behaviour import random_prompts
from tests.test_tensor_parallel import SMOL, outputs, run

# A Llama with rows long enough for K-quants (256 weights a block): o_proj's input is 8 heads
# of 64 (two blocks), down_proj's 1024 intermediate rows (four blocks).
KQUANT_CONFIG = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                     num_key_value_heads=2, tie_word_embeddings=False)
# llama-quantize's Q4_K_M mix: Q6_K for attn_v, ffn_down and the head, Q4_K elsewhere.
KQUANT_TYPES = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K"}
# Its Q2_K mix, roughly: Q3_K for attn_v and ffn_down, Q4_K for attn_output, Q6_K the head, Q2_K elsewhere.
Q2_K_TYPES = {"attn_v": "Q3_K", "ffn_down": "Q3_K", "attn_output": "Q4_K", "output": "Q6_K"}
def _kquant_gguf(root: Path, types: dict = KQUANT_TYPES, default: str = "Q4_K", name: str = "q4_k_m") -> Path:
    """A tiny random Llama as a Q4_K_M-style GGUF (Q4_K, with Q6_K tensors; or ``types`` by
    tensor, ``default`` elsewhere), F32 norms."""
    import gguf
    from transformers import LlamaConfig

    from tests.checkpoints import _COMMON, _write_metadata, finish_gguf, random_quant_blocks, save_tiny_tokenizer
    cfg = LlamaConfig(**{**_COMMON, **KQUANT_CONFIG}, rope_theta=10000.0)
    h, inter, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * 64
    rng = np.random.default_rng(5)
    shapes = {"token_embd": (cfg.vocab_size, h), "output": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        shapes.update({f"blk.{i}.attn_q": (h, h), f"blk.{i}.attn_k": (kv, h), f"blk.{i}.attn_v": (kv, h),
                       f"blk.{i}.attn_output": (h, h), f"blk.{i}.ffn_gate": (inter, h),
                       f"blk.{i}.ffn_up": (inter, h), f"blk.{i}.ffn_down": (h, inter)})
    save_tiny_tokenizer(root)        # the GGUF's directory: its tokenizer is looked up beside it
    path = root / f"{name}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_metadata(writer, cfg)
    for name, (rows, cols) in shapes.items():
        qtype = gguf.GGMLQuantizationType[types.get(name.split(".")[-1], default)]
        writer.add_tensor(f"{name}.weight", random_quant_blocks(qtype, rows, cols, rng), raw_dtype=qtype)
    norms = ["output_norm"] + [f"blk.{i}.{n}" for i in range(cfg.num_hidden_layers) for n in ("attn_norm", "ffn_norm")]
    for name in norms:
        writer.add_tensor(f"{name}.weight", (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32))
    finish_gguf(writer)
    return path


@pytest.fixture(scope="module")
def gguf_files(tiny_checkpoints, tmp_path_factory):
    """name -> a tiny GGUF: "q8_0" (tied Llama, permuted q/k rows), "q4_k_m" (K-quants), "q2_k"
    (Q2_K and Q3_K: the q2 / q3 layouts where the kernels take them)."""
    from tests.checkpoints import save_tiny_tokenizer, write_llama_gguf
    root = tmp_path_factory.mktemp("tp_quant")
    save_tiny_tokenizer(root)
    files = {"q8_0": write_llama_gguf(tiny_checkpoints("llama_tied_gqa"), root / "q8_0.gguf", "Q8_0")}
    kdir = root / "kquant"
    kdir.mkdir()
    files["q4_k_m"] = _kquant_gguf(kdir)
    files["q2_k"] = _kquant_gguf(kdir, Q2_K_TYPES, "Q2_K", "q2_k")
    return files


# -- the shard plan ------------------------------------------------------------------
def test_block_aligned_cuts_move_to_the_nearest_block_boundary():
    """SmolLM2's dense split is 6 + 3 q heads (384 o_proj columns) and 672 + 864 MLP rows;
    with blocks of 32 both already fall on boundaries; with (hypothetical) blocks of 256 the
    head cut must sit at 4 or 8 heads (256 / 64), keeping whole KV groups of 3: none exists."""
    dense = [plan_shard(SMOL, r, 2) for r in range(2)]
    legacy = [plan_shard(SMOL, r, 2, SplitAlign(32, 32)) for r in range(2)]
    assert legacy == dense
    with pytest.raises(ValueError, match=r"o_proj is quantized in blocks of 256 weights.*9 heads x 64 dims"):
        plan_shard(SMOL, 0, 2, SplitAlign(256, 256))
    # Only the MLP blocked at 256: the cut moves from 672 to the nearest multiple, 768.
    mlp = [plan_shard(SMOL, r, 2, SplitAlign(1, 256)) for r in range(2)]
    assert [s.intermediate for s in mlp] == [(0, 768), (768, 1536)]
    assert [s.q_heads for s in mlp] == [s.q_heads for s in dense]


def test_block_aligned_head_cut_keeps_query_groups():
    """8 q heads of 64 over 2 KV heads, blocks of 256 (4 heads): the cut stays at 4 heads.
    With 4 KV heads over 2 ranks at blocks of 256, the even cut (2 KV heads, 4 q heads) is
    already aligned; at blocks of 512 no cut exists (the whole input is one block)."""
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=320, hidden_size=512, intermediate_size=1024, num_layers=2,
                      num_heads=8, num_kv_heads=2, head_dim=64, max_position_embeddings=512)
    shards = [plan_shard(cfg, r, 2, SplitAlign(256, 256, "o_proj (Q4_K)")) for r in range(2)]
    assert [s.q_heads for s in shards] == [(0, 4), (4, 8)] and [s.kv_heads for s in shards] == [(0, 1), (1, 2)]
    assert all(s.intermediate[0] % 256 == 0 for s in shards)
    # 12 q heads of 64 in 6 KV groups of 2: the even cut at 6 heads (384 columns) is not on a
    # 256-column block; the nearest cut on one that keeps whole groups is 4 heads (8 ties; lower wins).
    wide = replace(cfg, num_heads=12, num_kv_heads=6, hidden_size=768, intermediate_size=2560)
    moved = [plan_shard(wide, r, 2, SplitAlign(256, 256)) for r in range(2)]
    assert [s.q_heads for s in moved] == [(0, 4), (4, 12)] and [s.kv_heads for s in moved] == [(0, 2), (2, 6)]
    assert moved[0].intermediate == (0, 1536)   # fewer heads, more MLP rows (of 2560), whole blocks
    with pytest.raises(ValueError, match="blocks of 512"):
        plan_shard(cfg, 0, 2, SplitAlign(512, 256))
    with pytest.raises(ValueError, match=r"down_proj is quantized in blocks of 256 weights along its input \(1024"):
        plan_shard(cfg, 0, 8, SplitAlign(64, 256))


# -- each rank's layers are the cut of the whole ---------------------------------------
def _dequantized(module) -> torch.Tensor:
    from pipeserve.model.quant.modules import QuantEmbedding, QuantLinear
    from pipeserve.model.quant.packed import dequantize
    if isinstance(module, (QuantLinear, QuantEmbedding)):
        return torch.cat([dequantize(p) for p in module.parts], dim=0)
    return module.weight.float()


def _models(source, quantization: str, tp: int):
    from pipeserve.model.loader import load_model, split_alignment
    from pipeserve.model.tensor_parallel import TensorParallelGroup
    cfg = source.load_config()
    align = split_alignment(source, cfg, quantization, 32)
    build = (lambda group: load_model(source, cfg, 0, cfg.num_layers, True, True, torch.float32, "cpu",
                                      quantization=quantization, tp=group))
    return cfg, build(None), [build(TensorParallelGroup(plan_shard(cfg, r, tp, align))) for r in range(tp)]


@pytest.mark.parametrize("name", ["q8_0", "q4_k_m", "q2_k", "int4"])
def test_each_rank_holds_the_cut_of_the_whole_and_half_the_bytes(gguf_files, tiny_checkpoints, name):
    """GGUF: a rank's layers dequantize to exactly the cut of the TP = 1 layers (the same
    blocks); int4: a rank's layers are the quantization of the cut float weight. Each rank's
    resident weight bytes are about half of TP = 1's."""
    from pipeserve.model.loader import resolve_model
    from pipeserve.model.quant.load import weight_bytes
    from pipeserve.model.quant.modules import QuantEmbedding, QuantLinear
    from pipeserve.model.quant.packed import dequantize, quantize_weight
    if name == "int4":
        source, quantization = resolve_model(str(tiny_checkpoints("qwen2_bias"))), "int4"
    else:
        source, quantization = resolve_model(str(gguf_files[name])), "auto"
    cfg, whole, ranks = _models(source, quantization, 2)
    reader = source.open_weights(cfg)
    kept = 0
    for model in ranks:
        for ours, names in model.checkpoint_names().items():
            path = ours.rsplit(".", 1)[0]
            module = model.get_submodule(path)
            if not ours.endswith(".weight") or not isinstance(module, (QuantLinear, QuantEmbedding)):
                continue
            kept += 1
            cut = parameter_slices(cfg, model.tp.shard, ours)
            if name == "int4":
                full = torch.cat([reader.read(n) for n in names], dim=0)
                want = dequantize(quantize_weight(full if cut is None else take_slices(full, *cut), 4, 32))
            else:
                full = _dequantized(whole.get_submodule(path))
                want = full if cut is None else take_slices(full, *cut)
            assert torch.equal(_dequantized(module), want), ours
    reader.close()
    assert kept >= 2 * cfg.num_layers * 4
    total, parts = weight_bytes(whole), [weight_bytes(m) for m in ranks]
    assert all(0.4 * total < p < 0.62 * total for p in parts), (total, parts)


def test_gguf_cut_on_raw_blocks_refuses_a_split_block(gguf_files):
    from pipeserve.model.loader import resolve_model
    source = resolve_model(str(gguf_files["q4_k_m"]))
    reader = source.open_weights(source.load_config())
    with pytest.raises(ValueError, match=r"blk\.0\.attn_output\.weight \(Q4_K\) is quantized in blocks of 256"):
        reader.read_packed("model.layers.0.self_attn.o_proj.weight", (1, ((0, 128),)))
    reader.close()


# -- greedy output equal (or close) to TP = 1 ------------------------------------------------
TOP_LOGPROBS = 5
GREEDY_TOP = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=TOP_LOGPROBS)


def int8_activations(kinds: tuple[str, ...] = ("q4", "q5", "q6")) -> bool:
    """Whether decode rounds the activations of any of these layouts to int8 per block of 32
    (``act_int8``: AVX2 builds' q4/q5/q6/i4/q2/q3, VNNI builds' i4/q2/q3; VNNI builds give q4
    int16 ones, and q8 takes int16 or two int8 terms everywhere)."""
    kernels = cpu_kernels()
    return kernels is not None and any(kernels.act_int8(kind) for kind in kinds)


def assert_logprobs_close(want: list[CompletionOutput], got: list[CompletionOutput]) -> None:
    """vLLM's comparison of quantized and tensor-parallel runs (tests/models/utils.py,
    check_logprobs_close): two greedy completions agree token for token until they first
    differ; there each one's token must be among the other's top TOP_LOGPROBS, and what follows
    (a different text) is not compared.

    Why not equality: TP adds the ranks' o_proj and down_proj partial sums in another float32
    order than one matmul (~1e-7 relative), and the next layer's activation rounding turns that
    into whole steps of its code where a value sits near a rounding boundary. With int8 codes
    (a step of max|x| / 127 a block) a perturbation of 6e-8 relative moves SmolLM2's
    teacher-forced top-1 log-probabilities by a median 0.02-0.03 (max 0.3-0.45 over 200
    positions): as far as int8 activations are from float ones, i.e. another draw of the same
    rounding noise, not a kernel error. int16 codes (258x finer) move them by 1e-4 (max 1e-3);
    benchmarks/activation_rounding_drift.py."""
    assert len(got) == len(want)
    moved = 0.0   # the largest change of a shared token's log-probability, for the log
    for i, (a, b) in enumerate(zip(want, got)):
        assert len(a.token_ids) == len(b.token_ids), i
        for pos, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta == tb:
                moved = max(moved, abs(a.logprobs[pos][ta].logprob - b.logprobs[pos][tb].logprob))
                continue
            print(f"completion {i} parts at token {pos}: {ta} ({a.logprobs[pos][ta].logprob:.4f}) then "
                  f"{tb} ({a.logprobs[pos].get(tb)}); the other run {tb} ({b.logprobs[pos][tb].logprob:.4f}) "
                  f"then {ta} ({b.logprobs[pos].get(ta)})")
            assert ta in b.logprobs[pos] and tb in a.logprobs[pos], (i, pos, a.logprobs[pos], b.logprobs[pos])
            break
    print(f"shared tokens' log-probabilities moved by at most {moved:.4f}")


def generate(model: str, prompts, **kwargs) -> list[CompletionOutput]:
    """Greedy completions with their top TOP_LOGPROBS log-probabilities, as ``run`` starts the engine."""
    return [o.outputs[0] for o in outputs(model, prompts, GREEDY_TOP, **kwargs)]


@pytest.mark.parametrize("name", ["q8_0", "q4_k_m", "q2_k", "int4"])
def test_tensor_parallel_kept_quantized_matches_tp1(gguf_files, tiny_checkpoints, name):
    """float32 activations, or int16 ones (q8): the ranks' partial sums add in another order
    than one matmul, which moved no greedy token on these checkpoints. q4 (Q4_K, int4) and q6
    (Q6_K) with AVX2's int8 activations, q2/q3 (Q2_K, Q3_K) with AVX2's or VNNI's: close as vLLM
    compares (``assert_logprobs_close``)."""
    if name == "int4":
        model, quantization = str(tiny_checkpoints("qwen2_bias")), "int4"
    else:
        model, quantization = str(gguf_files[name]), "auto"
    prompts = random_prompts(3, seed=31)
    if name == "q8_0" or not int8_activations(("q2", "q3", "q4", "q6") if name == "q2_k" else ("q4", "q5", "q6")):
        assert run(model, prompts, quantization=quantization, tensor_parallel_size=2) == \
            run(model, prompts, quantization=quantization)
        return
    assert_logprobs_close(generate(model, prompts, quantization=quantization),
                          generate(model, prompts, quantization=quantization, tensor_parallel_size=2))


def test_smollm2_kept_q4_1_at_tp2_matches_tp1(smollm2_gguf, smollm2_kept_reference):
    """The built-in Q4_1 GGUF kept quantized: 6 + 3 heads, 672 + 864 MLP rows (all on
    32-weight blocks; 21 + 27 blocks, odd counts TP = 1 never has), TP rank 0 holds about half
    the resident weight bytes, and its greedy tokens are one rank's: equal with float32 or
    int16 activations (the partial sums' order moved none), close as vLLM compares with AVX2's
    int8 ones (``assert_logprobs_close``: there the order moved shared tokens'
    log-probabilities by up to 0.15, and one completion of four parted at its 7th token, the
    top two 0.41 apart at TP = 1 and swapped, 0.29 apart, at TP = 2)."""
    from tests.test_engine_behaviour import token_lists
    from tests.test_pipeline_equivalence import GREEDY
    prompts, one_rank, one_rank_bytes = smollm2_kept_reference
    int8 = int8_activations()
    with LLM(model=str(smollm2_gguf), dtype="float32", kv_cache_memory="16MiB", threads_per_stage=1,
             quantization="auto", tensor_parallel_size=2) as llm:
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_TOP if int8 else GREEDY,
                           use_tqdm=False)
        rank0_bytes = llm.stats()["weight_bytes"][0]
    assert 0.4 < rank0_bytes / one_rank_bytes < 0.6, (rank0_bytes, one_rank_bytes)
    if not int8:
        assert token_lists(got) == one_rank
        return
    want = generate(str(smollm2_gguf), prompts, quantization="auto")
    assert [c.token_ids for c in want] == one_rank   # logprobs asked for change no token
    assert_logprobs_close(want, [o.outputs[0] for o in got])


def test_llm_refuses_a_split_off_the_blocks_before_starting_processes(gguf_files):
    """4 ranks over 8 heads of 64 in 2 KV groups: ranks 0 and 1 share KV head 0 and would
    cut its 4 q heads at 2 (128 columns), inside a 256-weight Q4_K block of attn_output."""
    from pipeserve import LLM
    with pytest.raises(ValueError, match=r"layer 0's o_proj \(GGUF attn_output\) is quantized in blocks of 256"):
        LLM(model=str(gguf_files["q4_k_m"]), tensor_parallel_size=4)
