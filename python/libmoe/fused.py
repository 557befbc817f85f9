# SPDX-License-Identifier: Apache-2.0
"""fused_experts with vLLM's argument layout: the experts of a MoE layer on routing given by
the caller (moe_forward_args_t.given_topk_ids/weights)."""
import math
import weakref

import torch

from .core import MoELayer, default_runtime

_cache = {}


def _key(runtime, hidden_dtype, tensors, extra):
    """The cache key of a set of weights: the tensors' identities and versions (an entry is used
    only while weakrefs to the same tensor objects are alive, so a new tensor at a freed
    tensor's address never finds the old layer)."""
    parts = [id(runtime), hidden_dtype]
    for t in tensors:
        parts += [None] if t is None else [id(t), tuple(t.shape), t.dtype, t._version]
    return tuple(parts) + tuple(extra)


def _alive(entry, tensors):
    layer, refs = entry
    return layer._h is not None and all(
        (r is None and t is None) or (r is not None and r() is t) for r, t in zip(refs, tensors))


def _fp8_scales(scale, E, rows, cols, block_shape, per_channel, name):
    """vLLM's scale of one stacked matrix per expert -> (scale kind, per-expert [r, c] f32)."""
    s = scale.detach().float().cpu()
    if block_shape is not None:
        bn, bk = block_shape
        if (bn, bk) != (128, 128):
            raise NotImplementedError(f"block_shape = {block_shape}: libmoe's block scales are "
                                      "128x128")
        want = (E, math.ceil(rows / 128), math.ceil(cols / 128))
        if tuple(s.shape) != want:
            raise ValueError(f"{name}.shape = {tuple(s.shape)}: 128x128 block scales of "
                             f"[{E}, {rows}, {cols}] are {want}")
        return "block", s
    if per_channel:
        if s.numel() != E * rows:
            raise ValueError(f"{name}.shape = {tuple(s.shape)}: per-channel scales are "
                             f"[{E}, {rows}, 1]")
        return "channel", s.reshape(E, rows, 1)
    if s.numel() != E:
        raise ValueError(f"{name}.shape = {tuple(s.shape)}: per-tensor scales are [{E}]")
    return "tensor", s.reshape(E, 1, 1)


def _act_scales(scale, E, name):
    """vLLM's static activation scale (a1_scale / a2_scale: one for all experts, or one per
    expert) -> a float per expert, or None."""
    if scale is None:
        return None
    s = torch.as_tensor(scale).detach().float().cpu().reshape(-1)
    if s.numel() == 1:
        return [s.item()] * E
    if s.numel() != E:
        raise ValueError(f"{name} has {s.numel()} elements: one static activation scale, or "
                         f"one per expert ({E})")
    return s.tolist()


