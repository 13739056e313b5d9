"""SIGTERM with long requests in flight: the server gives them ``--shutdown-timeout`` seconds, then
aborts them and exits, leaving no process behind. Its own server (the shared one in
test_server_e2e.py lets its last stream finish). Ctrl-C (SIGINT to the whole process group, the
stages included) is a graceful shutdown too."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.checkpoints import build_checkpoint
from tests.test_server_e2e import KEY, NAME, _children, _start_server, _stop, _stream_finishes_across, _wait_for

SHUTDOWN_TIMEOUT = 3.0


def test_sigterm_aborts_long_requests_after_the_shutdown_timeout(tmp_path):
    model_dir = build_checkpoint("llama_tied_gqa", tmp_path / "tiny")
    server = _start_server(model_dir, 2, tmp_path / "server.log", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
                           "--max-num-seqs", "1")
    try:
        children = _children(server.proc.pid)
        # 64 sequences of 240 tokens, one at a time: 15,360 decode steps, far longer than the shutdown
        # timeout (8 at a time, a fast host finished them inside it, and the test saw a 200).
        body = {"model": NAME, "prompt": ["a long request"] * 8, "n": 8, "max_tokens": 240,
                "ignore_eos": True}
        answers: list[httpx.Response | Exception] = []

        def post() -> None:
            try:
                answers.append(httpx.post(f"{server.url}/v1/completions", json=body, timeout=120,
                                          headers={"Authorization": f"Bearer {KEY}"}))
            except httpx.HTTPError as exc:
                answers.append(exc)

        client = threading.Thread(target=post)
        client.start()
        assert _wait_for(lambda: _running(server) > 0, 30.0), "the request never started running"
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(SHUTDOWN_TIMEOUT + 30) == 0, server.log.read_text()[-3000:]
        elapsed = time.monotonic() - start
        client.join(30)
        assert elapsed < SHUTDOWN_TIMEOUT + 20, f"exit took {elapsed:.1f} s"
        # The aborted request is answered with an OpenAI-style 503, not dropped or a 500.
        assert len(answers) == 1 and isinstance(answers[0], httpx.Response), answers
        assert answers[0].status_code == 503 and "shutting down" in answers[0].json()["error"]["message"]
        assert _wait_for(lambda: not any(Path(f"/proc/{c}").exists() for c in children), 10.0), children
    finally:
        _stop(server)


def _running(server) -> float:
    try:
        metrics = server.metrics()
    except httpx.HTTPError:
        return 0.0
    return metrics.get(("pipeserve_num_requests_running", ()), 0.0)


def test_ctrl_c_to_the_process_group_lets_the_stream_finish(tmp_path):
    """A terminal's Ctrl-C reaches the server and every stage: the stages leave it to the server,
    whose graceful shutdown lets the running stream end normally, then stops them."""
    model_dir = build_checkpoint("llama_tied_gqa", tmp_path / "tiny")
    server = _start_server(model_dir, 2, tmp_path / "server.log", new_session=True)
    try:
        children = _children(server.proc.pid)
        _stream_finishes_across(server, lambda: os.killpg(server.proc.pid, signal.SIGINT), max_tokens=60)
        log = server.log.read_text()
        assert "KeyboardInterrupt" not in log and "pipeline failed" not in log, log[-3000:]
        assert _wait_for(lambda: not any(Path(f"/proc/{c}").exists() for c in children), 10.0), children
    finally:
        _stop(server)
