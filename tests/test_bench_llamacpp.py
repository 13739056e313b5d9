"""``pipeserve bench throughput --backend ...,llamacpp``: the optional llama.cpp
baseline (llama-cpp-python), its missing-package message, and a tiny real run."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from pipeserve.bench import run_throughput
from pipeserve.bench.run_throughput import parse_backends
from pipeserve.entrypoints.cli import main

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


def test_backend_lists():
    assert parse_backends("both") == ["pipeserve", "hf"]
    assert parse_backends("pipeserve,llamacpp") == ["pipeserve", "llamacpp"]
    assert parse_backends("llamacpp, llamacpp") == ["llamacpp"]
    with pytest.raises(ValueError, match="pipeserve, hf, llamacpp"):
        parse_backends("vllm")


def test_missing_llama_cpp_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    rc = main(["bench", "throughput", "--backend", "pipeserve,llamacpp", "--num-prompts", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "needs llama-cpp-python" in err
    assert "pip install 'pipeserve[llamacpp]'" in err and "pip install llama-cpp-python" in err


def test_llamacpp_needs_a_gguf(monkeypatch, tiny_checkpoints):
    monkeypatch.setattr(run_throughput, "import_llama_cpp", lambda: None)
    with pytest.raises(ValueError, match="runs GGUF files"):
        run_throughput.llamacpp_model(str(tiny_checkpoints("llama_tied_gqa")))


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not installed (the optional extra "
                    "pipeserve[llamacpp]; it compiles llama.cpp, so CI does not install it)")
def test_single_stream_side_by_side_on_the_builtin_gguf(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench", "throughput", "--backend", "pipeserve,llamacpp", "--num-prompts", "1",
               "--input-len", "16", "--output-len", "6", "--num-warmup", "1", "--llamacpp-threads", "1",
               "--kv-cache-memory", "32MiB", "--no-progress", "--output", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    ours, theirs = result["runs"]
    assert ours["backend"] == "pipeserve" and theirs["backend"] == "llamacpp" and theirs["threads"] == 1
    for run in result["runs"]:
        assert run["completed"] == 1 and run["total_output_tokens"] == 6   # EOS does not stop either
        assert 0 < run["ttft_ms"]["mean"] <= run["e2el_ms"]["mean"] and run["tpot_ms"]["n"] == 1
    assert result["llamacpp"]["ratio_output_tokens_per_s"] > 0
    assert "pipeserve / llama.cpp output tokens/s" in capsys.readouterr().out
