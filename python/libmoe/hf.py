# SPDX-License-Identifier: Apache-2.0
"""transformers MoE blocks on libmoe: from_hf(block) builds a drop-in module, patch(model)
replaces every supported block. transformers >= 5 layout (experts.gate_up_proj [E, 2I, H],
experts.down_proj [E, H, I], a router module returning (logits, weights, ids))."""
import torch
from torch import nn

from .core import MoELayer, default_runtime

# block class name -> what it has
_KINDS = {
    "MixtralSparseMoeBlock": "mixtral",
    "Qwen2MoeSparseMoeBlock": "qwen2_moe",
    "Qwen3MoeSparseMoeBlock": "qwen3_moe",
    "DeepseekV3MoE": "deepseek_v3",
    "DeepseekV2Moe": "deepseek_v2",
    "DeepseekV2MoE": "deepseek_v2",
}


def supported(module):
    """Whether from_hf takes this module."""
    return type(module).__name__ in _KINDS


def _activation(act_fn):
    name = type(act_fn).__name__.lower()
    if "silu" in name or "swish" in name:
        return "silu"
    if "gelu" in name and ("tanh" in name or getattr(act_fn, "approximate", "") == "tanh"):
        return "gelu"
    raise NotImplementedError(f"libmoe: activation {type(act_fn).__name__} (SiLU or GELU-tanh)")


def _mlp_weights(mlp, what):
    for n in ("gate_proj", "up_proj", "down_proj"):
        if getattr(getattr(mlp, n), "bias", None) is not None:
            raise NotImplementedError(f"libmoe: {what}.{n} has a bias")
    return mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight


