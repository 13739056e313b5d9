"""The five formulas of the performance model (docs/PLANNER.md defines every symbol)."""

from __future__ import annotations

from collections.abc import Callable, Iterable


def pipeline_efficiency(n: int, p: int, t_stage: float, t_comm: float) -> float:
    """η = N·t / (N·t + (P−1)·t + (P−1)·t_comm).

    N micro-batches each take t = t_stage per stage (the DESIGN's t_layer: the
    time of one stage's layers for one micro-batch); filling and draining the
    pipe costs (P−1) stage times plus (P−1) hops of t_comm.
    """
    busy = n * t_stage
    return busy / (busy + (p - 1) * t_stage + (p - 1) * t_comm)


def best_micro_batch(p: int, t_fwd: Callable[[int], float], t_comm: Callable[[int], float],
                     candidates: Iterable[int]) -> tuple[int, float]:
    """B_opt = argmin_B (P·t_fwd(B) + (P−1)·t_comm(B)) / B; returns (B_opt, seconds per sequence)."""
    best_b, best_cost = 0, float("inf")
    for b in candidates:
        cost = (p * t_fwd(b) + (p - 1) * t_comm(b)) / b
        if cost < best_cost * (1 - 1e-9):  # ties keep the smaller B (lower latency)
            best_b, best_cost = b, cost
    if best_b == 0:
        raise ValueError("best_micro_batch needs at least one candidate size")
    return best_b, best_cost


def throughput_gain(p: int, eta: float, alpha: float) -> float:
    """Speed-up over one device ≈ P·η / (1 + α·(P−1)); α = t_comm / (P·t_stage)."""
    return p * eta / (1 + alpha * (p - 1))


def kv_memory(layers: int, kv_heads: float, head_dim: int, batch: float, seq_len: float,
              dtype_bytes: float) -> float:
    """M_KV = 2·L·H_kv·D_head·B·S·bytes (the 2 is keys and values)."""
    return 2 * layers * kv_heads * head_dim * batch * seq_len * dtype_bytes


def request_latency(t_queue: float, t_prefill: float, t_decode: float, t_comm: float) -> float:
    """T = T_queue + T_prefill + T_decode + T_comm."""
    return t_queue + t_prefill + t_decode + t_comm


def decode_time(output_tokens: int, p: int, t_stage_max: float) -> float:
    """T_decode: each token after the first costs P slowest-stage forwards."""
    return max(0, output_tokens - 1) * p * t_stage_max


def md1_queue_wait(arrival_rate: float, service_time: float) -> float:
    """T_queue of an M/D/1 queue: ρ·s / (2(1−ρ)), ρ = λ·s; infinite once saturated."""
    rho = arrival_rate * service_time
    if rho >= 1:
        return float("inf")
    return rho * service_time / (2 * (1 - rho))


def tp_collectives(layers: int, first: bool, last: bool) -> int:
    """Collectives a chunk's TP ranks run per forward: 2 all-reduces per decoder layer
    (after o_proj and after down_proj), 1 after the vocabulary-split embedding (first
    chunk), 1 gather of the logits' vocabulary slices (last chunk)."""
    return 2 * layers + int(first) + int(last)


def tp_allreduce_time(nbytes: float, ranks: int, bandwidth: float, ring_latency: float,
                      call_latency: float = 0.0) -> float:
    """One all-reduce of ``nbytes`` over T ranks: 2(T−1)/T·nbytes/bandwidth plus its latency,
    (T−1)·call_latency where one is set (measured per collective at T = 2), else a ring's
    2(T−1)·ring_latency; 0 at T = 1."""
    if ranks <= 1:
        return 0.0
    latency = (ranks - 1) * call_latency if call_latency > 0 else 2 * (ranks - 1) * ring_latency
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + latency
