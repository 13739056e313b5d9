"""Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): greedy output token-identical to
transformers in float32 at PP = 1 and 2 through both attention backends, bfloat16 close
to float32, each active expert run once per step, unsupported switches refused, and the
partition and planner costing MoE layers by active (compute) and total (memory) parameters."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from pipeserve import LLM, SamplingParams
from pipeserve.model.config import ModelConfig
from pipeserve.model.moe import SparseMoeBlock, route
from tests.checkpoints import _COMMON, _randomize, finish_gguf, save_tiny_tokenizer
from tests.kernels import kernel_missing

NEW = 10


def _configs() -> dict:
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    base = {**_COMMON, "num_hidden_layers": 2, "intermediate_size": 96}
    return {
        # 8 experts, top-2, always renormalised.
        "mixtral": lambda: MixtralConfig(**base, num_local_experts=8, num_experts_per_tok=2,
                                         tie_word_embeddings=False),
        # 4 experts, top-2, no renormalisation, a shared expert; layer 1 dense (mlp_only_layers).
        "qwen2_moe": lambda: Qwen2MoeConfig(**{**base, "num_hidden_layers": 3}, num_experts=4,
                                            num_experts_per_tok=2, moe_intermediate_size=48,
                                            shared_expert_intermediate_size=80, norm_topk_prob=False,
                                            mlp_only_layers=[1], use_sliding_window=False),
        # 6 experts, top-2, renormalised; experts on every 2nd layer (decoder_sparse_step), q/k norm.
        "qwen3_moe": lambda: Qwen3MoeConfig(**{**base, "num_hidden_layers": 4}, num_experts=6,
                                            num_experts_per_tok=2, moe_intermediate_size=40,
                                            norm_topk_prob=True, decoder_sparse_step=2, head_dim=16),
    }


ARCHS = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
KINDS = tuple(ARCHS)


def build_moe_checkpoint(kind: str, directory: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_configs()[kind](), dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(directory)
    save_tiny_tokenizer(directory)
    return directory


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = build_moe_checkpoint(kind, tmp_path_factory.mktemp(kind))
        return built[kind]
    return get


@pytest.fixture(scope="module")
def reference(moe_checkpoint):
    """kind -> (prompts, transformers' float32 greedy continuations), computed once per kind."""
    done: dict[str, tuple] = {}

    def get(kind: str) -> tuple[list[list[int]], list[list[int]]]:
        if kind not in done:
            batch = prompts(3, seed=len(kind))
            done[kind] = batch, hf_greedy(moe_checkpoint(kind), batch)
        return done[kind]
    return get


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(5, 30))] for _ in range(count)]


def hf_greedy(path: Path, batch: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in batch:   # one at a time: no padding in the reference
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            out.append(gen[0, len(ids):].tolist())
    return out


def generate(path: Path, batch: list[list[int]], **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)
    with LLM(model=str(path), kv_cache_memory="32MiB", threads_per_stage=1, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params)
    return [o.outputs[0].token_ids for o in outs]


BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    kernel_missing("paged_attention") is not None, reason=str(kernel_missing("paged_attention"))))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_float32_greedy_matches_transformers_at_pp1_and_pp2(moe_checkpoint, reference, kind, backend):
    batch, expected = reference(kind)
    for pp in (1, 2):   # PP = 2 split by the measured-cost auto partition
        got = generate(moe_checkpoint(kind), batch, dtype="float32", attention_backend=backend,
                       pipeline_parallel_size=pp, pp_partition="auto" if pp > 1 else "uniform")
        assert got == expected, f"{kind} PP={pp} {backend}"


