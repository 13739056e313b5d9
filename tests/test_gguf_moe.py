"""Mixture-of-experts GGUF files: ``qwen2moe``, ``qwen3moe`` and Mixtral (``llama`` with experts).

Tiny random Qwen2-MoE / Qwen3-MoE checkpoints are written to GGUF the way llama.cpp's
converter writes them (Qwen2MoeModel, and Qwen3MoeModel which extends it): each layer's
experts stacked in ffn_{gate,up,down}_exps, the router as ffn_gate_inp (always F32),
Qwen2-MoE's shared expert as ffn_*_shexp with its gate squeezed to a vector, and the
expert widths as metadata. With ``--quantization none`` in float32 they give transformers'
greedy tokens. Files quantized to Q8_0 / Q4_0 keep their experts in those types
(``auto``): the logits equal the dequantized file's, and a stage holds about the
file's tensor bytes, not the 4-8x of dequantized experts.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pipeserve import LLM, SamplingParams
from pipeserve.model.loader import load_model, resolve_model
from pipeserve.model.loader.gguf import GGUFWeightReader, read_gguf_config
from pipeserve.model.moe import SparseMoeBlock
from pipeserve.model.quant.gguf_repack import repack
from pipeserve.model.quant.load import weight_bytes
from pipeserve.model.quant.modules import QuantLinear
from pipeserve.model.quant.packed import dequantize
from tests.checkpoints import (_COMMON, _add_tensor, _write_metadata, finish_gguf, lazy_conversions,
                               save_tiny_tokenizer)
from tests.test_gguf_families import configs_agree, engine_greedy
from tests.test_loaders import k_quant_bytes, run_stages, write_gguf
from tests.test_moe import NEW, build_moe_checkpoint, hf_greedy, prompts, write_mixtral_gguf
from tests.test_tensor_parallel_quant import int8_activations

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KINDS = ("qwen2_moe", "qwen3_moe")
_ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def _config(kind: str):
    """Expert widths multiples of 32, so Q8_0 / Q4_0 blocks fit every matrix."""
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig
    base = {**_COMMON, "num_hidden_layers": 2, "intermediate_size": 96}
    if kind == "qwen2_moe":   # 4 experts, top-2, not renormalised, a shared expert; untied head
        return Qwen2MoeConfig(**base, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=64, norm_topk_prob=False,
                              use_sliding_window=False, tie_word_embeddings=False)
    # 6 experts, top-2, renormalised, per-head q/k norm, head_dim 16 != 64 / 4; the head tied
    return Qwen3MoeConfig(**base, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                          norm_topk_prob=True, head_dim=16, tie_word_embeddings=True)


def build_hf(kind: str, directory: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from tests.checkpoints import _randomize
    config = _config(kind)
    config.architectures = [{"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[kind]]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, 0)
    model.save_pretrained(directory)
    save_tiny_tokenizer(directory)
    return directory


def write_qwen_moe_gguf(hf_dir: Path, path: Path, qtype: str = "F32") -> Path:
    """``hf_dir`` as Qwen2MoeModel / Qwen3MoeModel write it; matrices in ``qtype``."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(hf_dir)
    arch = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[cfg.model_type]
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, cfg)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    stacks: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for hf_name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        array = tensor.float().numpy()
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", hf_name)
        if m is not None:   # merged per layer and projection once all experts are seen
            stacks.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = array
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name.endswith("ffn_gate_inp.weight"):   # the router stays F32 (converter and llama-quantize)
            _add_tensor(writer, name, array, "F32")
        else:   # the shared expert's gate [1, hidden] is squeezed to a vector, as llama.cpp expects
            _add_tensor(writer, name, array.squeeze(0) if "shexp" in name and array.shape[0] == 1 else array,
                        qtype)
    for (layer, proj), experts in stacks.items():
        name = names.get_name(f"model.layers.{layer}.mlp.experts.{proj}.weight", try_suffixes=(".weight",))
        _add_tensor(writer, name, np.stack([experts[e] for e in sorted(experts)]), qtype)
    finish_gguf(writer)
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(kind, qtype) -> (HF directory, GGUF file written from it); kind in KINDS or "mixtral"."""
    def build(kind: str, directory: Path) -> Path:
        return (build_moe_checkpoint if kind == "mixtral" else build_hf)(kind, directory)

    def write(hf_dir: Path, path: Path, qtype: str) -> Path:   # hf_dir is root / kind
        return (write_mixtral_gguf if hf_dir.name == "mixtral" else write_qwen_moe_gguf)(hf_dir, path, qtype)
    return lazy_conversions(tmp_path_factory.mktemp("gguf_moe"), build, write)


# -- metadata -------------------------------------------------------------------
_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
           "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "attention_bias", "tie_word_embeddings",
           "qk_norm", "num_experts", "num_experts_per_tok", "expert_intermediate_size",
           "shared_expert_intermediate_size", "norm_topk_prob")


@pytest.mark.parametrize("kind", KINDS)
def test_moe_gguf_config_equals_the_safetensors_config(converted, kind):
    ours, _ = configs_agree(converted, kind, _FIELDS)
    assert [ours.is_moe_layer(i) for i in range(ours.num_layers)] == [True] * ours.num_layers


def _moe_file(tmp_path: Path, arch: str, **keys) -> Path:
    w = gguf.GGUFWriter(str(tmp_path / f"{arch}.gguf"), arch)
    for add, value in [(w.add_block_count, 1), (w.add_embedding_length, 64), (w.add_feed_forward_length, 96),
                       (w.add_head_count, 4), (w.add_vocab_size, 32)]:
        add(value)
    for name, value in keys.items():
        getattr(w, f"add_{name}")(value)
    w.add_tensor("blk.0.attn_q.bias", np.zeros(64, np.float32))   # qwen2moe's biases
    finish_gguf(w)
    return tmp_path / f"{arch}.gguf"


def test_moe_defaults_follow_llama_cpp(tmp_path):
    """Without the width keys llama.cpp takes n_ff / used for the experts and n_ff for the shared
    expert; the renormalisation is the family's (its graphs fix it), unless the file states it."""
    q2 = read_gguf_config(_moe_file(tmp_path, "qwen2moe", expert_count=8, expert_used_count=4))
    assert (q2.architecture, q2.expert_intermediate_size, q2.shared_expert_intermediate_size, q2.norm_topk_prob) \
        == ("Qwen2MoeForCausalLM", 24, 96, False)
    q3 = read_gguf_config(_moe_file(tmp_path, "qwen3moe", expert_count=8, expert_used_count=2))
    assert (q3.expert_intermediate_size, q3.shared_expert_intermediate_size, q3.norm_topk_prob) == (48, 0, True)
    stated = read_gguf_config(_moe_file(tmp_path, "qwen3moe", expert_count=8, expert_used_count=2,
                                        expert_weights_norm=False))
    assert not stated.norm_topk_prob


