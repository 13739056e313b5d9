"""Dense families beyond Llama (Qwen3, Phi-3, Gemma 2, Gemma 3) against transformers.

Each family is a tiny random checkpoint built from its transformers config:
float32 greedy tokens equal transformers' at PP = 1 and PP = 2 through both
attention backends, with prompts longer than the sliding window where the
family has one; bfloat16 agrees with float32 on >= 95 % of teacher-forced
top-1 tokens; config switches the engine does not implement are refused at
load, each with a message naming the switch.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from pipeserve import LLM, SamplingParams
from pipeserve.model.loader import load_model, resolve_model
from tests.checkpoints import _randomize, hf_step, lazy_builds, save_tiny_tokenizer

VOCAB, WINDOW, NEW = 512, 8, 10
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)


def _configs() -> dict:
    from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config, Qwen3Config
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 24,
                "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.5 * i for i in range(8)]}
    return {
        # head_dim 24 is neither hidden / heads (16) nor a power of two; layers 2 and 3 slide.
        "qwen3": lambda: Qwen3Config(**_BASE, head_dim=24, tie_word_embeddings=False, use_sliding_window=True,
                                     sliding_window=WINDOW, max_window_layers=2),
        # Phi-3-mini slides on every layer (2047 tokens); transformers applies it.
        "phi3": lambda: Phi3Config(**_BASE, tie_word_embeddings=False, sliding_window=WINDOW),
        "phi3_longrope": lambda: Phi3Config(**{**_BASE, "max_position_embeddings": 96},
                                            original_max_position_embeddings=24, rope_parameters=longrope,
                                            tie_word_embeddings=False),
        "gemma2": lambda: Gemma2Config(**_BASE, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                       attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
        "gemma3": lambda: Gemma3TextConfig(**_BASE, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                           sliding_window_pattern=2, rope_parameters={
                                               "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 100000.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}),
    }


FAMILIES = ("qwen3", "phi3", "phi3_longrope", "gemma2", "gemma3")
_ARCH = {"qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "phi3_longrope": "Phi3ForCausalLM",
         "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def build_family(kind: str, directory: Path, seed: int = 0) -> Path:
    """Tiny random checkpoint of ``kind`` (one of FAMILIES) saved as safetensors."""
    config = _configs()[kind]()
    config.architectures = [_ARCH[kind]]
    return save_random_checkpoint(config, directory, seed)


def save_random_checkpoint(config, directory: Path, seed: int = 0) -> Path:
    """A random-weight model of a transformers ``config`` (architectures set) saved with a tiny tokenizer."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    if config.model_type.startswith("gemma"):  # Gemma norms scale by (1 + w): keep the scale near 1, as trained models do
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.sub_(1.0)
    model.save_pretrained(directory)
    save_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    return lazy_builds(tmp_path_factory.mktemp("families"), build_family)


def prompts_for(kind: str) -> list[list[int]]:
    # Past the window (8) but for the first. For longrope (original length 24):
    # one stays short to the end, one crosses 24 while decoding (transformers'
    # generate() then recomputes every key with the long factors, and so does
    # pipeserve's scheduler) and two start long.
    rng = random.Random(kind)
    lengths = (5, 18, 30, 37) if kind == "phi3_longrope" else (5, 14, 30, 37)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]


def hf_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuation, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


def ours_greedy(path: Path, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)
    with LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", threads_per_stage=1, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_matches_transformers_pp1_and_pp2_both_backends(family_dirs, kind):
    path = family_dirs(kind)
    prompts = prompts_for(kind)
    expected = hf_greedy(path, prompts)
    # Longrope: small steps, so long prompts and the recompute at the crossing run in chunks.
    extra = {"max_num_batched_tokens": 8} if kind == "phi3_longrope" else {}
    # PP = 1 on one backend, PP = 2 on the other (fewer engine starts keep the test fast);
    # the auto partition measures this family's layers (pipeserve/pipeline/costs.py).
    assert ours_greedy(path, prompts, attention_backend="torch", **extra) == expected
    assert ours_greedy(path, prompts, attention_backend="cpu", pipeline_parallel_size=2, pp_partition="auto",
                       **extra) == expected


def test_longrope_picks_its_factors_by_the_length_it_runs(family_dirs):
    """The rotary alone (no recompute): a sequence decoding past
    original_max_position_embeddings (24) rotates its new tokens with the long
    factors and keeps its cached keys, as transformers' forward with a cache
    does; logits equal it at every step. (generate() also recomputes the
    cache at the crossing; the scheduler does that, tested below.)"""
    from transformers import AutoModelForCausalLM

    from tests.test_model_numerics import Driver, make_runner
    path = family_dirs("phi3_longrope")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompt = prompts_for("phi3_longrope")[2][:20]
    driver = Driver(make_runner(path))
    ours, cache, ids = driver.logits([driver.seq_step(0, prompt)])[0], None, torch.tensor([prompt])
    with torch.no_grad():
        for token in range(3, 3 + 8):      # contexts 20 .. 28: short, then long from 25 on
            res, cache = hf_step(hf, ids, cache)
            ids = torch.tensor([[token]])
            torch.testing.assert_close(ours, res.logits[0, -1], rtol=0, atol=1e-4)
            ours = driver.logits([driver.seq_step(0, [token])])[0]


