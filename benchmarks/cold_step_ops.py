"""What a decode step's small Python and PyTorch calls cost cold, as a stage runs them right after
its compute has streamed its weights through the caches: each call timed right after the same
call (warm) and after summing a buffer larger than the L3 (cold), in one process, alternating.

- RoPE's rows: ``RotaryEmbedding.forward`` (``index_select`` and ``unsqueeze`` of cos and sin, then
  ``contiguous`` and the pointers, what the fused decode stage took until the forty-fourth
  session) against ``RotaryEmbedding.table`` and the pointers of the table and the positions
  (what it takes now: the C code picks the rows);
- the token ids: an int64 tensor of them (what a first stage's runner built) against a ctypes
  array (what ``QuantKernels.lookup`` builds from the list it is given now);
- a tensor's bytes for the socket: the PyTorch calls and NumPy's view ``encode_frame`` made until
  the forty-fourth session, against a ctypes view of the memory (``messages._bytes_of``, now);
- the received bytes as a tensor: ``torch.frombuffer`` then ``reshape`` (until the forty-fourth
  session) or ``view`` (``Connection.read`` now);
- one frame's encoding (``messages.encode_frame``): a one-request ``Hop`` with its activations, and
  a decode step's ``StepEnvelope`` for 1 and 128 sequences (what a stage re-encoded per hop before
  the plans);
- the frames sent every token or step, encoded and their headers decoded, as JSON (until the
  forty-fifth session) and packed (``messages.register_compact``, now): a one-request ``Hop``,
  its TOKENS, and a 64-token RESULT.

    PYTHONPATH=$PWD python benchmarks/cold_step_ops.py [--calls 400] [--evict-mb 64]

Prints the median and p90 of each, µs.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import torch

from pipeserve.comm import messages
from pipeserve.comm.transport import Kind
from pipeserve.model.layers import RotaryEmbedding
from pipeserve.pipeline.spec import Hop, StepEnvelope
from pipeserve.sampling.inputs import SeqSampling
from pipeserve.worker.step import SampledToken, SeqStep, StepInput, StepOutput


def _decode_step(seqs: int, blocks: int) -> StepInput:
    greedy = SeqSampling(0.0, 1.0, -1, 0.0, None, 3)
    return StepInput(7, [SeqStep(i, [5], 300, list(range(i * blocks, (i + 1) * blocks)), greedy, 301)
                         for i in range(seqs)], forward_tokens=True, tokens_from=6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--evict-mb", type=int, default=64, help="buffer summed before each cold call")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rotary = RotaryEmbedding(64, 100000.0, None, torch.device("cpu"))
    positions = torch.tensor([300], dtype=torch.int64)
    ids = [1234]
    hidden = torch.randn(1, 576).to(torch.bfloat16)

    def rope_rows():
        cos, sin = (t.contiguous() for t in rotary.forward(positions, 301))
        return cos.data_ptr(), sin.data_ptr()

    def rope_table():
        cos, sin = (t.contiguous() for t in rotary.table(301))
        return cos.data_ptr(), sin.data_ptr(), positions.contiguous().data_ptr()

    def ids_tensor():
        x = torch.tensor(ids, dtype=torch.int64).contiguous()
        return x.data_ptr(), x.shape[0]

    def ids_array():
        array = (ctypes.c_int64 * len(ids))(*ids)
        return ctypes.addressof(array), len(ids)

    one, many = StepEnvelope(_decode_step(1, 20), 1), StepEnvelope(_decode_step(128, 25), 1)
    cases = {
        "RoPE rows: forward's lookups": rope_rows,
        "RoPE rows: the table's pointers": rope_table,
        "token ids: an int64 tensor": ids_tensor,
        "token ids: a ctypes array": ids_array,
        "a tensor's bytes: PyTorch and NumPy": lambda: memoryview(
            hidden.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()),
        "a tensor's bytes: a ctypes view": lambda: messages._bytes_of(hidden),
        "received bytes as a tensor: reshape": lambda: torch.frombuffer(bytearray(hidden.nbytes),
                                                                      dtype=torch.bfloat16).reshape([1, 576]),
        "received bytes as a tensor: view": lambda: torch.frombuffer(bytearray(hidden.nbytes),
                                                                   dtype=torch.bfloat16).view([1, 576]),
        "encode a Hop + [1, 576] bf16": lambda: messages.encode_frame(Kind.HOP, Hop(7, 1, []), hidden),
        "encode a 1-sequence step + tensor": lambda: messages.encode_frame(Kind.STEP, one, hidden),
        "encode a 128-sequence step": lambda: messages.encode_frame(Kind.STEP, many, None),
    }
    packed = dict(messages.COMPACT)
    frames = {"Hop": (Kind.HOP, Hop(7, 1, []), hidden), "TOKENS": (Kind.TOKENS, (7, [(3, 1234)]), None),
              "RESULT of 64": (Kind.RESULT, (StepOutput(7, [SampledToken(i, 1000 + i, -0.5 * i) for i in range(64)]),
                                             []), None)}
    compact: dict[str, bool] = {}           # per frame case, packed or JSON (the other cases run packed)
    for name, (kind, obj, tensor) in frames.items():
        for form in ("JSON", "packed"):
            messages.COMPACT.clear()
            messages.COMPACT.update(packed if form == "packed" else {})
            head, _ = messages.encode_frame(kind, obj, tensor)
            header, size = head[messages.PREFIX.size:], messages.parse_prefix(head[:messages.PREFIX.size])[1]
            cases[f"{name} encode, {form}"] = lambda k=kind, o=obj, t=tensor: messages.encode_frame(k, o, t)
            cases[f"{name} decode, {form}"] = lambda h=header, n=size: messages.decode_header(h, n)
            compact[f"{name} encode, {form}"] = compact[f"{name} decode, {form}"] = form == "packed"
    evict = torch.ones(args.evict_mb << 18)           # float32: 4 bytes an element
    times: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.calls):
        for cold in (False, True):
            for name, call in cases.items():
                messages.COMPACT.clear()
                messages.COMPACT.update(packed if compact.get(name, True) else {})
                if cold:
                    evict.add_(1.0)
                else:
                    call()                              # warm: the same call just before
                start = time.perf_counter_ns()
                call()
                times.setdefault((name, cold), []).append((time.perf_counter_ns() - start) / 1e3)
    print(f"µs a call, median / p90 of {args.calls} ({args.evict_mb} MB summed before each cold one)")
    print(f"  {'':36s} {'warm':>15s} {'cold':>15s}")
    for name in cases:
        row = []
        for cold in (False, True):
            values = sorted(times[(name, cold)][10:])
            row.append(f"{values[len(values) // 2]:7.1f} {values[int(0.9 * len(values))]:7.1f}")
        print(f"  {name:36s} {row[0]:>15s} {row[1]:>15s}")


if __name__ == "__main__":
    main()