@pytest.mark.parametrize("arch,keys,match", [
    ("qwen3moe", {}, r"'qwen3moe\.expert_count'"),
    ("qwen2moe", {"expert_count": 4}, r"qwen2moe\.expert_used_count=0"),
    ("qwen3moe", {"expert_count": 4, "expert_used_count": 5}, r"qwen3moe\.expert_used_count=5"),
    ("qwen3moe", {"expert_count": 4, "expert_used_count": 2, "expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID},
     r"qwen3moe\.expert_gating_func=2"),
    ("qwen3moe", {"expert_count": 4, "expert_used_count": 2, "expert_weights_scale": 2.5},
     r"qwen3moe\.expert_weights_scale=2\.5"),
    ("qwen3moe", {"expert_count": 4, "expert_used_count": 2, "expert_shared_count": 1},
     r"qwen3moe\.expert_shared_count=1"),
    ("qwen2", {"expert_count": 4, "expert_used_count": 2}, r"qwen2\.expert_count=4.*qwen2moe"),
])
def test_what_pipeserve_cannot_run_is_refused_by_key(tmp_path, arch, keys, match):
    with pytest.raises(ValueError, match=match):
        read_gguf_config(_moe_file(tmp_path, arch, **keys))


def test_tensor_parallelism_of_a_moe_gguf_is_refused(converted):
    """Experts are not split across ranks (kept or dense): the engine refuses before it starts."""
    hf_dir, path = converted("qwen3_moe", "Q8_0")
    with pytest.raises(ValueError, match="mixture-of-experts models .* are not split across ranks"):
        LLM(model=str(path), tokenizer=str(hf_dir), dtype="float32", kv_cache_memory="16MiB", tensor_parallel_size=2)


# -- numerics -------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_moe_gguf_greedy_matches_transformers(converted, kind):
    """PP = 1 through the torch attention, PP = 2 (a layer a stage) through the C one."""
    hf_dir, path = converted(kind)
    batch = prompts(3, seed=11)
    expected = hf_greedy(hf_dir, batch)
    assert engine_greedy(path, hf_dir, batch, quantization="none", attention_backend="torch") == expected
    assert engine_greedy(path, hf_dir, batch, quantization="none", pipeline_parallel_size=2) == expected


def _file_tensor_bytes(path: Path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K],
                         ids=["Q4_K", "Q6_K"])
