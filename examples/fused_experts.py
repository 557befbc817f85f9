#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""libmoe.fused_experts as a serving engine calls vLLM's: it routes by itself (softmax top-k
here), then hands the experts the tokens, the stacked weights and its routing. Compared with a
plain torch loop over the experts.

    python examples/fused_experts.py [--device cpu|cuda] [--tokens 32] [--fp8]
"""
import argparse
import sys

import torch

import libmoe


def torch_experts(x, w1, w2, topk_weights, topk_ids):
    I = w2.shape[-1]
    y = torch.zeros_like(x, dtype=torch.float32)
    for e in range(w1.shape[0]):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel():
            gu = x[tok].float() @ w1[e].float().T
            h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
            y.index_add_(0, tok, (h @ w2[e].float().T) * topk_weights[tok, slot, None])
    return y


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--fp8", action="store_true", help="e4m3 weights, one scale per expert")
    a = p.parse_args()
    dev, E, H, I = a.device, a.experts, a.hidden, a.intermediate
    rt = libmoe.Runtime(backend="cuda" if dev == "cuda" else "cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.tokens, H, generator=g).to(dev, torch.bfloat16)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dev, torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dev, torch.bfloat16)
    router = (torch.randn(E, H, generator=g) / H ** 0.5).to(dev, torch.bfloat16)

    # the engine's own routing
    probs = torch.softmax((x @ router.T).float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, a.top_k, dim=-1)
    topk_weights /= topk_weights.sum(-1, keepdim=True)

    kw = {}
    if a.fp8:
        s1 = w1.float().abs().amax(dim=(1, 2)) / 448.0
        s2 = w2.float().abs().amax(dim=(1, 2)) / 448.0
        w1 = (w1.float() / s1[:, None, None]).to(torch.float8_e4m3fn)
        w2 = (w2.float() / s2[:, None, None]).to(torch.float8_e4m3fn)
        kw = dict(use_fp8_w8a8=True, w1_scale=s1, w2_scale=s2)
    y = libmoe.fused_experts(x, w1, w2, topk_weights, topk_ids, runtime=rt, **kw)
    if a.fp8:
        w1 = w1.float() * s1[:, None, None]
        w2 = w2.float() * s2[:, None, None]
    ref = torch_experts(x, w1, w2, topk_weights, topk_ids)
    err = ((y.float() - ref).norm() / ref.norm()).item()
    print(f"fused_experts on {rt.backend}: {a.tokens} tokens, E={E} k={a.top_k} H={H} I={I}"
          f"{' fp8' if a.fp8 else ''}: rel. difference from the torch loop {err:.2e}")
    ok = err < (6e-2 if a.fp8 else 2e-2)
    rt.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
