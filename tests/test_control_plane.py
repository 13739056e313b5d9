"""The control plane: typed frames (no pickle), the HMAC handshake, stage processes
as their own programs, and a remote stage that rejoins a driver."""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeserve.comm.auth import KEY_ENV, AuthError, client_handshake, cluster_key
from pipeserve.comm.messages import PREFIX, Hello, Pong, decode_header, encode_frame, parse_prefix
from pipeserve.comm.tcp import TcpTransport
from pipeserve.comm.transport import Kind
from pipeserve.config import EngineConfig
from pipeserve.metrics.timeline import Interval
from pipeserve.model.config import ModelConfig
from pipeserve.pipeline.joining import join_stages
from pipeserve.pipeline.spec import Hop, PipelineSpec, SpecWire, StepEnvelope
from pipeserve.pipeline.synthetic import SleepRunner, SyntheticSource
from pipeserve.worker.step import SampledToken, SeqSampling, SeqStep, StepInput, StepOutput
from pipeserve.worker.step_wire import WireError

ROOT = Path(__file__).resolve().parents[1]
KEY = b"test-cluster-key"


def _roundtrip(kind: Kind, obj, tensor=None):
    head, raw = encode_frame(kind, obj, tensor)
    header_len, tensor_len = parse_prefix(head[:PREFIX.size])
    kind2, obj2, dtype, shape = decode_header(head[PREFIX.size:PREFIX.size + header_len], tensor_len)
    out = None
    if dtype is not None:   # as Connection.read: an empty tensor has no bytes
        out = (torch.frombuffer(bytearray(raw.tobytes()), dtype=torch.uint8).view(dtype).reshape(shape)
               if tensor_len else torch.empty(shape, dtype=dtype))
    return kind2, obj2, out


def _step() -> StepInput:
    sampling = SeqSampling(0.7, 0.9, 40, 0.0, 123, 3, prompt_token_ids=[1, 2], banned_token_ids=[7])
    return StepInput(5, [SeqStep(1, [3, 4, 5], 0, [0, 1], sampling), SeqStep(2, [9], 17, [2])],
                     swap_out=[(1, 0)], copies=[(3, 4)])


def test_step_messages_round_trip_through_the_declared_format() -> None:
    hidden = torch.randn(4, 8, dtype=torch.bfloat16)
    env = StepEnvelope(_step(), 1, [Interval(0, "compute", 1.5, 2.5, 5, 1)])
    kind, obj, tensor = _roundtrip(Kind.STEP, env, hidden)
    assert kind == Kind.STEP and obj == env and torch.equal(tensor, hidden)
    # a hop (the step went ahead as a PLAN); the tensor's bytes are a view of a contiguous CPU
    # tensor's memory, else a copy (a transposed one), and an empty one has none
    hop = Hop(5, 1, [Interval(0, "compute", 1.5, 2.5, 5, 0)])
    assert _roundtrip(Kind.PLAN, env.step)[1] == env.step
    for t in (hidden, hidden.t(), torch.arange(6, dtype=torch.int64).view(2, 3)[:, 1], hidden[:0]):
        kind, obj, tensor = _roundtrip(Kind.HOP, hop, t)
        assert kind == Kind.HOP and obj == hop and torch.equal(tensor, t) and tensor.dtype == t.dtype
    result = (StepOutput(5, [SampledToken(1, 42, -math.inf, [(42, -0.5)])]), [])
    assert _roundtrip(Kind.RESULT, result)[1] == result
    cfg = ModelConfig("LlamaForCausalLM", 100, 16, 32, 4, 2, 1, 8, 64, eos_token_ids=(2, 3),
                      rope_scaling={"type": "linear", "factor": 2.0})
    spec = PipelineSpec(EngineConfig(pipeline_parallel_size=2, cluster_key="secret"), SyntheticSource(0.1),
                        cfg, [(0, 2), (2, 4)], 8, 0, SleepRunner)
    wire = _roundtrip(Kind.SPEC, SpecWire.of(spec))[1]
    assert wire.config.cluster_key is None                       # the secret never travels
    back = wire.to_spec()
    assert back.model_cfg == cfg and back.source == spec.source and back.runner_factory is SleepRunner
    assert back.config == spec.config.replace(cluster_key=None)