def _build(runtime, w1, w2, activation, fp8, w1_scale, w2_scale, block_shape, per_channel,
           max_tokens, fp8_accum="promoted"):
    E, I2, H = w1.shape
    if I2 % 2 or tuple(w2.shape) != (E, H, I2 // 2):
        raise ValueError(f"w1.shape = {tuple(w1.shape)}, w2.shape = {tuple(w2.shape)}: want "
                         "w1 [E, 2I, H] (gate and up stacked) and w2 [E, H, I]")
    I = I2 // 2
    kw = dict(num_experts=E, top_k=1, hidden=H, intermediate=I, activation=activation,
              max_tokens_per_rank=max_tokens)
    s1 = s2 = None
    if fp8:
        if w1.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
            raise TypeError(f"use_fp8_w8a8: w1, w2 must be float8_e4m3fn (got {w1.dtype}, "
                            f"{w2.dtype})")
        if w1_scale is None or w2_scale is None:
            raise ValueError("use_fp8_w8a8: w1_scale and w2_scale are needed")
        k1, s1 = _fp8_scales(w1_scale, E, I2, H, block_shape, per_channel, "w1_scale")
        k2, s2 = _fp8_scales(w2_scale, E, H, I, block_shape, per_channel, "w2_scale")
        if k1 == "block" and I % 128:
            raise NotImplementedError(f"block scales with I = {I} (not a multiple of 128): "
                                      "gate and up would share a block")
        kw.update(dtype="fp8_e4m3", scale_kind=k1,
                  fp8_math="w8a8_fast" if fp8_accum == "fast" else "w8a8")
    else:
        if w1.dtype not in (torch.float32, torch.bfloat16, torch.float16) or w2.dtype != w1.dtype:
            raise TypeError(f"w1.dtype = {w1.dtype}, w2.dtype = {w2.dtype}: float32, bfloat16 "
                            "or float16, the same (or float8_e4m3fn with use_fp8_w8a8=True)")
        kw["dtype"] = "bf16" if w1.dtype == torch.bfloat16 else "f32"
    return E, I, kw, s1, s2


def _load(layer, w1, w2, I, s1, s2, a1=None, a2=None):
    """a1 / a2 (optional, per-tensor FP8 only): each expert's static activation scale of GEMM 1's
    input (gate and up share it) and of GEMM 2's."""
    w1c, w2c = w1.detach().cpu(), w2.detach().cpu()
    for e in layer.local_experts():
        g, u = w1c[e, :I], w1c[e, I:]
        if s1 is None:
            layer.set_weight("gate_proj", e, g)
            layer.set_weight("up_proj", e, u)
            layer.set_weight("down_proj", e, w2c[e])
            continue
        if s1.shape[1] == 1 and s1.shape[2] == 1:  # per tensor: one scale for gate and up
            sg = su = s1[e]
        else:
            r = I if s1.shape[2] == 1 else I // 128  # channel rows, or block rows
            sg, su = s1[e, :r], s1[e, r:]
        i1 = None if a1 is None else a1[e]
        i2 = None if a2 is None else a2[e]
        layer.set_weight("gate_proj", e, g, scale=sg, input_scale=i1)
        layer.set_weight("up_proj", e, u, scale=su, input_scale=i1)
        layer.set_weight("down_proj", e, w2c[e], scale=s2[e], input_scale=i2)


def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, inplace=False,
                  activation="silu", apply_router_weight_on_input=False, use_fp8_w8a8=False,
                  per_channel_quant=False, global_num_experts=-1, expert_map=None,
                  w1_scale=None, w2_scale=None, a1_scale=None, a2_scale=None, block_shape=None,
                  runtime=None, max_tokens=4096, fp8_accum="promoted", **unsupported):
    """vLLM's fused_experts on libmoe: y[t] = sum_j topk_weights[t, j] *
    W2_e act(W1_e[:I] x) * (W1_e[I:] x), e = topk_ids[t, j]. hidden_states [T, H] f32 or bf16;
    w1 [E, 2I, H] (gate then up), w2 [E, H, I]; topk_weights [T, k], topk_ids [T, k] (int32 or
    int64). FP8: use_fp8_w8a8=True with float8_e4m3fn weights and w1_scale/w2_scale per tensor
    ([E]), per channel (per_channel_quant, [E, rows, 1]) or 128x128 blocks (block_shape=[128,
    128]); apply_router_weight_on_input (top_k 1): x[t] times its weight goes into the expert
    and the output is not weighted. Activations are quantised per token by libmoe (W8A8), or with
    per-tensor weight
    scales by a1_scale (GEMM 1's input) and a2_scale (GEMM 2's), static activation scales: one
    for every expert, as vLLM passes them, or one per expert ([E]). The layer made for a set of
    weights is cached (keyed by the tensors and their versions): the first call with new weights
    copies them (collective under mpirun: EP over the ranks, the same weights on every rank).
    fp8_accum="fast" (libmoe's own keyword): fp8_math W8A8_FAST, the tensor cores may sum the
    e4m3 products over the whole k without promotion, as vLLM's Triton kernel does on sm_90 with
    per-tensor and per-channel scales (faster at large batches, less exact); "promoted" (the
    default) keeps W8A8's f32 promotion. Block scales promote either way."""
    for name in ("use_int8_w8a8", "use_int8_w8a16", "use_int4_w4a16", "use_mxfp4_w4a4",
                 "w1_zp", "w2_zp", "w1_bias", "w2_bias"):
        if unsupported.get(name):
            raise NotImplementedError(f"libmoe.fused_experts: {name}")
    unknown = set(unsupported) - {"use_int8_w8a8", "use_int8_w8a16", "use_int4_w4a16",
                                  "use_mxfp4_w4a4", "w1_zp", "w2_zp", "w1_bias", "w2_bias"}
    if unknown:
        raise TypeError(f"libmoe.fused_experts: unexpected arguments {sorted(unknown)}")
    if fp8_accum not in ("promoted", "fast"):
        raise ValueError(f"fp8_accum = {fp8_accum!r}: 'promoted' or 'fast'")
    if fp8_accum == "fast" and not use_fp8_w8a8:
        raise ValueError("libmoe.fused_experts: fp8_accum='fast' needs use_fp8_w8a8=True")
    if expert_map is not None:
        raise NotImplementedError("libmoe.fused_experts: expert_map (libmoe places experts "
                                  "over the runtime's ranks itself)")
    if a1_scale is not None or a2_scale is not None:
        if not use_fp8_w8a8:
            raise ValueError("libmoe.fused_experts: a1_scale / a2_scale (static activation "
                             "scales) need use_fp8_w8a8=True")
        if per_channel_quant or block_shape is not None:
            raise NotImplementedError("libmoe.fused_experts: a1_scale / a2_scale with per-channel "
                                      "or block weight scales (libmoe's static activation scales "
                                      "go with per-tensor weight scales)")
    for name, t in (("hidden_states", hidden_states), ("w1", w1), ("w2", w2),
                    ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"w1.shape = {tuple(w1.shape)}, w2.shape = {tuple(w2.shape)}: 3-D")
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states.shape = {tuple(hidden_states.shape)}: must be [T, H]")
    T, k = topk_ids.shape if topk_ids.dim() == 2 else (None, None)
    if T is None or tuple(topk_weights.shape) != tuple(topk_ids.shape) or \
            T != hidden_states.shape[0]:
        raise ValueError(f"topk_ids.shape = {tuple(topk_ids.shape)}, topk_weights.shape = "
                         f"{tuple(topk_weights.shape)}: both must be [T, k] with T = "
                         f"hidden_states.shape[0] = {hidden_states.shape[0]}")
    if apply_router_weight_on_input and k != 1:
        raise NotImplementedError(f"libmoe.fused_experts: apply_router_weight_on_input with "
                                  f"top_k = {k} (vLLM's rule: top_k 1)")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids.dtype = {topk_ids.dtype}: int32 or int64")
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights.dtype = {topk_weights.dtype}: a float dtype")
    if global_num_experts not in (-1, w1.shape[0]):
        raise NotImplementedError(f"global_num_experts = {global_num_experts} with "
                                  f"{w1.shape[0]} experts in w1")
    runtime = runtime or default_runtime()
    cap = max(int(max_tokens), 1)
    while cap < T:
        cap *= 2
    # static activation scales: tensors are keyed as the weights are, plain numbers by value
    acts = (a1_scale, a2_scale)
    weights = (w1, w2, w1_scale, w2_scale) + tuple(
        a if isinstance(a, torch.Tensor) else None for a in acts)
    key = _key(runtime, hidden_states.dtype, weights,
               (activation, bool(use_fp8_w8a8), bool(per_channel_quant),
                tuple(block_shape) if block_shape else None, k, cap, fp8_accum) +
               tuple(None if a is None or isinstance(a, torch.Tensor) else float(a) for a in acts))
    entry = _cache.get(key)
    layer = entry[0] if entry is not None and _alive(entry, weights) else None
    if layer is None:
        E, I, kw, s1, s2 = _build(runtime, w1, w2, activation, use_fp8_w8a8, w1_scale, w2_scale,
                                  block_shape, per_channel_quant, cap, fp8_accum)
        a1 = _act_scales(a1_scale, E, "a1_scale")
        a2 = _act_scales(a2_scale, E, "a2_scale")
        kw["top_k"] = k
        layer = MoELayer(runtime, **kw)
        _load(layer, w1, w2, I, s1, s2, a1, a2)
        for k_old in [k_ for k_, (l_, refs) in _cache.items()
                      if l_._h is None or any(r is not None and r() is None for r in refs)]:
            _cache.pop(k_old)[0].close()  # layers of weights that are gone
        _cache[key] = (layer, tuple(None if t is None else weakref.ref(t) for t in weights))
    ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
    w = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()
    x = hidden_states
    if apply_router_weight_on_input:
        # vLLM's rule (Llama 4's top-1 routing): the token times its weight in its own dtype
        # goes into the expert, whose output is not weighted again
        x = (hidden_states * w.to(hidden_states.dtype)).contiguous()
        w = torch.ones_like(w)
    y = layer(x, ids.contiguous(), w.contiguous())
    if inplace:
        hidden_states.copy_(y)
        return hidden_states
    return y


def clear_cache():
    """Destroys the layers fused_experts made."""
    for layer, _ in _cache.values():
        layer.close()
    _cache.clear()