class LibmoeMoEBlock(nn.Module):
    """A transformers MoE block whose experts (and shared experts) run on libmoe. The block's
    own router module (`gate`) still routes (routing="block"): the same ids and weights as the
    block, and transformers' recorders see its router logits; routing="libmoe" lets libmoe route
    from the router weights instead (Mixtral, Qwen2/3-MoE, DeepSeek-V3, DeepSeek-V2 greedy).
    forward(hidden_states) -> hidden_states, as the block."""

    def __init__(self, block, runtime=None, routing="block", max_tokens=4096, dtype=None,
                 **layer_kwargs):
        super().__init__()
        kind = _KINDS.get(type(block).__name__)
        if kind is None:
            raise TypeError(f"libmoe.from_hf: {type(block).__name__} is not a supported MoE block "
                            f"({', '.join(sorted(set(_KINDS)))})")
        ex = getattr(block, "experts", None)
        if not hasattr(ex, "gate_up_proj") or not hasattr(ex, "down_proj"):
            raise NotImplementedError("libmoe.from_hf: the block's experts are not the fused "
                                      "gate_up_proj/down_proj tensors of transformers >= 5")
        if routing not in ("block", "libmoe"):
            raise ValueError(f"routing = {routing!r}: 'block' or 'libmoe'")
        runtime = runtime or default_runtime()
        w13, w2 = ex.gate_up_proj.detach(), ex.down_proj.detach()
        if getattr(ex, "has_bias", False) or getattr(ex, "gate_up_proj_bias", None) is not None:
            raise NotImplementedError("libmoe.from_hf: experts with biases")
        E, I2, H = w13.shape
        I = I2 // 2
        gate = block.gate
        self.kind, self.routing, self.hidden, self.max_tokens = kind, routing, H, int(max_tokens)
        self.top_k = int(gate.top_k)
        wdt = dtype or w13.dtype
        cfg = dict(num_experts=E, top_k=self.top_k, hidden=H, intermediate=I,
                   activation=_activation(ex.act_fn), dtype=wdt,
                   max_tokens_per_rank=self.max_tokens)
        bad = set(layer_kwargs) & {"num_experts", "top_k", "hidden", "intermediate", "activation",
                                   "num_shared_experts", "shared_intermediate",
                                   "shared_expert_gate", "max_tokens_per_rank"}
        if bad:
            raise TypeError(f"libmoe.from_hf: {sorted(bad)} come from the block")
        cfg.update(layer_kwargs)  # ep_size, tp_size, dispatch, deterministic, fp8 options, ...
        shared, sgate = None, None
        if kind == "qwen2_moe":
            shared = _mlp_weights(block.shared_expert, "shared_expert")
            sgate = block.shared_expert_gate.weight.detach()
        elif kind.startswith("deepseek") and getattr(block, "shared_experts", None) is not None:
            shared = _mlp_weights(block.shared_experts, "shared_experts")
        if shared is not None:
            cfg.update(num_shared_experts=1, shared_intermediate=shared[0].shape[0],
                       shared_expert_gate=sgate is not None)
        if routing == "libmoe":
            cfg.update(self._routing_config(kind, gate, E))
        self.layer = MoELayer(runtime, **cfg)
        for e in self.layer.local_experts():  # this rank's experts only (EP; TP slices them)
            self.layer.set_weight("gate_proj", e, w13[e, :I])
            self.layer.set_weight("up_proj", e, w13[e, I:])
            self.layer.set_weight("down_proj", e, w2[e])
        if shared is not None:
            for kind_name, w in zip(("shared_gate_proj", "shared_up_proj", "shared_down_proj"),
                                    shared):
                self.layer.set_weight(kind_name, -1, w.detach())
        if sgate is not None:
            self.layer.set_weight("shared_expert_gate", -1, sgate)
        if routing == "libmoe":
            self.layer.set_weight("router", -1, gate.weight.detach().float())
            if cfg.get("use_score_bias"):
                self.layer.set_weight("router_bias", -1,
                                      gate.e_score_correction_bias.detach().float())
        else:
            self.gate = gate  # the block's router, kept (its weights stay in the state dict)

    @staticmethod
    def _routing_config(kind, gate, E):
        if kind == "mixtral":
            return dict(scoring="softmax", renormalize=True)
        if kind in ("qwen2_moe", "qwen3_moe"):
            return dict(scoring="softmax", renormalize=bool(gate.norm_topk_prob))
        if kind == "deepseek_v3":
            ng = int(gate.num_group or 1)
            return dict(scoring="sigmoid", use_score_bias=True, n_group=ng if ng > 1 else 0,
                        topk_group=int(gate.topk_group) if ng > 1 else 0,
                        renormalize=bool(gate.norm_topk_prob),
                        routed_scaling_factor=float(gate.routed_scaling_factor))
        if kind == "deepseek_v2" and gate.topk_method == "greedy":
            return dict(scoring="softmax", renormalize=False,
                        routed_scaling_factor=float(gate.routed_scaling_factor))
        raise NotImplementedError(f"libmoe.from_hf: routing='libmoe' for {kind} with its "
                                  "router's settings (use routing='block')")

    def forward(self, hidden_states):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden)
        if not x.is_contiguous():
            x = x.contiguous()
        if x.shape[0] > self.max_tokens:
            raise ValueError(f"libmoe: {x.shape[0]} tokens in one step exceed max_tokens = "
                             f"{self.max_tokens} (from_hf(..., max_tokens=N))")
        if self.routing == "libmoe":
            return self.layer(x).reshape(shape)
        _, weights, ids = self.gate(x)
        y = self.layer(x, ids.to(torch.int32).contiguous(),
                       weights.to(torch.float32).contiguous())
        return y.reshape(shape)

    def extra_repr(self):
        return f"kind={self.kind}, routing={self.routing}, layer={self.layer!r}"


def from_hf(block, runtime=None, **kwargs):
    """A module that replaces one transformers MoE block (Mixtral, Qwen2-MoE with its gated
    shared expert, Qwen3-MoE, DeepSeek-V3/V2 with groups, bias and shared experts), reading its
    weights and config; the same forward signature and output. Under mpirun each rank keeps
    only its experts (EP over the runtime's ranks). kwargs: routing ("block" or "libmoe"),
    max_tokens (tokens per step per rank, default 4096), dtype (libmoe's weight dtype; default
    the block's), and MoELayer's layout and arithmetic options (ep_size, tp_size, dispatch,
    deterministic, fp8_math, scale_kind, ...). Inference only: libmoe has no backward, and the
    block's training-time router jitter is not applied."""
    return LibmoeMoEBlock(block, runtime, **kwargs)


def patch(model, runtime=None, **kwargs):
    """Replaces every supported MoE block of `model` by from_hf(block); returns how many."""
    runtime = runtime or default_runtime()
    todo = [(name, m) for name, m in model.named_modules() if supported(m)]
    for name, m in todo:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, from_hf(m, runtime, **kwargs))
    return len(todo)