def test_hops_and_tokens_go_packed_and_read_back_as_their_json_form() -> None:
    """A HOP and a RESULT without intervals (nor top logprobs) and a step's TOKENS have a packed
    header (what one request sends each token); they decode to what the JSON form gives, and the
    others stay JSON."""
    from pipeserve.comm import messages
    hidden = torch.randn(4, 8, dtype=torch.bfloat16)
    values = [(Kind.HOP, Hop(5, 1), t) for t in (hidden, hidden.t(), hidden[:0], torch.zeros((), dtype=torch.int64),
                                                 torch.arange(6, dtype=torch.int64).view(2, 3)[:, 1])]
    values += [(Kind.HOP, Hop(2**40, 0), None), (Kind.TOKENS, (9, []), None),
               (Kind.TOKENS, (2**62, [(i, 49151 - i) for i in range(128)]), None),
               (Kind.RESULT, (StepOutput(3, []), []), None),
               (Kind.RESULT, (StepOutput(4, [SampledToken(i, 7 * i, -0.1 * i) for i in range(128)]
                                         + [SampledToken(200, 1, -math.inf), SampledToken(201, 2, 0.0)]), []), None)]
    for kind, obj, t in values:
        head, _ = encode_frame(kind, obj, t)
        assert head[PREFIX.size] == messages.COMPACT_MARK
        got_kind, got, tensor = _roundtrip(kind, obj, t)
        saved = dict(messages.COMPACT)
        messages.COMPACT.clear()
        try:
            assert encode_frame(kind, obj, t)[0][PREFIX.size:PREFIX.size + 1] == b"{"
            as_json = _roundtrip(kind, obj, t)
        finally:
            messages.COMPACT.update(saved)
        assert got_kind == kind and got == obj == as_json[1] and type(got) is type(as_json[1])
        assert (tensor is None and t is None) or (torch.equal(tensor, t) and tensor.dtype == t.dtype
                                                  and torch.equal(tensor, as_json[2]))
    interval = Interval(0, "compute", 1.5, 2.5, 5, 0)
    for kind, obj, t in [(Kind.HOP, Hop(5, 1, [interval]), hidden),
                         (Kind.RESULT, (StepOutput(5, [SampledToken(1, 2, -0.5)]), [interval]), None),
                         (Kind.RESULT, (StepOutput(5, [SampledToken(1, 2, -0.5, [(2, -0.5)])]), []), None)]:
        assert encode_frame(kind, obj, t)[0][PREFIX.size:PREFIX.size + 1] == b"{"    # JSON: intervals, top logprobs
        assert _roundtrip(kind, obj, t)[1] == obj


@pytest.mark.parametrize("header,tensor_len,error", [
    (b"\x01\x16", 0, "too short"),
    (b"\x01\x63\xff\x00", 0, "kind 99 has no packed form"),
    (b"\x01\x01\xff\x00", 0, "kind 1 has no packed form"),                   # a STEP is JSON only
    (b"\x01\x16\x00\x09" + bytes(72), 0, "bad tensor dims 9"),
    (b"\x01\x16\x00\x02" + bytes(8), 0, "bad tensor dims 2"),
    (b"\x01\x16\x07\x00" + bytes(12), 0, "unknown tensor dtype code 7"),
    (b"\x01\x16\x00\x01" + (2).to_bytes(8, "big") + bytes(12), 4, "does not match its 4 bytes"),
    (b"\x01\x16\xff\x00" + bytes(12), 4, "tensor bytes or dims without a tensor dtype"),
    (b"\x01\x16\xff\x00" + bytes(11), 0, "HOP frame: bad packed payload"),
    (b"\x01\x14\xff\x00" + bytes(16), 0, "TOKENS frame: bad packed payload .16 bytes are not"),
    (b"\x01\x02\xff\x00" + bytes(20), 0, "RESULT frame: bad packed payload .20 bytes are not"),
    (b"\x01\x02\xff\x00" + bytes(4), 0, "RESULT frame: bad packed payload"),
])
def test_malformed_packed_frames_are_refused(header: bytes, tensor_len: int, error: str) -> None:
    with pytest.raises(WireError, match=error):
        decode_header(header, tensor_len)


def test_the_decoders_fast_paths_keep_the_declared_types() -> None:
    """A float field passes a JSON float as it is and widens a JSON int; a nullable field passes
    null and still checks anything else."""
    from pipeserve.worker.step_wire import dumps, from_wire
    data = json.loads(dumps(_step()))
    sampling = data[1][0][4]
    sampling[0], sampling[9] = 1, None          # temperature as a JSON int; no prompt ids
    got = from_wire(StepInput, data)
    assert type(got.seqs[0].sampling.temperature) is float and got.seqs[0].sampling.temperature == 1.0
    assert got.seqs[0].sampling.prompt_token_ids is None and got.seqs[1].sampling is None
    sampling[9] = "1, 2"
    with pytest.raises(WireError, match="SeqSampling.prompt_token_ids"):
        from_wire(StepInput, data)
    sampling[9], sampling[1] = None, True        # a bool is no float
    with pytest.raises(WireError, match="SeqSampling.top_p: expected float, got bool"):
        from_wire(StepInput, data)


