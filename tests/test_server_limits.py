"""What one client may ask of the server is bounded: ``n`` per request, sequences in the queue."""

from __future__ import annotations

import httpx

from tests.test_server_api import MODEL, FakeEngine, _error, live_server, make_client


def test_n_over_the_limit_is_a_400_naming_it():
    with make_client(FakeEngine(), max_n=4) as client:
        err = _error(client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 5,
                                                          "max_tokens": 1}), 400)
        assert err["param"] == "n" and "4" in err["message"] and "--max-n" in err["message"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 100000, "max_tokens": 1}
        assert _error(client.post("/v1/chat/completions", json=chat), 400)["param"] == "n"
        ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 4, "max_tokens": 1})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_admission_counts_sequences_not_prompts():
    engine = FakeEngine(step_s=0.02)
    with live_server(engine, max_queue=4) as (url, state), httpx.Client(base_url=url) as c:
        # 2 prompts x n=3 = 6 sequences: more than the queue holds, although only 2 prompts.
        err = _error(c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 3, "max_tokens": 1}), 429)
        assert "6" in err["message"]
        payload = {"prompt": "abc", "n": 3, "max_tokens": 60, "stream": True}
        with c.stream("POST", "/v1/completions", json=payload) as first:
            lines = first.iter_lines()
            next(lines)  # 3 sequences admitted and producing
            assert state.admitted == 3
            _error(c.post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 1}), 429)
            assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_offline_engine_refuses_n_over_the_limit(tmp_path):
    from pipeserve import LLM, SamplingParams
    from tests.checkpoints import build_checkpoint
    model_dir = build_checkpoint("llama_tied_gqa", tmp_path / "tiny")
    with LLM(model=str(model_dir), dtype="float32", kv_cache_memory="16MiB", max_n=2) as llm:
        refused, ok = llm.generate(["hi", "ho"], [SamplingParams(n=3, max_tokens=2), SamplingParams(n=2, max_tokens=2)])
        assert refused.outputs[0].finish_reason == "error" and "--max-n" in refused.error
        assert len(ok.outputs) == 2 and all(len(o.token_ids) == 2 for o in ok.outputs)
        assert len(llm.generate(["hi"], SamplingParams(n=2, max_tokens=2))[0].outputs) == 2
