"""Several hosts: the driver + stage 0 in one network namespace, stage 1 (started
by ``pipeserve worker``) in another, joined by a veth pair, so that stages
really talk over an IP link; then the same over a link shaped to 100 Mbit/s.

Namespaces need root and iproute2; where they cannot be made the test skips
and says why. Traffic stays inside the two namespaces made here.

This file is also the driver program run inside namespace A:
``python tests/test_multihost.py driver|llm ADDR PORT``. Both sides share the
cluster key through $PIPESERVE_CLUSTER_KEY.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KEY = "multihost-test-key"
HIDDEN, TOKENS, STEPS = 1024, 128, 6     # 512 KiB of float32 activations per micro-batch
STEP_SECONDS = 0.02


# -- the driver program (namespace A) ----------------------------------------------
def driver_main(addr: str, port: int) -> None:
    from pipeserve.config import EngineConfig
    from pipeserve.model.config import ModelConfig
    from pipeserve.pipeline.executor import PipelineExecutor
    from pipeserve.pipeline.partition import uniform_partition
    from pipeserve.pipeline.synthetic import SleepRunner, SyntheticSource
    from pipeserve.worker.step import SeqSampling, SeqStep, StepInput

    cfg = ModelConfig("LlamaForCausalLM", vocab_size=100_000, hidden_size=HIDDEN, intermediate_size=64,
                      num_layers=4, num_heads=4, num_kv_heads=2, head_dim=HIDDEN // 4,
                      max_position_embeddings=512)
    conf = EngineConfig(pipeline_parallel_size=2, nnodes=2, node_rank=0, master_addr=addr, master_port=port,
                        dtype="float32", threads_per_stage=1, rendezvous_timeout=60.0, stage_timeout=30.0)
    ex = PipelineExecutor(conf, SyntheticSource(STEP_SECONDS), cfg, uniform_partition(4, 2), 8, 0,
                          runner_factory=SleepRunner)
    greedy = SeqSampling(0.0, 1.0, 0, 0.0, None, 0)
    try:
        outputs = []
        for j in range(STEPS):   # one at a time: each transfer is timed alone
            ex.submit(StepInput(j, [SeqStep(j, [j] * TOKENS, 0, [0], greedy)]))
            outputs += ex.wait_all(timeout=30)
        stats = ex.stats()
    finally:
        ex.shutdown()
    tokens = sorted((o.step_id, o.sampled[0].token_id) for o in outputs)
    print("RESULT " + json.dumps({"tokens": tokens, "stats": stats}), flush=True)


LLM_PROMPTS = ["The capital of France is", "Pipelines split a model into"]
SHORT = dict(temperature=0.0, max_tokens=8)
LONG = dict(temperature=0.0, max_tokens=32, ignore_eos=True)
KILL_AFTER_TOKENS = 8      # of LONG's 32: the worker dies with the batch in flight


def llm_driver_main(addr: str, port: int) -> None:
    """The real SmolLM2 at PP = 2 with stage 1 on the other host; the test compares its tokens
    with PP = 1's. A second, longer batch stops at KILL_AFTER_TOKENS tokens, says PHASE2 and
    waits for a line on stdin: the test replaces the other host's worker in that pause, so
    the worker dies mid-batch however fast this machine decodes."""
    from pipeserve import LLM, SamplingParams
    # Dense weights: a replayed sequence is recomputed by a prefill, and only the dense float32
    # path is the token-identical reference (kept weights decode with integer activations).
    with LLM(model="smollm2-135m-instruct", dtype="float32", quantization="none", threads_per_stage=1,
             kv_cache_memory="64MiB", pipeline_parallel_size=2, nnodes=2, master_addr=addr, master_port=port,
             rendezvous_timeout=120.0, stage_timeout=60.0, stage_rejoin_timeout=120.0) as llm:
        pp_short = [o.outputs[0].token_ids for o in llm.generate(LLM_PROMPTS, SamplingParams(**SHORT))]
        pp_long = _generate_pausing(llm.engine, SamplingParams(**LONG))
        restarts = llm.engine.recovery.restarts
    print("RESULT " + json.dumps({"pp": [pp_short, pp_long], "restarts": restarts}), flush=True)


def _generate_pausing(engine, params) -> list[list[int]]:
    """``LLM.generate``'s loop over LLM_PROMPTS, paused once (PHASE2, then a line on stdin) as
    soon as a sequence has KILL_AFTER_TOKENS tokens."""
    for i, prompt in enumerate(LLM_PROMPTS):
        engine.add_request(str(i), prompt, params)
    done: dict[str, list[int]] = {}
    paused = False
    while engine.has_unfinished_requests():
        for out in engine.step(partial_outputs=True):
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
            if not paused and len(out.outputs[0].token_ids) >= KILL_AFTER_TOKENS:
                print("PHASE2", flush=True)
                sys.stdin.readline()
                paused = True
    return [done[str(i)] for i in range(len(LLM_PROMPTS))]


# -- namespaces ------------------------------------------------------------------------
def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=20)


class TwoNamespaces:
    def __init__(self) -> None:
        tag = os.getpid() % 100_000
        self.a, self.b = f"psmhA{tag}", f"psmhB{tag}"
        self.veth_a, self.veth_b = f"psva{tag}", f"psvb{tag}"
        net = 10 + tag % 200
        self.addr_a, self.addr_b = f"10.213.{net}.1", f"10.213.{net}.2"
        self.made: list[str] = []

    def create(self) -> None:
        for ns in (self.a, self.b):
            _ip("ip", "netns", "add", ns)
            self.made.append(ns)
        _ip("ip", "link", "add", self.veth_a, "netns", self.a, "type", "veth", "peer", "name", self.veth_b,
            "netns", self.b)
        for ns, dev, addr in ((self.a, self.veth_a, self.addr_a), (self.b, self.veth_b, self.addr_b)):
            _ip("ip", "addr", "add", f"{addr}/24", "dev", dev, ns=ns)
            _ip("ip", "link", "set", dev, "up", ns=ns)
            _ip("ip", "link", "set", "lo", "up", ns=ns)

    def shape(self) -> None:
        """100 Mbit/s on A's side: stage 0 -> stage 1 activations cross it."""
        _ip("tc", "qdisc", "add", "dev", self.veth_a, "root", "tbf", "rate", "100mbit", "burst", "32kbit",
            "latency", "50ms", ns=self.a)

    def destroy(self) -> None:
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self.made.clear()