@pytest.mark.parametrize("header,error", [
    (b"\x80\x04not json", "not JSON"),
    (b'{"kind": 1, "obj": null, "tensor": null}', "expected StepEnvelope as an array"),
    (b'{"kind": 1, "obj": [[1, [[1, ["2"], 0, [0], null, null]], [], [], [], false, -1, false], 0, []], '
     b'"tensor": null}',
     "SeqStep.token_ids: expected int, got str"),
    (b'{"kind": 99, "obj": null, "tensor": null}', "unknown message kind"),
    (b'{"kind": 18, "obj": "x", "tensor": null}', "not accepted from the wire"),
    (b'{"kind": 6, "obj": ["1.0", 0.0, 0.0, 0.0], "tensor": null}', "Pong.stage_time: expected float"),
    (b'{"kind": 10, "obj": [1, 2, "", 0, "evil"], "tensor": null}', "array of 4 fields"),
    (b'{"kind": 10, "obj": [true, 2, "", 0], "tensor": null}', "Hello.rank: expected int, got bool"),
    (b'{"kind": 2, "obj": [[1, []], []], "tensor": {"dtype": "float32", "shape": [2]}}',
     "does not match its 4 bytes"),
])
def test_malformed_frames_are_refused(header: bytes, error: str) -> None:
    with pytest.raises(WireError, match=error):
        decode_header(header, 4 if b"shape" in header else 0)


def test_a_key_is_required_across_hosts(monkeypatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(ValueError, match="needs a shared secret"):
        cluster_key(None, nnodes=2)
    assert cluster_key(None, 1) != cluster_key(None, 1)      # random per run on one host
    monkeypatch.setenv(KEY_ENV, "from-env")
    assert cluster_key(None, 2) == b"from-env" and cluster_key("flag", 2) == b"flag"


# -- a listening transport and its strangers --------------------------------------
@pytest.fixture
def listener():
    server = TcpTransport(0, 3, KEY)
    port = server.listen("127.0.0.1", 0)
    yield server, port
    server.close()


def test_a_client_without_the_key_is_refused_before_any_frame(listener) -> None:
    server, port = listener
    intruder = TcpTransport(1, 3, b"wrong key")
    with pytest.raises(AuthError):
        intruder.connect(0, "127.0.0.1", port, Hello(1, os.getpid()))
    # A raw client that skips the handshake and sends a frame is closed unread.
    with socket.create_connection(("127.0.0.1", port)) as sock:
        head, _ = encode_frame(Kind.HELLO, Hello(1, os.getpid()), None)
        sock.sendall(head.ljust(64, b"\0"))
        sock.settimeout(5)
        assert _drain(sock).startswith(b"PIPESRV1")           # only the challenge came back
    with pytest.raises(TimeoutError):
        server.recv(timeout=0.3)
    friend = TcpTransport(1, 3, KEY)
    friend.connect(0, "127.0.0.1", port, Hello(1, os.getpid()))
    message = server.recv(timeout=5)
    assert (message.kind, message.src) == (Kind.HELLO, 1)
    friend.send(0, Kind.PONG, Pong(1.25, computing_s=3.0, computing_cpu_s=2.5))
    assert server.recv(timeout=5).obj == Pong(1.25, 3.0, 2.5, 0.0)
    friend.close()
    lost = server.recv(timeout=5)
    assert (lost.kind, lost.src) == (Kind.LOST, 1)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="connection to rank 1 was lost"):
        server.send(1, Kind.PING)          # at once: not LINK_WAIT for a link that will not come
    assert time.monotonic() - start < 1.0


