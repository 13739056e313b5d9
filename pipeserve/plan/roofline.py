"""Roofline costs of one decoder layer, the embedding and the LM head on one device.

time = max(FLOPs / FLOP/s, bytes / bandwidth): a kernel is bound by whichever of
compute or memory traffic takes longer. A decoder layer is two such parts run
one after the other by separate kernels, so its time is the SUM of two roofline
terms: the matmuls (weights' FLOPs vs weight + activation bytes) and attention
(4·pairs·q_size FLOPs vs the KV bytes it reads). Counts are per tensor-parallel rank.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pipeserve.model.config import ModelConfig
from pipeserve.model.tensor_parallel import SplitAlign, TensorShard, rank_shards

# FLOP/s is calibrated (with the runtime's own decoder layer) at a decode batch of
# DECODE_TOKENS tokens and a prefill of PREFILL_TOKENS tokens; between them it is
# interpolated in log(tokens).
DECODE_TOKENS = 16
PREFILL_TOKENS = 512


@dataclass(frozen=True)
class BatchShape:
    """What one forward pass computes, in the aggregates the roofline needs."""
    num_seqs: int          # sequences in the micro-batch
    new_tokens: int        # tokens computed now (prefill chunk tokens + one per decode)
    attn_pairs: float      # Σ over new tokens of the keys each attends to
    kv_tokens: float       # Σ over sequences of the cached tokens read from the KV cache
    logit_rows: int        # rows through the LM head (sequences that sample a token)

    @classmethod
    def decode(cls, batch: int, context: float) -> "BatchShape":
        """``batch`` sequences, one new token each, attending to ``context`` keys."""
        return cls(batch, batch, batch * context, batch * context, batch)

    @classmethod
    def prefill(cls, batch: int, prompt: int, cached: int = 0) -> "BatchShape":
        """``batch`` prompts of ``prompt`` new tokens after ``cached`` cached ones (causal)."""
        pairs = batch * (prompt * cached + prompt * (prompt + 1) / 2)
        return cls(batch, batch * prompt, pairs, batch * cached, batch)

    def __add__(self, other: "BatchShape") -> "BatchShape":
        return BatchShape(self.num_seqs + other.num_seqs, self.new_tokens + other.new_tokens,
                          self.attn_pairs + other.attn_pairs, self.kv_tokens + other.kv_tokens,
                          self.logit_rows + other.logit_rows)


EMPTY = BatchShape(0, 0, 0.0, 0.0, 0)


@dataclass(frozen=True)
class OpCost:
    flops: float
    bytes: float

    def time(self, flops_per_s: float, bytes_per_s: float) -> float:
        return max(self.flops / flops_per_s, self.bytes / bytes_per_s)


def tp_shards(model: ModelConfig, tp: int, block: int = 1) -> list[TensorShard]:
    """Every tensor-parallel rank's slice as the runtime cuts it (model/tensor_parallel.py:
    heads follow KV groups and may split unevenly, e.g. SmolLM2's 6 + 3 at T = 2; the MLP
    rows rebalance each rank's weights; the vocabulary is padded to T equal slices), with
    o_proj's and down_proj's inputs cut on quantization blocks of ``block`` weights where
    the weights are quantized. MoE: the runtime does not split experts; the heads are cut
    as for a dense model and the experts assumed split evenly. Raises ValueError for a T
    the runtime refuses (no head for some rank, no block-aligned cut)."""
    dense = dataclasses.replace(model, num_experts=0) if model.num_experts else model
    align = None
    if block > 1:
        def fit(inputs: int) -> int:
            # llama-quantize stores a row that is not a multiple of 256 in a 32-weight type;
            # int8/int4 fall back to 32 the same way at load
            return block if inputs % block == 0 else 32 if inputs % 32 == 0 else 1
        align = SplitAlign(fit(model.num_heads * model.head_dim), fit(model.intermediate_size),
                           f"o_proj (blocks of {block})", f"down_proj (blocks of {block})")
    return rank_shards(dense, tp, align)


class LayerCosts:
    """FLOPs and bytes of the model's pieces for a batch shape, on the busiest of ``tp``
    ranks (the slowest rank paces every all-reduce; the fullest one sets the memory)."""

    def __init__(self, model: ModelConfig, dtype_bytes: int, tp: int = 1,
                 kv_read_amplification: float = 1.0, weight_bytes: float | None = None,
                 head_weight_bytes: float | None = None, split_block: int = 1) -> None:
        """``weight_bytes`` / ``head_weight_bytes``: bytes per stored weight of the layers
        and embedding / of the LM head when they are quantized (default: ``dtype_bytes``);
        activations and the KV cache stay at ``dtype_bytes``. ``split_block``: the
        quantization block a TP cut of a row-parallel input must fall on (1: dense)."""
        self.model = model
        self.bytes = dtype_bytes
        self.weight_bytes = dtype_bytes if weight_bytes is None else weight_bytes
        self.head_weight_bytes = self.weight_bytes if head_weight_bytes is None else head_weight_bytes
        self.tp = tp
        self.kv_read_amplification = kv_read_amplification
        h = model.hidden_size
        self.attn_params = h * model.q_size * 2 + 2 * h * model.kv_size
        # MoE: each layer with experts has a router, E routed experts of which a token
        # runs k, and optionally a shared expert every token runs; a model may mix such
        # layers with dense ones (decoder_sparse_step, mlp_only_layers). Costs are per
        # AVERAGE layer: the fraction of layers with experts weights each kind.
        self.expert_params = 3 * h * model.expert_intermediate_size
        shared = model.shared_expert_intermediate_size
        self.moe_always_params = h * model.num_experts + (3 * h * shared + h if shared else 0)
        self.dense_mlp_params = 3 * h * model.intermediate_size
        layers = range(model.num_layers)
        self.moe_fraction = sum(map(model.is_moe_layer, layers)) / model.num_layers if model.num_experts else 0.0
        # The runtime's split: KV heads over the ranks (replicated once there are more ranks
        # than heads), unevenly where they do not divide; each quantity at its busiest rank.
        self.q_heads_per_rank: float = model.num_heads
        self.kv_heads_per_rank: float = model.num_kv_heads
        self.vocab_fraction = 1.0     # vocabulary rows per rank / vocabulary (padded: ceil(V / T))
        self.layer_fraction = 1.0     # the busiest rank's share of a layer's matmul weights
        self.paced_fraction = 1.0     # Σ over the two all-reduce segments of the busiest rank's share
        if tp > 1:
            shards = tp_shards(model, tp, split_block)
            self.q_heads_per_rank = max(s.num_q_heads for s in shards)
            self.kv_heads_per_rank = max(s.num_kv_heads for s in shards)
            self.vocab_fraction = shards[0].vocab_rows / model.vocab_size
            if model.num_experts:
                self.layer_fraction = self.paced_fraction = 1.0 / tp
            else:
                d, total = model.head_dim, self.attn_params + self.dense_mlp_params
                attn = [h * d * 2 * (s.num_q_heads + s.num_kv_heads) for s in shards]
                mlp = [3 * h * (s.intermediate[1] - s.intermediate[0]) for s in shards]
                self.layer_fraction = max(a + m for a, m in zip(attn, mlp)) / total
                # Each all-reduce is a barrier: the attention half (QKV, attention, o_proj)
                # ends at one, the MLP at the next, so a layer takes the slowest rank of each
                # half, not the slowest rank's whole layer. The runtime balances whole-layer
                # weights (more MLP rows to the rank with fewer heads), so the halves are
                # paced by different ranks (SmolLM2 at T = 2: 0.59 of the weights, not 0.51).
                self.paced_fraction = (max(attn) + max(mlp)) / total

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts whose weights a batch reads (1 for a dense MLP)."""
        m = self.model
        if not m.num_experts:
            return 1.0 if tokens else 0.0
        miss = (1.0 - m.num_experts_per_tok / m.num_experts) ** tokens
        return m.num_experts * (1.0 - miss)

    def kv_bytes_per_token_layer(self) -> float:
        return 2 * self.kv_heads_per_rank * self.model.head_dim * self.bytes

    def mlp_params(self, tokens: int) -> tuple[float, float]:
        """(parameters one token multiplies by, parameters a batch of ``tokens`` reads) of the
        average layer's MLP: MoE compute counts the ACTIVE experts (k per token), its weight
        traffic the experts touched; dense layers count their one MLP for both."""
        m, f = self.model, self.moe_fraction
        active = self.moe_always_params + self.expert_params * m.num_experts_per_tok
        read = self.moe_always_params + self.expert_params * self.experts_touched(tokens)
        return (f * active + (1 - f) * self.dense_mlp_params,
                f * read + (1 - f) * self.dense_mlp_params * (1.0 if tokens else 0.0))

    def mlp_width(self) -> float:
        """Intermediate activations per token of the average layer's MLP (k experts + shared, or dense)."""
        m, f = self.model, self.moe_fraction
        moe = m.num_experts_per_tok * m.expert_intermediate_size + m.shared_expert_intermediate_size
        return f * moe + (1 - f) * m.intermediate_size

    def matmuls(self, shape: BatchShape) -> OpCost:
        """A decoder layer's QKV/O and MLP matmuls: the active weights' FLOPs against
        reading the weights (MoE: the experts touched) and the activations."""
        m, t = self.model, shape.new_tokens
        mlp_active, mlp_read = self.mlp_params(t)
        active = self.attn_params + mlp_active
        weights = self.attn_params + mlp_read
        act = t * (6 * m.hidden_size + 2 * m.q_size + 2 * m.kv_size + 4 * self.mlp_width())
        f = self.paced_fraction
        return OpCost(2 * active * t * f, weights * self.weight_bytes * f + act * self.bytes / self.tp)

    def attention(self, shape: BatchShape) -> OpCost:
        """A decoder layer's attention: 4·pairs·q_size FLOPs (QK^T and PV) against the KV
        bytes read (cached + new tokens) times ``kv_read_amplification``, the measured
        cost per attended KV byte of the attention kernel relative to a plain read."""
        t = shape.new_tokens
        kv = (shape.kv_tokens + t) * self.kv_bytes_per_token_layer() * self.kv_read_amplification  # per rank
        return OpCost(4 * shape.attn_pairs * self.q_heads_per_rank * self.model.head_dim, kv)

    def layer(self, shape: BatchShape) -> OpCost:
        """All FLOPs and bytes of one decoder layer (matmuls + attention). Counts only:
        its time is ``matmuls(shape).time(...) + attention(shape).time(...)``, not the
        roofline of these totals (the two parts are separate kernels that do not overlap)."""
        mm, attn = self.matmuls(shape), self.attention(shape)
        return OpCost(mm.flops + attn.flops, mm.bytes + attn.bytes)

    def layer_time(self, shape: BatchShape, flops_per_s: float, bytes_per_s: float) -> float:
        """Seconds of one decoder layer's kernels (no dispatch overhead, no all-reduce):
        the matmul roofline term plus the attention roofline term."""
        return (self.matmuls(shape).time(flops_per_s, bytes_per_s)
                + self.attention(shape).time(flops_per_s, bytes_per_s))

    def embedding(self, shape: BatchShape) -> OpCost:
        """Gather one row per token: memory traffic only."""
        return OpCost(0.0, 2 * shape.new_tokens * self.model.hidden_size * self.bytes)

    def head(self, shape: BatchShape) -> OpCost:
        """Final norm + LM head (vocab-parallel under TP) for the rows that sample; fp32 logits."""
        m, rows = self.model, shape.logit_rows
        flops = 2 * rows * m.hidden_size * m.vocab_size
        traffic = m.vocab_size * m.hidden_size * self.head_weight_bytes + rows * m.vocab_size * 4
        return OpCost(flops * self.vocab_fraction, traffic * self.vocab_fraction + rows * m.hidden_size * self.bytes)

    def hidden_bytes(self, shape: BatchShape) -> float:
        """Activation sent from one stage to the next: [new_tokens, hidden]."""
        return shape.new_tokens * self.model.hidden_size * self.bytes

    def allreduce_bytes(self, shape: BatchShape) -> float:
        """Each TP all-reduce (two per layer) sums a [new_tokens, hidden] tensor."""
        return shape.new_tokens * self.model.hidden_size * self.bytes


def flops_rate(decode_rate: float, prefill_rate: float, tokens: int) -> float:
    """Effective FLOP/s for a matmul of ``tokens`` rows, log-interpolated between calibrations."""
    if tokens <= DECODE_TOKENS:
        return decode_rate
    if tokens >= PREFILL_TOKENS:
        return prefill_rate
    frac = math.log(tokens / DECODE_TOKENS) / math.log(PREFILL_TOKENS / DECODE_TOKENS)
    return decode_rate + frac * (prefill_rate - decode_rate)


def ring_allreduce_time(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce: 2(T-1)/T of the data over each link, 2(T-1) latency steps."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * latency