def test_an_experts_kept_weight_is_its_rows_of_the_stack(tmp_path, qtype):
    """K-quants (256 weights a block): expert e's kept weight is rows [e·R, (e+1)·R) of the
    whole stack's, re-laid out, and dequantizes to the dense path's slice of the stack."""
    experts, rows = 3, 4
    raw = k_quant_bytes(qtype, experts * rows, np.random.default_rng(0))   # a block a row
    path = write_gguf(tmp_path / "e.gguf", {"token_embd.weight": (np.zeros((8, 256), np.float32), None),
                                            "blk.0.ffn_gate_exps.weight": (raw.reshape(experts, rows, -1), qtype)})
    reader = GGUFWeightReader(path, read_gguf_config(path))
    whole = repack(qtype, raw)
    for e in range(experts):
        name = f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"
        one = reader.read_packed(name)
        for field in ("qs", "qh", "scale", "minv"):
            a, b = getattr(one, field), getattr(whole, field)
            assert (a is None and b is None) or torch.equal(a, b[e * rows:(e + 1) * rows]), field
        # the K-quants' two-level scales multiplied out in float16: within 2^-11 of a scale
        torch.testing.assert_close(dequantize(one, torch.float32), reader.read(name), rtol=2e-3, atol=1e-3)


KEPT = [("mixtral", "Q8_0"), ("mixtral", "Q4_0"), ("qwen3_moe", "Q8_0"), ("qwen3_moe", "Q4_0"),
        ("qwen2_moe", "Q4_0")]


@pytest.mark.parametrize("kind,qtype", KEPT, ids=[f"{k}-{q}" for k, q in KEPT])
def test_kept_experts_compute_what_the_file_stores_at_its_size(converted, kind, qtype):
    """``auto`` keeps each expert's gate/up and down in the file's type: two stages give the
    logits of the same file dequantized at load (``none``), and the whole model resides in
    about the file's tensor bytes."""
    _, path = converted(kind, qtype)
    source = resolve_model(str(path))
    cfg = source.load_config()
    model = load_model(source, cfg, 0, cfg.num_layers, True, True, torch.float32, "cpu")
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == cfg.num_layers
    for block in blocks:
        experts = [*block.gate_up_experts, *block.down_experts]
        assert all(isinstance(m, QuantLinear) and m.sources == [qtype] for m in experts)
        assert not hasattr(block, "gate_up_proj") and not hasattr(block, "down_proj")
    resident, stored = weight_bytes(model), _file_tensor_bytes(path)
    print(f"{kind} {qtype}: resident {resident} B, file tensors {stored} B ({resident / stored:.3f}x)")
    assert 0.95 * stored <= resident <= 1.01 * stored, (resident, stored)
    ids = prompts(1, seed=3)[0][:20]
    kept = run_stages(source, [0, 1, 2], ids)
    dense = run_stages(source, [0, 1, 2], ids, quantization="none")
    # up to the decode kernel's integer activations (these 20 rows take its path): int16 or finer
    # for q8, and for q4 but on AVX2, where they are int8 (max|x| / 127 a block of 32); that moved
    # these logits by 0.8-1.5 % of their norm (the int16 ones: 3e-5 to 7e-5)
    if qtype == "Q4_0" and int8_activations():
        assert ((kept - dense).norm() / dense.norm()).item() <= 0.03
    else:
        torch.testing.assert_close(kept, dense, rtol=0, atol=5e-4)


def test_kept_moe_engine_holds_the_file_and_gives_the_dequantized_tokens(converted):
    """End to end (PP = 2): the stages report the file's bytes (``LLM.stats()``), and the
    greedy tokens are those of the same file dequantized at load."""
    hf_dir, path = converted("qwen3_moe", "Q8_0")
    batch = prompts(3, seed=13)
    expected = engine_greedy(path, hf_dir, batch, quantization="none")
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)
    with LLM(model=str(path), tokenizer=str(hf_dir), dtype="float32", kv_cache_memory="16MiB",
             threads_per_stage=1, quantization="auto", pipeline_parallel_size=2) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
        resident = sum(llm.stats()["weight_bytes"])
    # two stages of a tied model: the embedding (first stage) and head (last) are one tensor twice
    embedding = next(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    assert resident <= 1.01 * (_file_tensor_bytes(path) + embedding), resident
    assert [o.outputs[0].token_ids for o in outs] == expected