def _drain(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return data


class _Payload:
    """Unpickling this creates ``path``: proof that a pickle was (not) loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def send_pickles(host: str, port: int, key: bytes, marker: Path) -> None:
    """Every way a pickle could reach a port: instead of the handshake, and as an
    (authenticated) frame's header and tensor bytes."""
    bomb = pickle.dumps(_Payload(marker))
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.recv(40)
        sock.sendall(bomb.ljust(64, b"\0") + bomb)
        _drain(sock)
    with socket.create_connection((host, port), timeout=5) as sock:
        client_handshake(sock, key)
        sock.sendall(PREFIX.pack(b"PSF1", len(bomb), 0) + bomb)
        _drain(sock)
    with socket.create_connection((host, port), timeout=5) as sock:
        client_handshake(sock, key)
        sock.sendall(bomb)
        _drain(sock)


def test_strangers_and_pickles_at_the_driver_and_a_stage_port(tmp_path, monkeypatch) -> None:
    """A client without the key is refused by both ports; pickles sent there (in
    place of the handshake, or as frames of an authenticated client) are never
    loaded, and the pipeline goes on serving."""
    from pipeserve.pipeline.executor import PipelineExecutor
    monkeypatch.setenv(KEY_ENV, KEY.decode())
    cfg = ModelConfig("LlamaForCausalLM", 100, 16, 32, 4, 2, 1, 8, 64)
    conf = EngineConfig(pipeline_parallel_size=2, dtype="float32", threads_per_stage=1, rendezvous_timeout=60.0,
                        stage_timeout=20.0)
    ex = PipelineExecutor(conf, SyntheticSource(0.0), cfg, [(0, 2), (2, 4)], 8, 0, runner_factory=SleepRunner)
    try:
        transport = ex.world.transport
        ports = {"driver": ex.world.port, "stage 1": transport.peers[2].port}
        for name, port in ports.items():
            with pytest.raises(AuthError):      # no key, no entry
                TcpTransport(1, 3, b"not the key").connect(0, "127.0.0.1", port, Hello(1, os.getpid()))
            marker = tmp_path / f"pwned-{name.replace(' ', '')}"
            send_pickles("127.0.0.1", port, KEY, marker)
            time.sleep(0.2)
            assert not marker.exists(), f"a pickle sent to the {name}'s port was loaded"
        greedy = SeqSampling(0.0, 1.0, 0, 0.0, None, 0)
        ex.submit(StepInput(0, [SeqStep(0, [3], 0, [0], greedy)]))   # the pipeline is unharmed
        outs = ex.wait_all(timeout=20)
        assert [o.sampled[0].token_id for o in outs] == [3 + 4]
    finally:
        ex.shutdown()


# -- stage processes ------------------------------------------------------------------
README_BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def test_readme_example_without_main_guard_runs_at_pp2(tmp_path) -> None:
    """The README's first Python example, saved as a script as a new user would (no
    ``if __name__ == "__main__":``): the stages must not re-import it."""
    code = README_BLOCK.search((ROOT / "README.md").read_text()).group(1)
    assert "pipeline_parallel_size=2" in code and "__main__" not in code
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(KEY_ENV, None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    print(f"README example at PP=2: {time.monotonic() - start:.1f} s; stdout {proc.stdout!r}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Paris" in proc.stdout
    assert "Traceback" not in proc.stderr


def _stage_spec() -> SpecWire:
    cfg = ModelConfig("LlamaForCausalLM", 100, 16, 32, 4, 2, 1, 8, 64)
    conf = EngineConfig(pipeline_parallel_size=1, dtype="float32", threads_per_stage=1)
    return SpecWire.of(PipelineSpec(conf, SyntheticSource(0.0), cfg, [(0, 4)], 8, 0, SleepRunner))


def _start_stage(port: int, rejoin: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), KEY_ENV: KEY.decode()}
    env.pop("PIPESERVE_PARENT_PID", None)
    return subprocess.Popen([sys.executable, "-m", "pipeserve", "worker", "--stage", "0", "--master-addr",
                             "127.0.0.1", "--master-port", str(port), "--rendezvous-timeout", "30",
                             "--stage-rejoin-timeout", str(rejoin)], env=env, stderr=subprocess.PIPE, text=True)


def _driver(port: int) -> TcpTransport:
    driver = TcpTransport(0, 2, KEY)
    driver.listen("127.0.0.1", port)
    return driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_remote_stage_rejoins_a_restarted_driver_then_gives_up() -> None:
    port, spec = _free_port(), _stage_spec()
    stage = _start_stage(port, rejoin=3.0)
    try:
        for generation in range(2):          # the second driver is a new process's listener on the same port
            driver = _driver(port)
            join_stages(driver, spec, [1], 30.0, 30.0, lambda: None)
            driver.send(1, Kind.PING)
            assert driver.recv(timeout=10).kind == Kind.PONG
            driver.close()                   # the driver is gone: the stage goes back to joining
        start = time.monotonic()
        _, err = stage.communicate(timeout=30)
        waited = time.monotonic() - start
    finally:
        if stage.poll() is None:
            stage.kill()
    assert stage.returncode == 4, err
    assert 3.0 <= waited < 3.0 + 10.0
    assert "joining again for up to 3 s" in err and "could not reach the driver" in err
