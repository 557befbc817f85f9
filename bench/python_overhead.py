#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The Python binding's cost over the C step, on one GPU: a layer of a moe-bench preset (random
bf16 weights, libmoe's router) at M tokens, as

  graph   the step captured from Python in torch.cuda.graph and replayed (GPU time per step,
          CUDA events over --iters replays): compare with moe-bench's graph column at the same
          preset, M and --rotate 1 (the same L2 reuse); the binding adds nothing to a replay;
  eager   layer(x) then synchronize, per step (wall), and the host time of the call alone
          (Python -> ctypes -> moe_layer_forward, returning before the GPU finishes).

  python3 bench/python_overhead.py --preset qwen3-30b-a3b --tokens 1
  build/launch/moe-bench --preset qwen3-30b-a3b --tokens 1 --rotate 1   # the C reference
"""
import argparse
import json
import time

import torch

import libmoe

PRESETS = {
    "mixtral-8x7b": dict(num_experts=8, top_k=2, hidden=4096, intermediate=14336),
    "qwen3-30b-a3b": dict(num_experts=128, top_k=8, hidden=2048, intermediate=768),
    "deepseek-v3-ep8": dict(num_experts=32, top_k=8, hidden=7168, intermediate=2048,
                            scoring="sigmoid", use_score_bias=True, n_group=4, topk_group=2,
                            routed_scaling_factor=2.5),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(PRESETS))
    p.add_argument("--tokens", default="1", help="comma-separated M")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--json", help="write the numbers here")
    a = p.parse_args()
    cfg = PRESETS[a.preset]
    rt = libmoe.Runtime(backend="cuda")
    E, H, I = cfg["num_experts"], cfg["hidden"], cfg["intermediate"]
    layer = libmoe.MoELayer(rt, dtype="bf16", max_tokens_per_rank=8192, skip_weight_check=True,
                            **cfg)
    g = torch.Generator().manual_seed(0)
    for e in range(E):
        for kind, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            layer.set_weight(kind, e, (torch.randn(*shape, generator=g) * 0.02).bfloat16())
    layer.set_weight("router", -1, torch.randn(E, H, generator=g) * 0.02)
    if cfg.get("use_score_bias"):
        layer.set_weight("router_bias", -1, torch.zeros(E))
    rows = []
    for m in [int(t) for t in a.tokens.split(",")]:
        x = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
        for _ in range(20):
            layer(x)
        layer.synchronize()
        # eager: wall per step (with synchronize) and host time of the call alone
        t0 = time.perf_counter()
        n = max(a.iters // 10, 50)
        for _ in range(n):
            layer(x)
            layer.synchronize()
        eager_us = (time.perf_counter() - t0) / n * 1e6
        host = []
        for _ in range(n):
            t1 = time.perf_counter()
            layer(x)
            host.append(time.perf_counter() - t1)
            layer.synchronize()
        host.sort()
        call_us = host[len(host) // 2] * 1e6
        # graph: captured from Python, replayed
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            layer(x)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = layer(x)
        for _ in range(20):
            graph.replay()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.iters):
            graph.replay()
        stop.record()
        stop.synchronize()
        layer.synchronize()
        graph_us = start.elapsed_time(stop) / a.iters * 1e3
        assert torch.isfinite(y).all()
        rows.append(dict(m=m, graph_us=graph_us, eager_us=eager_us, call_host_us=call_us))
        print(f"{a.preset} M={m}: graph replay {graph_us:.2f} us/step, eager {eager_us:.2f} "
              f"us/step, layer(x) host time {call_us:.2f} us (median)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(preset=a.preset, torch=torch.__version__,
                           gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    rt.close()


if __name__ == "__main__":
    main()
