"""Tensor parallelism inside one pipeline stage: which slice of each layer a rank holds,
and the collectives that put the slices back together.

Megatron's split, as vLLM does it: q/k/v and gate/up are column-parallel (a
rank computes its heads' / its intermediate slice's outputs), o_proj and
down_proj are row-parallel (a rank multiplies its slice of the input and one
all-reduce sums the partial outputs). The embedding and the LM head are split
by vocabulary rows: a rank looks up only its ids (others are zero) and an
all-reduce completes the row; the head's slices of logits are gathered on TP
rank 0, the only rank that samples.

Heads. A rank's q heads must share its KV heads with the same grouping as the
model (q head h reads kv head h // group), so the split follows KV heads:

* ``kv >= T``: the KV heads are split as evenly as possible over the ranks
  (contiguous), each taking the q heads of its KV heads. The split may be
  uneven (SmolLM2: 3 KV heads of 3 q heads each at T = 2 -> ranks hold 6 and
  3 q heads): an all-reduce does not need equal shares, only a rank's own
  heads' columns of o_proj.
* ``kv < T``: each rank holds one KV head (replicated over the ranks that
  share it; vLLM does the same) and a contiguous, as-even-as-possible part of
  that head's q heads. Refused when a KV head would get more ranks than it has
  q heads (a rank with no head).

The intermediate size is split so each rank holds about the same layer weights
(a rank with more heads gets fewer MLP rows: the slowest rank paces every
all-reduce), the vocabulary as evenly as possible; no size needs to divide by T. The vocabulary is padded to
``T * ceil(V / T)`` rows so the gathered logits are equal slices (the padding
rows are zero and cut off after the gather).

Kept-quantized weights (``SplitAlign``): the row-parallel inputs are cut only on
quantization block boundaries, the nearest ones to the dense split.

torch is imported only where tensors are touched: the planner (torch-free) prices
the runtime's own split through ``rank_shards``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # torch only where tensors are touched: the planner imports the split (torch-free)
    import torch

Ranges = tuple[tuple[int, int], ...]   # [start, stop) row (or column) ranges of a full tensor


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part ``index`` when ``total`` items are split over ``parts``
    contiguous parts whose sizes differ by at most one (the first ones larger)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class SplitAlign:
    """Where the row-parallel layers' inputs may be cut when their weights stay quantized:
    a quantization block (32 weights for Q4_0..Q8_0, 256 for K-quants, the group for
    int8/int4) cannot straddle two ranks. ``attention``: o_proj's input (q heads x
    head_dim) is cut at multiples of it; ``mlp``: down_proj's (the intermediate rows).
    The names say which tensor sets each (for the error when no split exists)."""

    attention: int = 1
    mlp: int = 1
    attention_tensor: str = "o_proj"
    mlp_tensor: str = "down_proj"


@dataclass(frozen=True)
class TensorShard:
    """What TP rank ``rank`` of ``size`` holds of one model (all [start, stop) ranges)."""

    rank: int
    size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]        # rows of the padded vocabulary (stop may pass the real vocabulary)

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def vocab_rows(self) -> int:
        return self.vocab[1] - self.vocab[0]


def check_tensor_parallel(cfg, size: int) -> None:
    """Refuse what tensor parallelism of ``size`` cannot split, with the reason (the driver
    calls this before it starts any process)."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {size}")
    if size == 1:
        return
    if cfg.num_experts:
        raise ValueError(f"--tensor-parallel-size {size}: mixture-of-experts models ({cfg.architecture}) are "
                         "not split across ranks yet; use --tensor-parallel-size 1 (pipeline parallelism "
                         "splits them by layers)")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"{cfg.num_heads} attention heads do not group evenly over {cfg.num_kv_heads} KV heads")
    group = cfg.num_heads // cfg.num_kv_heads
    if cfg.num_kv_heads < size:
        ranks_per_kv = -(-size // cfg.num_kv_heads)
        if group < ranks_per_kv:
            raise ValueError(
                f"--tensor-parallel-size {size} is too large for this model: its {cfg.num_kv_heads} KV head(s) "
                f"have {group} query head(s) each, so some rank would hold no attention head; use at most "
                f"{cfg.num_heads} ranks")
    if cfg.intermediate_size < size or cfg.vocab_size < size:
        raise ValueError(f"--tensor-parallel-size {size} exceeds the model's intermediate size or vocabulary")


def check_tensor_parallel_config(config, cfg, align: SplitAlign | None = None) -> None:
    """The engine's check of ``--tensor-parallel-size`` against the model and the other flags;
    ``align``: the kept-quantized weights' block boundaries (``loader.split_alignment``),
    which every rank's split must respect."""
    check_tensor_parallel(cfg, config.tensor_parallel_size)
    for rank in range(config.tensor_parallel_size):
        plan_shard(cfg, rank, config.tensor_parallel_size, align)
    if config.device.startswith("cuda:"):
        raise ValueError(f"--tensor-parallel-size > 1 places each rank on its own GPU (stage s's rank r on "
                         f"cuda:{{s * T + r}} of its node); use --device cuda, not --device {config.device}")


def plan_shard(cfg, rank: int, size: int, align: SplitAlign | None = None) -> TensorShard:
    """The slice of ``cfg``'s model that TP rank ``rank`` of ``size`` holds; with ``align``
    the cuts of o_proj's and down_proj's inputs fall on quantization block boundaries
    (the nearest ones to the dense split; uneven is fine)."""
    check_tensor_parallel(cfg, size)
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} outside [0, {size})")
    heads = [_heads_of(cfg, r, size) for r in range(size)]
    if align is not None and align.attention > 1:
        heads = _align_heads(cfg, heads, align)
    q, kv = heads[rank]
    rows = -(-cfg.vocab_size // size)
    return TensorShard(rank, size, q, kv, _intermediate_split(cfg, heads, align)[rank],
                       (rank * rows, (rank + 1) * rows))


def rank_shards(cfg, size: int, align: SplitAlign | None = None) -> list[TensorShard]:
    """Every rank's shard (the planner's per-rank costs; the busiest rank paces the stage)."""
    return [plan_shard(cfg, r, size, align) for r in range(size)]


def _align_heads(cfg, heads: list, align: SplitAlign) -> list:
    """Move each cut between two ranks' q heads to the nearest one at a multiple of
    ``align.attention`` o_proj columns that keeps query groups with their KV head: with at
    least T KV heads only whole KV groups move; with fewer, a cut between ranks sharing a
    KV head moves inside that head's group, and a cut between two KV heads cannot move."""
    size, d = len(heads), cfg.head_dim
    group = cfg.num_heads // cfg.num_kv_heads
    step = align.attention // _gcd(align.attention, d)   # q heads per block-aligned cut
    bounds = [q0 for (q0, _), _ in heads] + [cfg.num_heads]
    for i in range(1, size):
        want, prev = bounds[i], bounds[i - 1]
        if cfg.num_kv_heads >= size:
            lo, hi, unit = prev + 1, cfg.num_heads - (size - i) * group, group   # whole KV groups
        elif heads[i - 1][1] == heads[i][1]:                               # both ranks share one KV head
            kv0 = heads[i][1][0]
            lo, hi, unit = max(prev + 1, kv0 * group + 1), (kv0 + 1) * group - 1, 1
        else:
            lo = hi = want                                                 # fixed: the KV head's first q head
            unit = 1
        ok = [b for b in range(max(lo, 1), hi + 1) if b % unit == 0 and b % step == 0]
        if not ok:
            raise ValueError(
                f"--tensor-parallel-size {size}: {align.attention_tensor} is quantized in blocks of "
                f"{align.attention} weights along its input ({cfg.num_heads} heads x {d} dims), and no cut "
                f"between tensor-parallel ranks {i - 1} and {i} falls on a block boundary while keeping "
                f"query heads with their KV head ({cfg.num_kv_heads} KV heads); use --quantization none "
                "or a smaller --tensor-parallel-size")
        bounds[i] = min(ok, key=lambda b: (abs(b - want), b))
    out = []
    for r in range(size):
        q0, q1 = bounds[r], bounds[r + 1]
        kv = (q0 // group, -(-q1 // group)) if cfg.num_kv_heads >= size else heads[r][1]
        out.append(((q0, q1), kv))
    return out


def _gcd(a: int, b: int) -> int:
    import math
    return math.gcd(a, b)


def _heads_of(cfg, rank: int, size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(q heads, kv heads) of ``rank``: whole KV groups, or one replicated KV head (module doc)."""
    group = cfg.num_heads // cfg.num_kv_heads
    if cfg.num_kv_heads >= size:
        kv = split_evenly(cfg.num_kv_heads, size, rank)
        return (kv[0] * group, kv[1] * group), kv
    head = rank * cfg.num_kv_heads // size                      # the KV head this rank replicates
    sharing = [r for r in range(size) if r * cfg.num_kv_heads // size == head]
    lo, hi = split_evenly(group, len(sharing), sharing.index(rank))
    return (head * group + lo, head * group + hi), (head, head + 1)


def _intermediate_split(cfg, heads: list, quant: SplitAlign | None = None) -> list[tuple[int, int]]:
    """The MLP's intermediate rows per rank, balancing each rank's layer weights: a rank with
    more attention heads (an uneven head split, e.g. SmolLM2's 6 + 3) gets fewer MLP rows,
    since the slowest rank sets every all-reduce's pace. Weights per rank: attention
    h·D·(2 q + 2 kv) + MLP 3·h·rows. Boundaries are multiples of 32 where the size allows,
    and multiples of ``quant.mlp`` (down_proj's quantization block) where it is set."""
    size, inter, d = len(heads), cfg.intermediate_size, cfg.head_dim
    attn = [2 * d * ((q1 - q0) + (k1 - k0)) for (q0, q1), (k0, k1) in heads]   # per unit of hidden
    target = (sum(attn) + 3 * inter) / size
    align = 32 if inter % 32 == 0 and inter >= 32 * 8 * size else 1   # coarse only where it is small
    if quant is not None and quant.mlp > 1:
        align = quant.mlp
        if inter % align or inter < align * size:
            raise ValueError(
                f"--tensor-parallel-size {size}: {quant.mlp_tensor} is quantized in blocks of {align} weights "
                f"along its input ({inter} intermediate rows), so {size} ranks cannot each get whole blocks; "
                "use --quantization none or a smaller --tensor-parallel-size")
    bounds, start = [], 0
    for r in range(size - 1):
        want = max(align, round(max(0.0, target - attn[r]) / 3 / align) * align)
        stop = min(start + want, inter - (size - 1 - r) * align)   # leave a block per later rank
        bounds.append((start, max(stop, start + 1)))
        start = bounds[-1][1]
    bounds.append((start, inter))
    return bounds


def local_config(cfg, shard: TensorShard):
    """``cfg`` with this rank's head counts and intermediate size: the layers built from
    it have exactly the rank's slices (head_dim, hidden size and vocabulary unchanged)."""
    return dataclasses.replace(cfg, num_heads=shard.num_q_heads, num_kv_heads=shard.num_kv_heads,
                               intermediate_size=shard.intermediate[1] - shard.intermediate[0])


def parameter_slices(cfg, shard: TensorShard, name: str) -> tuple[int, Ranges] | None:
    """How our parameter ``name`` is cut from the full (concatenated) checkpoint tensor:
    (dim, ranges to keep, concatenated), or None when every rank holds all of it."""
    d = cfg.head_dim
    q_size, kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
    (q0, q1), (k0, k1) = shard.q_heads, shard.kv_heads
    i0, i1 = shard.intermediate
    inter = cfg.intermediate_size
    if name.endswith("self_attn.qkv_proj.weight") or name.endswith("self_attn.qkv_proj.bias"):
        return 0, ((q0 * d, q1 * d), (q_size + k0 * d, q_size + k1 * d),
                   (q_size + kv_size + k0 * d, q_size + kv_size + k1 * d))
    if name.endswith("self_attn.o_proj.weight"):
        return 1, ((q0 * d, q1 * d),)
    if name.endswith("mlp.gate_up_proj.weight"):
        return 0, ((i0, i1), (inter + i0, inter + i1))
    if name.endswith("mlp.down_proj.weight"):
        return 1, ((i0, i1),)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return 0, (shard.vocab,)
    return None


def take_slices(tensor: torch.Tensor, dim: int, ranges: Ranges) -> torch.Tensor:
    """The ranges of ``tensor`` along ``dim``, concatenated; rows past the end (vocabulary
    padding) are zeros."""
    import torch
    parts = []
    for start, stop in ranges:
        have = max(0, min(stop, tensor.shape[dim]) - start)
        if have:
            parts.append(tensor.narrow(dim, start, have))
        if stop - start > have:
            shape = list(tensor.shape)
            shape[dim] = stop - start - have
            parts.append(tensor.new_zeros(shape))
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0].contiguous()


class TensorParallelGroup:
    """One stage's TP ranks: the collectives the sharded layers call.

    Backed by a torch.distributed process group: gloo on CPU; on CUDA one with both
    backends (``cpu:gloo,cuda:nccl``), so the activations' all-reduces, gathers and
    broadcasts (CUDA tensors) go through NCCL and the step's control messages (CPU
    tensors) through gloo. ``device`` is where this rank computes; ``reduce_seconds``
    accumulates the time spent in all-reduces (for the benchmark's share; on CUDA only
    their launch: NCCL runs them on its stream without blocking the host)."""

    def __init__(self, shard: TensorShard, group=None, device: torch.device | None = None) -> None:
        import torch
        self.shard = shard
        self.rank, self.size = shard.rank, shard.size
        self.group = group
        self.device = device or torch.device("cpu")
        self.shm: SharedMemoryAllReduce | None = None   # set where the ranks share a host
        self.reduce_seconds = 0.0
        self.reduce_calls = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import time

        import torch.distributed as dist
        start = time.perf_counter()
        if self.shm is not None and self.shm.applies(x):
            self.shm.all_reduce(x)
        else:
            dist.all_reduce(x, group=self.group)
        self.reduce_seconds += time.perf_counter() - start
        self.reduce_calls += 1
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` (equal shapes) along the last dim on rank 0; None elsewhere."""
        import torch
        import torch.distributed as dist
        x = x.contiguous()
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.gather(x, parts, dst=self._global(0), group=self.group)
            return torch.cat(parts, dim=-1)
        dist.gather(x, None, dst=self._global(0), group=self.group)
        return None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        dist.broadcast(x, src=self._global(0), group=self.group)
        return x

    def _global(self, rank: int) -> int:
        if self.group is None:
            return rank
        import torch.distributed as dist
        return dist.get_global_rank(self.group, rank)


SPINS = 50   # busy checks of a flag before sleeping on it (futex)


class _Futex:
    """FUTEX_WAIT / FUTEX_WAKE on a 32-bit word of a shared mapping (Linux), so a waiting
    rank sleeps until the rank it waits for publishes, as a blocking socket read would;
    elsewhere, short sleeps between checks."""

    _NUMBERS = {"x86_64": 202, "aarch64": 98}

    def __init__(self) -> None:
        import ctypes
        import platform
        self.nr = self._NUMBERS.get(platform.machine())
        self.libc = ctypes.CDLL(None, use_errno=True) if self.nr is not None else None
        self.timeout = None
        if self.libc is not None:
            class Timespec(ctypes.Structure):
                _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]
            self.timeout = ctypes.byref(Timespec(0, 200_000_000))   # re-check the deadline 5x a second

    def wait(self, addr: int, seen: int) -> None:
        """Sleep while the word at ``addr`` still holds ``seen`` (returns at once otherwise)."""
        if self.libc is None:
            import time
            time.sleep(20e-6)
            return
        import ctypes
        word = seen & 0xFFFFFFFF   # the kernel compares the 32-bit word
        self.libc.syscall(ctypes.c_long(self.nr), ctypes.c_void_p(addr), ctypes.c_long(0),   # FUTEX_WAIT
                          ctypes.c_long(word), self.timeout, None, ctypes.c_long(0))

    def wake(self, addr: int) -> None:
        if self.libc is not None:
            import ctypes
            self.libc.syscall(ctypes.c_long(self.nr), ctypes.c_void_p(addr), ctypes.c_long(1),   # FUTEX_WAKE
                              ctypes.c_long(0x7FFFFFFF), None, None, ctypes.c_long(0))


class SharedMemoryAllReduce:
    """All-reduce between the ranks of one host through a shared file mapping (``/dev/shm``).

    Layout: T int64 flags, then two banks of T slots of ``slot_elems`` float32s.
    All-reduce number g: each rank copies its tensor into its slot of bank g % 2,
    publishes flag = g, waits until every flag reaches g, then sums the T slots in
    rank order, so every rank computes the bitwise same result. Two banks make one
    wait per call enough: a rank can only reach call g + 1 (and overwrite bank
    (g + 1) % 2) once every rank has published g, i.e. finished reading g - 1.
    The wait spins briefly, then sleeps on the flag's futex (woken by the publishing
    rank, as a blocking socket read is); it gives up after ``timeout_s``
    (a dead rank also ends its stage through the leader's watch). A tensor larger
    than a slot, or of another dtype than the slots', goes through gloo instead.
    """

    def __init__(self, path: str, rank: int, size: int, slot_elems: int, dtype: torch.dtype,
                 create: bool, timeout_s: float = 60.0) -> None:
        import numpy as np
        import torch
        self.rank, self.size, self.slot_elems, self.dtype = rank, size, slot_elems, dtype
        self.timeout_s = timeout_s
        itemsize = torch.empty((), dtype=dtype).element_size()
        flag_bytes = 64 * size                               # one cache line per flag
        nbytes = flag_bytes + 2 * size * slot_elems * itemsize
        if create:
            with open(path, "wb") as f:
                f.truncate(nbytes)
        raw = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self._raw = raw
        self.flags = np.frombuffer(raw[:flag_bytes].numpy(), dtype=np.int64)   # flag of rank r at [8 r]
        self.slots = raw[flag_bytes:].view(dtype).view(2, size, slot_elems)
        self.calls = 0
        self.futex = _Futex()

    def _addr(self, rank: int) -> int:
        return self._raw.data_ptr() + 64 * rank   # the flag's low 32 bits (little-endian)

    def applies(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.slot_elems and x.device.type == "cpu"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import time

        import torch
        self.calls += 1
        gen, n = self.calls, x.numel()
        bank = self.slots[gen % 2]
        flat = x.view(-1)
        bank[self.rank, :n].copy_(flat)
        self.flags[8 * self.rank] = gen
        self.futex.wake(self._addr(self.rank))
        deadline = None
        for r in range(self.size):
            spins = 0
            while (seen := int(self.flags[8 * r])) < gen:
                spins += 1
                if spins <= SPINS:
                    continue
                self.futex.wait(self._addr(r), seen)   # a spinning rank takes the CPU a late one needs
                deadline = deadline or time.monotonic() + self.timeout_s
                if time.monotonic() > deadline:
                    raise RuntimeError(f"shared-memory all-reduce: tensor-parallel rank {r} did not arrive "
                                       f"within {self.timeout_s:g} s")
        torch.add(bank[0, :n], bank[1, :n], out=flat)
        for r in range(2, self.size):
            flat.add_(bank[r, :n])
        return x