def test_longrope_prefix_cache_keeps_short_and_long_rotations_apart(family_dirs):
    """One engine, prefix caching on: a prompt that crosses 24 while decoding
    (its first 16 tokens cached with the short rotation, then recomputed with the
    long one), then a long prompt and a short prompt that share those 16
    tokens (the short one crosses 24 too): each must hit only the blocks of its
    own rotation, and every continuation equals transformers' generate()."""
    path = family_dirs("phi3_longrope")
    rng = random.Random("prefix")
    first = [rng.randrange(3, 300) for _ in range(20)]
    prompts = [first, first[:16] + [rng.randrange(3, 300) for _ in range(14)], first[:16] + [7]]
    expected = hf_greedy(path, prompts)
    params = SamplingParams(temperature=0, max_tokens=NEW, min_tokens=NEW)
    with LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB", threads_per_stage=1,
             max_num_batched_tokens=8) as llm:
        got = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]
        stats = llm.stats()["scheduler"]
    assert got == expected
    assert stats["num_rope_recomputes"] == 2          # the first and the last prompt cross 24, once each
    assert stats["prefix_cache_hit_blocks"] >= 2      # the later prompts reuse blocks of their rotation


def test_longrope_scheduler_never_reads_keys_of_the_other_rotation():
    """The scheduler alone (tests/test_scheduler.py's fake engine), KV tagged with
    the rotation it was written with: random requests around the switch length,
    with prefix caching, n > 1 forks, swaps and several micro-batches in flight;
    no step reads a key of the other rotation, and every crossing recomputes."""
    from pipeserve.scheduler.scheduler import Scheduler
    from tests.test_scheduler import FakeEngine

    switch = 10

    class RopeTaggedEngine(FakeEngine):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.sched = Scheduler(self.config, len(self.dev), len(self.host), self.requests,
                                   rope_switch_len=switch)

        def _signatures(self, seq):
            rotation = seq.num_tokens > switch     # what the step computes (SeqStep.seq_len)
            return [hash((rotation, s)) for s in super()._signatures(seq)]

    for seed, mode in ((1, "swap"), (2, "recompute")):
        eng = RopeTaggedEngine(num_blocks=12, num_host_blocks=6, max_inflight=2, seed=seed, preemption_mode=mode,
                               max_num_batched_tokens=6, max_num_seqs=4)
        rng = random.Random(seed)
        shared = [rng.randrange(4) for _ in range(8)]
        for _ in range(40):
            prompt = shared[:rng.randrange(9)] + [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
            eng.add(prompt, rng.randint(1, 8), n=rng.choice([1, 1, 2]))
            for _ in range(rng.randrange(4)):
                eng.pump()
        eng.drain()
        eng.assert_clean()
        stats = eng.sched.stats()
        assert stats["num_rope_recomputes"] > 0 and stats["prefix_cache_hit_blocks"] > 0
        assert eng.pipelined > 0            # prompts' chunks were in flight together


def test_longrope_switch_length_is_the_original_length_unless_the_factors_agree():
    from pipeserve.model.config import ModelConfig
    raw = {**_BASE, "architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 96,
           "original_max_position_embeddings": 24}
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8}
    def switch(long_factor: list[float]) -> int | None:
        return ModelConfig.from_hf_dict({**raw, "rope_parameters": {**rope, "long_factor": long_factor}}).rope_switch_len
    assert switch([2.0] * 8) == 24
    assert switch([1.0] * 8) is None     # one rotation at every length: nothing to recompute


@pytest.mark.parametrize("kind", FAMILIES)
def test_bfloat16_top1_agrees_with_float32(family_dirs, kind):
    """Teacher-forced: the same tokens through both dtypes (the C kernels in
    bfloat16, where they apply), >= 95 % equal top-1 tokens."""
    path = family_dirs(kind)
    tokens = [t for p in prompts_for(kind) for t in p]
    top = {dtype: teacher_forced_logits(path, tokens, dtype).argmax(-1) for dtype in (torch.float32, torch.bfloat16)}
    agreement = (top[torch.float32] == top[torch.bfloat16]).float().mean().item()
    assert agreement >= 0.95, f"{kind}: bf16 top-1 agrees with f32 on {agreement:.1%}"


