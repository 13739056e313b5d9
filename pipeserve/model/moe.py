"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) and the dense-or-MoE choice per layer.

A step's tokens are routed to their top-k experts, then grouped by expert:
each expert that received tokens runs ONCE, one gate_up and one down matmul
over all its tokens, and the weighted outputs are scatter-added back to their
tokens. Experts' weights are stacked per layer ([E, 2·inter, hidden] and
[E, hidden, inter]); the loader builds them from the checkpoint's per-expert
tensors, so a layer's experts live on the stage that owns the layer. A GGUF's
experts in a kept block type are not stacked: each expert's gate_up and down is
its own quantized linear module (``keep_quantized``), the file's bytes re-laid out.

Routing follows the Hugging Face reference exactly: softmax over all experts
in float32, then top-k, then (Mixtral always; Qwen when ``norm_topk_prob``)
renormalisation of the k probabilities to sum 1. Mixtral keeps the weights in
float32 for the weighted sum, Qwen casts them to the activation dtype first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeserve.model.config import ModelConfig
from pipeserve.model.layers import Linear, SwiGLU

# Per architecture: (the HF module holding the MoE block, the expert's gate/up/down
# tensor names, whether the routing weights stay float32 in the weighted sum).
_LAYOUT = {
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2"), True),
    "Qwen2MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj"), False),
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj"), False),
}


# Routing switches other MoE families use, with the value that means "as implemented here":
# a config of a supported architecture setting any other value is refused, not ignored.
_UNSUPPORTED_SWITCHES = {"scoring_func": "softmax", "routed_scaling_factor": 1.0, "n_group": 1,
                         "topk_group": 1, "topk_method": "greedy", "n_shared_experts": 0,
                         "moe_router_bias": False, "router_bias": False, "first_k_dense_replace": 0}


def refuse_moe_switches(raw: dict, path: object) -> None:
    """Refuse a Hugging Face config whose MoE settings the runtime would not honour, naming the key."""
    arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
    experts = raw.get("num_local_experts") or raw.get("num_experts") or 0
    if arch not in _LAYOUT:
        if experts:
            raise ValueError(f"{path}: {arch} has no experts, yet the config sets num_local_experts/"
                             f"num_experts={experts}; pipeserve runs experts for {', '.join(_LAYOUT)}")
        return
    for key, neutral in _UNSUPPORTED_SWITCHES.items():
        if raw.get(key, neutral) not in (neutral, None):
            raise ValueError(f"{path}: MoE switch {key}={raw[key]!r} is not supported (pipeserve routes "
                             f"with softmax, top-k, no scaling or grouping; {key} must be {neutral!r} or absent)")
    top_k = raw.get("num_experts_per_tok") or 0
    if not 1 <= top_k <= experts:
        raise ValueError(f"{path}: num_experts_per_tok={top_k} must be between 1 and the {experts} experts")


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          float_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, E] -> (weights [n, k], expert ids [n, k]): softmax, top-k, optional renormalisation."""
    probs = torch.softmax(logits.float(), dim=-1)                  # [n, E] float32
    weights, experts = torch.topk(probs, top_k, dim=-1)            # [n, k] each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if float_weights else weights.to(logits.dtype)), experts


class SparseMoeBlock(nn.Module):
    """Router + stacked routed experts (+ Qwen2-MoE's sigmoid-gated shared expert)."""

    ops = None   # fused CPU kernels (silu·mul), as SwiGLU.ops; set by the model

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, inter, e = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
        self.num_experts, self.top_k, self.hidden, self.inter = e, cfg.num_experts_per_tok, h, inter
        self.renormalize = cfg.norm_topk_prob
        self.float_weights = _LAYOUT[cfg.architecture][2]
        self.gate = Linear(h, e, False, dtype, device)                 # router: [E, hidden]
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, h, dtype=dtype, device=device),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, inter, dtype=dtype, device=device),
                                      requires_grad=False)
        # per-expert quantized modules replacing a stack (keep_quantized), else None
        self.gate_up_experts: nn.ModuleList | None = None
        self.down_experts: nn.ModuleList | None = None
        shared = cfg.shared_expert_intermediate_size
        self.shared_expert = SwiGLU(h, shared, dtype, device) if shared else None
        self.shared_expert_gate = Linear(h, 1, False, dtype, device) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] -> [n, hidden]."""
        weights, experts = route(self.gate(x), self.top_k, self.renormalize, self.float_weights)
        out = self.routed(x, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def routed(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Σ_k weights[:, k] · expert_{experts[:, k]}(x), each active expert run once."""
        k = experts.shape[1]
        flat = experts.reshape(-1)                                     # [n·k] expert of each slot
        order = torch.argsort(flat, stable=True)                       # slots grouped by expert
        token_of = order // k                                          # [n·k] token of each sorted slot
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x[token_of]                                             # [n·k, hidden]
        outs = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                outs[start:start + count] = self.expert(expert, rows[start:start + count])
                start += count
        weighted = (outs * weights.reshape(-1)[order].unsqueeze(1)).to(x.dtype)   # [n·k, hidden]
        return torch.zeros_like(x).index_add_(0, token_of, weighted)

    def expert(self, expert: int, rows: torch.Tensor) -> torch.Tensor:
        """One expert's SwiGLU over the rows routed to it: [m, hidden] -> [m, hidden]."""
        if self.gate_up_experts is not None:
            gate_up = self.gate_up_experts[expert](rows)                       # [m, 2 * inter]
        else:
            gate_up = F.linear(rows, self.gate_up_proj[expert])
        if self.ops is not None and self.ops.applies(gate_up):
            act = self.ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.split(self.inter, dim=-1)
            act = F.silu(gate) * up                                            # [m, inter]
        if self.down_experts is not None:
            return self.down_experts[expert](act)
        return F.linear(act, self.down_proj[expert])

    def keep_quantized(self, gate_up: list[nn.Module] | None, down: list[nn.Module] | None) -> None:
        """Run each expert's gate_up ([2·inter, hidden]) and/or down ([hidden, inter]) through
        its own module, one per expert in expert order, and drop the stack it replaces."""
        for name, modules, shape in (("gate_up", gate_up, (2 * self.inter, self.hidden)),
                                     ("down", down, (self.hidden, self.inter))):
            if modules is None:
                continue
            got = {(m.out_features, m.in_features) for m in modules}
            if len(modules) != self.num_experts or got != {shape}:
                raise ValueError(f"{len(modules)} experts' {name} weights of shapes {sorted(got)}; the config "
                                 f"implies {self.num_experts} of {shape}")
            delattr(self, f"{name}_proj")
            setattr(self, f"{name}_experts", nn.ModuleList(modules))