def all_position_argmax(path: Path, texts: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    """Teacher-forced next-token argmax at every position of every text (one prefill each)."""
    from pipeserve.model.loader import load_model, resolve_model
    src = resolve_model(str(path))
    cfg = src.load_config()
    model = load_model(src, cfg, 0, cfg.num_layers, True, True, dtype, "cpu")  # auto: C kernels + fused ops
    rows = []
    with torch.inference_mode():
        for ids in texts:
            blocks, size = -(-len(ids) // 16), 16
            kv = [(torch.zeros(blocks, size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype),
                   torch.zeros(blocks, size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype))
                  for _ in range(cfg.num_layers)]
            meta = model.backend.build_metadata([len(ids)], [len(ids)], [list(range(blocks))], size,
                                                torch.device("cpu"))
            hidden = model(torch.tensor(ids), torch.arange(len(ids)), meta, kv)     # [len, hidden]
            rows.append(model.compute_logits(hidden).argmax(-1))
    return torch.cat(rows)


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_teacher_forced_top1_agrees_with_float32(moe_checkpoint, kind):
    """Feed the float32 greedy texts to both dtypes: >= 95 % of the next-token argmaxes agree."""
    path = moe_checkpoint(kind)
    batch = prompts(6, seed=7)
    texts = [p + g for p, g in zip(batch, generate(path, batch, dtype="float32"))]
    f32 = all_position_argmax(path, texts, torch.float32)
    bf16 = all_position_argmax(path, texts, torch.bfloat16)
    agree = (f32 == bf16).float().mean().item()
    assert agree >= 0.95, f"{kind}: bfloat16 top-1 agrees with float32 on {agree:.1%} of {len(f32)} positions"


def test_each_active_expert_runs_once_per_step():
    cfg = ModelConfig.from_hf_dict({**_COMMON, "architectures": ["MixtralForCausalLM"], "num_hidden_layers": 1,
                                    "num_local_experts": 8, "num_experts_per_tok": 2})
    block = SparseMoeBlock(cfg, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for p in block.parameters():
        p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    calls: list[tuple[int, int]] = []
    plain = block.expert
    block.expert = lambda e, rows: calls.append((e, rows.shape[0])) or plain(e, rows)
    x = torch.randn(40, cfg.hidden_size, generator=gen)               # a 40-token step
    out = block(x)
    _, experts = route(block.gate(x), 2, True, True)
    used = torch.bincount(experts.reshape(-1), minlength=8)
    assert sorted(e for e, _ in calls) == [e for e in range(8) if used[e]]     # once each, idle ones never
    assert {e: n for e, n in calls} == {e: int(used[e]) for e in range(8) if used[e]}
    # Same result as the per-token definition Σ_k w_k · expert_k(x).
    weights, experts = route(block.gate(x), 2, True, True)
    ref = torch.stack([sum(w * plain(int(e), x[t:t + 1])[0] for w, e in zip(weights[t], experts[t]))
                       for t in range(x.shape[0])])
    assert torch.allclose(out, ref, atol=1e-5)


def _write_config(tmp_path: Path, kind: str, **changes) -> Path:
    cfg = {**_configs()[kind]().to_dict(), "architectures": [ARCHS[kind]], **changes}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("switch,value", [("scoring_func", "sigmoid"), ("routed_scaling_factor", 2.5),
                                          ("n_group", 4), ("num_experts_per_tok", 9)])
def test_unimplemented_moe_switch_is_refused_by_name(tmp_path, switch, value):
    from pipeserve.model.loader.hf import read_hf_config
    path = _write_config(tmp_path, "qwen2_moe", **{switch: value})
    with pytest.raises(ValueError, match=switch):
        read_hf_config(path)


def test_experts_on_a_dense_architecture_are_refused(tmp_path):
    from pipeserve.model.loader.hf import read_hf_config
    cfg = {**_COMMON, "architectures": ["LlamaForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_local_experts"):
        read_hf_config(tmp_path)


# -- costing: compute by ACTIVE parameters, memory by TOTAL parameters --------------------------
def _mixed_moe_config() -> ModelConfig:
    """Qwen2-MoE shape: 6 layers, the first 3 dense (mlp_only_layers) and wide, the last 3 with
    8 narrow experts (top-2) and a shared expert: MoE layers store more but compute less."""
    return ModelConfig.from_hf_dict({
        **_COMMON, "architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 6, "intermediate_size": 512,
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
        "shared_expert_intermediate_size": 64, "mlp_only_layers": [0, 1, 2]})


def test_config_counts_total_and_active_expert_parameters():
    cfg = _mixed_moe_config()
    h, attn_norms = 64, 64 * 64 * 2 + 2 * 64 * 32 + (64 + 2 * 32) + 2 * 64   # q, o, k, v, qkv bias, norms
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False] * 3 + [True] * 3
    router, shared = 8 * h, 3 * h * 64 + h
    assert cfg.layer_params(0) == cfg.active_layer_params(0) == attn_norms + 3 * h * 512
    assert cfg.layer_params(5) == attn_norms + router + 8 * 3 * h * 96 + shared
    assert cfg.active_layer_params(5) == attn_norms + router + 2 * 3 * h * 96 + shared
    assert cfg.layer_params(5) > cfg.layer_params(0) > cfg.active_layer_params(5)
    assert cfg.total_params() == (cfg.embedding_params() + cfg.head_params()
                                  + sum(cfg.layer_params(i) for i in range(6)))


def test_auto_partition_balances_active_and_caps_total_parameters():
    from pipeserve.pipeline.costs import layer_times, parameter_bytes
    from pipeserve.pipeline.part_costs import PartCosts
    from pipeserve.pipeline.partition import auto_partition, chunk_bytes
    cfg = _mixed_moe_config()
    mem = parameter_bytes(cfg, torch.float32)
    assert mem.layer_sizes == tuple(cfg.layer_params(i) * 4 for i in range(6))     # every expert stored
    times = layer_times(cfg, 1.0, measured_layer=3)
    assert times == pytest.approx([cfg.active_layer_params(i) / cfg.active_layer_params(3) for i in range(6)])
    costs = PartCosts(0.0, 1.0, 0.0, layer_sizes=mem.layer_sizes, layer_times=times)
    # Compute: the dense layers are the slow ones, so the first stage gets fewer layers than
    # a balance of stored (total) parameters would give it (that one puts 4 layers first).
    part = auto_partition(6, 2, costs)
    by_total = auto_partition(6, 2, PartCosts(0.0, 1.0, 0.0, layer_times=tuple(map(float, mem.layer_sizes))))
    assert part[0][1] < 4 == by_total[0][1]
    # Memory: a limit of two MoE layers' TOTAL bytes forces the MoE layers apart.
    limit = 2 * mem.layer_sizes[5]
    capped = auto_partition(6, 2, costs, memory_limits=[None, limit])
    assert capped == [(0, 4), (4, 6)] and chunk_bytes(costs, 4, 6, False, True) <= limit


def test_measured_costs_time_an_expert_layer_and_scale_the_dense_ones():
    from pipeserve.pipeline.costs import measure_layer_costs
    cfg = _mixed_moe_config()
    costs = measure_layer_costs(cfg, torch.float32, batch=4, context=16, prefill_tokens=32, repeats=1,
                                attention_backend="torch")
    assert costs.layer > 0 and len(costs.layer_times) == 6
    assert costs.layer_times[3] == costs.layer                         # the measured layer has experts
    assert costs.layer_times[0] / costs.layer_times[3] == pytest.approx(
        cfg.active_layer_params(0) / cfg.active_layer_params(3))
    assert costs.layer_sizes[3] == cfg.layer_params(3) * 4


def test_planner_costs_moe_compute_by_active_and_memory_by_total():
    from pipeserve.plan.memory import stage_weight_bytes
    from pipeserve.plan.presets import load_model as load_preset
    from pipeserve.plan.roofline import BatchShape, LayerCosts as Roofline
    _, mixtral = load_preset("mixtral-8x7b")
    costs = Roofline(mixtral, 2)
    h, expert = 4096, 3 * 4096 * 14336
    attn = costs.attn_params
    one = costs.matmuls(BatchShape.decode(1, 100))
    assert one.flops == pytest.approx(2 * (attn + 8 * h + 2 * expert))              # k = 2 experts' FLOPs
    assert one.bytes > 2 * (attn + 2 * expert) and one.bytes < 2 * (attn + 3 * expert)  # 2 experts read
    big = costs.matmuls(BatchShape.prefill(8, 512))
    assert big.flops == pytest.approx(2 * (attn + 8 * h + 2 * expert) * 8 * 512)  # still k per token
    assert big.bytes > 2 * (attn + 8 * expert)                                        # all 8 experts read
    stored = stage_weight_bytes(mixtral, costs, 32, False, False)
    assert stored == pytest.approx(32 * mixtral.layer_params(0) * 2)
    assert mixtral.layer_params(0) > attn + 8 * expert                                # all experts stored
    # A model mixing dense and expert layers: per-layer averages of both kinds.
    mixed = _mixed_moe_config()
    mixed_costs = Roofline(mixed, 4)
    assert mixed_costs.moe_fraction == 0.5
    assert stage_weight_bytes(mixed, mixed_costs, 6, False, False) == pytest.approx(
        4 * sum(mixed.layer_params(i) for i in range(6)))
    active, _ = mixed_costs.mlp_params(1)
    assert active == pytest.approx((3 * 64 * 512 + mixed.active_layer_params(5) - mixed.active_layer_params(0)
                                    + 3 * 64 * 512) / 2)


def write_mixtral_gguf(hf_dir: Path, path: Path, qtype: str = "F32") -> Path:
    """A tiny Mixtral checkpoint as llama.cpp converts it: arch "llama" with expert_count, the
    router as ffn_gate_inp and each layer's experts stacked in ffn_{gate,up,down}_exps."""
    import re

    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from tests.checkpoints import _add_tensor, _gguf_tensor, _write_metadata
    cfg = AutoConfig.from_pretrained(hf_dir)
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_metadata(writer, cfg)
    writer.add_expert_count(cfg.num_local_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    stacks: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        array = tensor.float().numpy()
        m = re.fullmatch(r"model\.layers\.(\d+)\.block_sparse_moe\.(gate|experts\.(\d+)\.(w[123]))\.weight", name)
        if m is None:
            _add_tensor(writer, *_gguf_tensor(name, array, cfg), qtype)
        elif m.group(2) == "gate":
            _add_tensor(writer, f"blk.{m.group(1)}.ffn_gate_inp.weight", array, "F32")
        else:
            stacks.setdefault((m.group(1), m.group(4)), {})[int(m.group(3))] = array
    kinds = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}
    for (layer, w), experts in stacks.items():
        _add_tensor(writer, f"blk.{layer}.{kinds[w]}.weight", np.stack([experts[e] for e in sorted(experts)]), qtype)
    finish_gguf(writer)
    return path


@pytest.mark.parametrize("qtype,tol", [("F32", 1e-4), ("Q8_0", None)])
def test_mixtral_gguf_matches_transformers(moe_checkpoint, tmp_path, qtype, tol):
    """Loaded from GGUF through two stages (one layer each): F32 logits equal
    transformers' on the safetensors checkpoint; Q8_0 keeps >= 95 % of the top-1 tokens."""
    from pipeserve.model.loader import resolve_model
    from tests.test_loaders import hf_logits, run_stages
    hf_dir = moe_checkpoint("mixtral")
    source = resolve_model(str(write_mixtral_gguf(hf_dir, tmp_path / f"mixtral-{qtype}.gguf", qtype)))
    cfg = source.load_config()
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("MixtralForCausalLM", 8, 2)
    ids = prompts(1, seed=3)[0][:20]
    ours, ref = run_stages(source, [0, 1, 2], ids), hf_logits(hf_dir, ids)
    if tol is not None:
        assert (ours - ref).abs().max().item() < tol
    else:
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.95


def test_qwen3_moe_preset_has_the_published_total_and_active_sizes():
    from pipeserve.plan.presets import load_model as load_preset
    _, cfg = load_preset("Qwen3-30B-A3B")
    active = cfg.embedding_params() + cfg.head_params() + sum(map(cfg.active_layer_params, range(cfg.num_layers)))
    assert cfg.total_params() / 1e9 == pytest.approx(30.5, abs=0.05)    # "30.5B total, 3.3B activated"
    assert active / 1e9 == pytest.approx(3.3, abs=0.06)


@pytest.mark.parametrize("kind", KINDS)
def test_layer_params_equal_the_built_layers(kind):
    """Memory costing counts exactly what a stage builds, layer by layer (all experts included)."""
    from pipeserve.model.llama import LlamaModel
    cfg = ModelConfig.from_hf_dict({**_configs()[kind]().to_dict(), "architectures": [ARCHS[kind]]})
    model = LlamaModel(cfg, 0, cfg.num_layers, False, False)
    built = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    assert built == [cfg.layer_params(i) for i in range(cfg.num_layers)]
    assert any(cfg.active_layer_params(i) < cfg.layer_params(i) for i in range(cfg.num_layers))