def _namespace_problem() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    return None


@pytest.fixture(scope="module")
def namespaces():
    problem = _namespace_problem()
    if problem:
        print(f"SKIP multihost: {problem}")
        pytest.skip(problem)
    ns = TwoNamespaces()
    try:
        ns.create()
    except subprocess.CalledProcessError as exc:
        ns.destroy()
        reason = f"cannot make network namespaces: {exc.stderr.strip() or exc}"
        print(f"SKIP multihost: {reason}")
        pytest.skip(reason)
    yield ns
    ns.destroy()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert ns.a not in left and ns.b not in left


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PIPESERVE_CLUSTER_KEY": KEY}


def _start_driver(ns: TwoNamespaces, port: int, mode: str) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns.a, sys.executable, str(Path(__file__)), mode,
                             ns.addr_a, str(port)], cwd=ROOT, env=_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _start_worker(ns: TwoNamespaces, port: int, stdout=subprocess.PIPE) -> subprocess.Popen:
    """``pipeserve worker`` in namespace B: the same program the driver starts for its own stages."""
    return subprocess.Popen(["ip", "netns", "exec", ns.b, sys.executable, "-m", "pipeserve", "worker",
                             "--nnodes", "2", "--node-rank", "1", "--master-addr", ns.addr_a,
                             "--master-port", str(port), "--rendezvous-timeout", "120"],
                            cwd=ROOT, env=_env(), stdout=stdout, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _run_two_hosts(ns: TwoNamespaces, port: int) -> dict:
    driver = _start_driver(ns, port, "driver")
    worker = _start_worker(ns, port)
    try:
        out, _ = driver.communicate(timeout=120)
        worker_out, _ = worker.communicate(timeout=30)
    finally:
        for proc in (driver, worker):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
    assert driver.returncode == 0, out
    assert worker.returncode == 0, worker_out
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_two_namespaces_then_shaped_link(namespaces: TwoNamespaces) -> None:
    expected = [[j, j + 4] for j in range(STEPS)]   # SleepRunner: first token + number of layers
    plain = _run_two_hosts(namespaces, 29533)
    namespaces.shape()
    shaped = _run_two_hosts(namespaces, 29534)
    assert plain["tokens"] == expected and shaped["tokens"] == expected
    plain_comm = _comm_seconds(plain["stats"])
    shaped_comm = _comm_seconds(shaped["stats"])
    # 6 transfers of 512 KiB at 100 Mbit/s: at least ~0.25 s on the wire.
    wire = STEPS * HIDDEN * TOKENS * 4 * 8 / 100e6
    print(f"two hosts over veth: stage 0 send + stage 1 recv {plain_comm:.3f} s unshaped, "
          f"{shaped_comm:.3f} s at 100 Mbit/s (wire time {wire:.3f} s); "
          f"windows {plain['stats']['window_s']:.3f} s vs {shaped['stats']['window_s']:.3f} s")
    assert shaped_comm > 0.7 * wire
    assert shaped_comm > 2 * plain_comm
    assert shaped["stats"]["window_s"] > plain["stats"]["window_s"]


def test_real_model_across_two_hosts_then_a_replaced_worker(namespaces: TwoNamespaces, tmp_path,
                                                            smollm2_dense_llm) -> None:
    """SmolLM2 with stage 1 in the other namespace: greedy tokens equal PP = 1; then the
    other host's worker is SIGKILLed mid-batch and a new ``pipeserve worker`` started
    there: the driver takes it in, replays, and the batch still equals PP = 1."""
    from pipeserve import SamplingParams
    port = 29535
    logs = [open(tmp_path / f"worker{i}.log", "w") for i in range(2)]
    driver = _start_driver(namespaces, port, "llm")
    workers = [_start_worker(namespaces, port, stdout=logs[0])]
    killer = threading.Timer(400, lambda: os.killpg(driver.pid, signal.SIGKILL))
    killer.start()
    lines: list[str] = []
    try:
        # PP = 1 (the session's dense float32 engine) while the two hosts start.
        ref = [[o.outputs[0].token_ids for o in smollm2_dense_llm.generate(LLM_PROMPTS, SamplingParams(**p))]
               for p in (SHORT, LONG)]
        for line in driver.stdout:
            lines.append(line)
            if line.startswith("PHASE2"):             # the driver waits, mid-batch
                os.killpg(workers[0].pid, signal.SIGKILL)
                workers[0].wait(timeout=10)
                workers.append(_start_worker(namespaces, port, stdout=logs[1]))
                driver.stdin.write("go\n")
                driver.stdin.flush()
        driver.wait(timeout=60)
        replacement_code = workers[-1].wait(timeout=30)   # it stops with the driver
    finally:
        killer.cancel()
        for proc in [driver, *workers]:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for log in logs:
            log.close()
    out = "".join(lines)
    assert driver.returncode == 0, out[-4000:] + (tmp_path / "worker1.log").read_text()[-2000:]
    result = json.loads(next(line for line in lines if line.startswith("RESULT "))[len("RESULT "):])
    print(f"real SmolLM2 over two namespaces: {result['pp']} (PP=1 {ref}), restarts {result['restarts']}")
    assert result["pp"][0] == ref[0]
    assert result["pp"][1] == ref[1]
    assert result["restarts"] >= 1
    assert len(workers) == 2 and replacement_code == 0, (tmp_path / "worker1.log").read_text()[-2000:]


def _comm_seconds(stats: dict) -> float:
    """The activation hop 0 -> 1: stage 0's send time (it blocks until the bytes leave)
    or stage 1's receive time, whichever saw more of the transfer."""
    stages = stats["stages"]
    return max(stages[0]["send_s"], stages[1]["recv_s"])


# -- no namespaces needed ------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_host_that_never_joins_is_a_clear_error(monkeypatch) -> None:
    import multiprocessing

    from pipeserve.config import EngineConfig
    from pipeserve.model.config import ModelConfig
    from pipeserve.pipeline.executor import PipelineExecutor
    from pipeserve.pipeline.synthetic import SleepRunner, SyntheticSource
    from pipeserve.worker.executor import ExecutorError

    monkeypatch.setenv("PIPESERVE_CLUSTER_KEY", KEY)
    cfg = ModelConfig("LlamaForCausalLM", 100, 16, 32, 4, 2, 1, 8, 64)
    conf = EngineConfig(pipeline_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=_free_port(),
                        rendezvous_timeout=2.0, threads_per_stage=1)
    start = time.monotonic()
    with pytest.raises(ExecutorError, match=r"stage\(s\) \[1\] did not join within 2 s \(--rendezvous-timeout"):
        PipelineExecutor(conf, SyntheticSource(), cfg, [(0, 2), (2, 4)], 8, 0, runner_factory=SleepRunner)
    assert time.monotonic() - start < 2.0 + 8.0
    assert multiprocessing.active_children() == []


def test_a_node_worker_starts_a_stage_that_died_again(monkeypatch, tmp_path) -> None:
    """Over 127.0.0.1: the other node's stage process is SIGKILLed (an OOM kill, a crash); its
    ``pipeserve worker`` starts it again, the driver's recovery takes it in, and steps run."""
    from pipeserve.config import EngineConfig
    from pipeserve.model.config import ModelConfig
    from pipeserve.pipeline.executor import PipelineExecutor
    from pipeserve.pipeline.synthetic import SleepRunner, SyntheticSource
    from pipeserve.worker.executor import ExecutorError
    from pipeserve.worker.step import SeqSampling, SeqStep, StepInput
    from tests.procs import descendants

    monkeypatch.setenv("PIPESERVE_CLUSTER_KEY", KEY)
    port = _free_port()
    cfg = ModelConfig("LlamaForCausalLM", 100, 16, 32, 4, 2, 1, 8, 64)
    conf = EngineConfig(pipeline_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port,
                        rendezvous_timeout=120.0, stage_timeout=30.0, stage_rejoin_timeout=120.0, threads_per_stage=1)
    log = open(tmp_path / "worker.log", "w")
    # Stages as new interpreters: the stage is then the worker's child (a zygote's is its grandchild).
    worker = subprocess.Popen([sys.executable, "-m", "pipeserve", "worker", "--nnodes", "2", "--node-rank", "1",
                               "--master-addr", "127.0.0.1", "--master-port", str(port), "--rendezvous-timeout", "120"],
                              cwd=ROOT, env={**_env(), "PIPESERVE_STAGE_ZYGOTE": "0"}, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    greedy = SeqSampling(0.0, 1.0, 0, 0.0, None, 0)

    def run(step_id: int) -> list:
        ex.submit(StepInput(step_id, [SeqStep(step_id, [step_id], 0, [0], greedy)]))
        return [(o.step_id, o.sampled[0].token_id) for o in ex.wait_all(timeout=60)]

    ex = None
    try:
        ex = PipelineExecutor(conf, SyntheticSource(0.01), cfg, [(0, 2), (2, 4)], 8, 0, runner_factory=SleepRunner)
        assert run(1) == [(1, 5)]
        stage = [pid for pid in descendants(worker.pid) if b"--stage" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(stage) == 1, stage
        os.kill(stage[0], signal.SIGKILL)
        with pytest.raises(ExecutorError, match="stage 1"):
            for step_id in range(2, 40):
                run(step_id)
                time.sleep(0.05)
        ex.recover()                  # waits for the stage the worker starts again
        assert run(50) == [(50, 54)]
    finally:
        if ex is not None:
            ex.shutdown()
        try:
            code = worker.wait(timeout=30)
        finally:
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(timeout=10)
            log.close()
    text = (tmp_path / "worker.log").read_text()
    assert "stage 1 (pid %d) exited with code -9 (killed by SIGKILL); starting it again" % stage[0] in text, text
    assert code == 0, text[-3000:]


def test_stages_split_evenly_over_nodes() -> None:
    from pipeserve.pipeline.spec import stages_of_node
    assert [stages_of_node(5, 2, n) for n in range(2)] == [[0, 1, 2], [3, 4]]
    assert [stages_of_node(4, 4, n) for n in range(4)] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="cannot cover 3 nodes"):
        stages_of_node(2, 3, 0)


def test_several_hosts_need_a_cluster_key(monkeypatch) -> None:
    from pipeserve.config import EngineConfig
    from pipeserve.model.config import ModelConfig
    from pipeserve.pipeline.executor import PipelineExecutor
    from pipeserve.pipeline.synthetic import SleepRunner, SyntheticSource

    monkeypatch.delenv("PIPESERVE_CLUSTER_KEY", raising=False)
    cfg = ModelConfig("LlamaForCausalLM", 100, 16, 32, 4, 2, 1, 8, 64)
    conf = EngineConfig(pipeline_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=_free_port())
    with pytest.raises(ValueError, match="needs a shared secret: set --cluster-key"):
        PipelineExecutor(conf, SyntheticSource(), cfg, [(0, 2), (2, 4)], 8, 0, runner_factory=SleepRunner)


if __name__ == "__main__" and sys.argv[1:2] == ["driver"]:
    driver_main(sys.argv[2], int(sys.argv[3]))
if __name__ == "__main__" and sys.argv[1:2] == ["llm"]:
    llm_driver_main(sys.argv[2], int(sys.argv[3]))