def teacher_forced_logits(path: Path, tokens: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Logits [len(tokens), vocab] of one prefill of ``tokens`` through the whole model."""
    source = resolve_model(str(path))
    cfg = source.load_config()
    model = load_model(source, cfg, 0, cfg.num_layers, True, True, dtype, "cpu", attention_backend="cpu")
    block, n = 16, len(tokens)
    blocks = -(-n // block)
    meta = model.backend.build_metadata([n], [n], [list(range(blocks))], block, torch.device("cpu"))
    shape = (blocks, block, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(cfg.num_layers)]
    with torch.no_grad():
        hidden = model(torch.tensor(tokens), torch.arange(n), meta, caches)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("kind", FAMILIES)
def test_layer_params_count_the_built_layers(family_dirs, kind):
    """The partitioner and planner cost a layer by ``layer_params``: it counts the
    q/k norms and Gemma's extra norms the runtime builds."""
    from pipeserve.model.llama import LlamaModel
    cfg = resolve_model(str(family_dirs(kind))).load_config()
    model = LlamaModel(cfg, 0, cfg.num_layers, True, True)
    for i, layer in enumerate(model.layers):
        assert cfg.layer_params(i) == sum(p.numel() for p in layer.parameters())


def test_layer_sliding_window_as_transformers_reads_the_config():
    from pipeserve.model.config import ModelConfig
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)

    def windows(raw: dict) -> list[int | None]:
        cfg = ModelConfig.from_hf_dict({**shape, **raw})
        return [cfg.layer_sliding_window(i) for i in range(4)]
    qwen2 = {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 8, "max_window_layers": 1}
    assert windows({**qwen2, "use_sliding_window": True}) == [None, 8, 8, 8]
    assert windows({**qwen2, "use_sliding_window": False}) == [None] * 4
    assert windows({"architectures": ["MistralForCausalLM"], "sliding_window": 8}) == [8] * 4
    gemma = {"architectures": ["Gemma2ForCausalLM"], "sliding_window": 8,
             "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert windows(gemma) == [8, None, 8, None]
    # Hub configs written before layer_types existed: transformers derives the pattern.
    assert windows({"architectures": ["Gemma2ForCausalLM"], "sliding_window": 8}) == [8, None, 8, None]
    gemma3 = {"architectures": ["Gemma3ForCausalLM"], "sliding_window": 8, "sliding_window_pattern": 3,
              "rope_theta": 1e6, "rope_local_base_freq": 1e4}
    assert windows(gemma3) == [8, 8, None, 8]
    cfg = ModelConfig.from_hf_dict({**shape, **gemma3})
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)


# -- refusals: each switch the engine does not implement, named at load ------

REFUSALS = [
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}, "yarn"),
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}}, "dynamic"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ("qwen3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("phi3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ("qwen3", {"query_pre_attn_scalar": 64}, "query_pre_attn_scalar"),
    ("qwen3", {"hidden_act": "relu2"}, "hidden_act"),
    ("gemma2", {"hidden_activation": "gelu_new"}, "hidden_act"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("phi3", {"attention_bias": True}, "attention_bias"),
    ("qwen3", {"mlp_bias": True}, "mlp_bias"),
    ("qwen3", {"layer_types": ["chunked_attention"] * 4, "sliding_window": 8, "use_sliding_window": True},
     "layer_types"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                          "rope_theta": 1e4}}}, "sliding_attention.rope_type"),
    ("qwen3", {"architectures": ["Qwen3NextForCausalLM"]}, "Qwen3NextForCausalLM"),
    ("gemma2", {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
     "layer_types has 3 entries"),
    ("phi3_longrope", {"original_max_position_embeddings": None, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}},
     "original_max_position_embeddings"),
    ("phi3_longrope", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                           "original_max_position_embeddings": 24, "short_factor": [1.0] * 8,
                                           "long_factor": [2.0] * 6}}, "long_factor has 6 entries"),
]


@pytest.mark.parametrize("kind,change,named", REFUSALS, ids=[r[2] + "-" + r[0] for r in REFUSALS])
def test_unsupported_switch_is_refused_at_load(family_dirs, tmp_path, kind, change, named):
    config = json.loads((family_dirs(kind) / "config.json").read_text())
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=named):
        resolve_model(str(tmp_path)).load_config()


def test_every_accepted_activation_is_implemented():
    from pipeserve.model.families import ACTIVATIONS
    from pipeserve.model.layers import GATE_ACTIVATIONS
    assert set(ACTIVATIONS) == set(GATE_ACTIVATIONS)


def test_untied_checkpoint_without_lm_head_is_refused(family_dirs, tmp_path):
    """tie_word_embeddings false but no lm_head.weight: the message names the switch."""
    from safetensors.torch import load_file, save_file
    source = family_dirs("qwen3")
    state = load_file(str(source / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((source / "config.json").read_text())
    src = resolve_model(str(tmp_path))
    cfg = src.load_config()
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        load_model(src, cfg, 0, cfg.num_layers, True, True, torch.float32, "cpu")