def build_mlp(cfg: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Decoder layer ``layer``'s MLP: a SparseMoeBlock where the config puts experts, else SwiGLU."""
    if cfg.is_moe_layer(layer):
        return SparseMoeBlock(cfg, dtype, device)
    return SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype, device)


def mlp_checkpoint_names(cfg: ModelConfig, ours: str, hf: str, layer: int) -> dict[str, list[str]]:
    """Our MLP parameter names (prefix ``ours``, e.g. "layers.0.") -> the HF tensors
    (prefix ``hf``, e.g. "model.layers.7.") they are made of. A stacked expert
    parameter lists each expert's parts in expert order; the loader stacks them."""
    if not cfg.is_moe_layer(layer):
        return {ours + "mlp.gate_up_proj.weight": [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"],
                ours + "mlp.down_proj.weight": [hf + "mlp.down_proj.weight"]}
    module, (gate, up, down), _ = _LAYOUT[cfg.architecture]
    block = f"{hf}{module}."
    experts = range(cfg.num_experts)
    names = {
        ours + "mlp.gate.weight": [block + "gate.weight"],
        ours + "mlp.gate_up_proj": [f"{block}experts.{e}.{p}.weight" for e in experts for p in (gate, up)],
        ours + "mlp.down_proj": [f"{block}experts.{e}.{down}.weight" for e in experts],
    }
    if cfg.shared_expert_intermediate_size:
        shared = block + "shared_expert."
        names[ours + "mlp.shared_expert.gate_up_proj.weight"] = [shared + "gate_proj.weight",
                                                                 shared + "up_proj.weight"]
        names[ours + "mlp.shared_expert.down_proj.weight"] = [shared + "down_proj.weight"]
        names[ours + "mlp.shared_expert_gate.weight"] = [block + "shared_expert_gate.weight"]
    return names
