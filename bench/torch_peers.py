#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Torch peers of moe-bench on the same GPU: the same layer step (route -> experts -> combine)
as an HF-style per-expert loop and with torch._grouped_mm, at the same shapes and token counts.
Prints one table per preset; with --moe-json (moe-bench --json files) the libmoe column sits
beside them, with the limit and each column's score = limit / time.

  python3 bench/torch_peers.py --tokens 1,8,64,512,2048,8192 --moe-json out/mixtral.json ...

--dtype fp8: W8A8 peers (e4m3 weights with per-output-channel scales, activations quantised
per token on the fly, f32 accumulation): a per-expert loop of torch._scaled_mm, and
torch._scaled_grouped_mm where this torch has it. Torch has no 128 x 128 block-scaled grouped
GEMM, so these peers are the per-row-scale arithmetic at the same bytes; the limit counts one
byte per weight and the fp8 tensor-core rate.
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F

PRESETS = {
    "mixtral-8x7b": dict(E=8, k=2, H=4096, I=14336, scoring="softmax"),
    "qwen3-30b-a3b": dict(E=128, k=8, H=2048, I=768, scoring="softmax"),
    "deepseek-v3-ep8": dict(E=32, k=8, H=7168, I=2048, scoring="sigmoid", n_group=4,
                            topk_group=2, scaling=2.5),
}
HBM = 4.8e12
BF16 = 989e12
FP8 = 1979e12
E4M3_MAX = 448.0


def route(x, p, w):
    """Top-k ids and weights as the model families define them (f32 logits)."""
    logits = x.float() @ w["router"].t()
    k = p["k"]
    if p["scoring"] == "softmax":
        probs = torch.softmax(logits, dim=-1)
        wt, ids = torch.topk(probs, k, dim=-1)
        wt = wt / wt.sum(dim=-1, keepdim=True)
        return ids, wt
    s = torch.sigmoid(logits)
    b = s + w["bias"]
    T, E = b.shape
    g = p["n_group"]
    gs = b.view(T, g, E // g).topk(2, dim=-1)[0].sum(-1)
    keep = torch.topk(gs, p["topk_group"], dim=-1)[1]
    gmask = torch.zeros_like(gs).scatter_(1, keep, 1.0)
    emask = gmask.unsqueeze(-1).expand(T, g, E // g).reshape(T, E)
    ids = torch.topk(b.masked_fill(emask == 0, float("-inf")), k, dim=-1)[1]
    wt = s.gather(1, ids)
    wt = wt / (wt.sum(-1, keepdim=True) + 1e-20) * p.get("scaling", 1.0)
    return ids, wt


def expert_loop(x, p, w, mlp):
    """transformers' MoE block: a Python loop over the experts that were hit, mlp(rows, w, e)."""
    ids, wt = route(x, p, w)
    y = torch.zeros_like(x)
    mask = F.one_hot(ids, num_classes=p["E"]).permute(2, 1, 0)
    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit.flatten().tolist():
        slot, tok = torch.where(mask[e])
        out = mlp(x[tok], w, e)
        out = out * wt[tok, slot, None].to(out.dtype)
        y.index_add_(0, tok, out.to(y.dtype))
    return y


def sorted_rows(x, p, w, mlp):
    """Rows sorted by expert, mlp(rows, w, offs) on all of them at once (no host sync), then the
    weighted sum back per token in f32."""
    ids, wt = route(x, p, w)
    k, E = p["k"], p["E"]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    tok = order // k
    counts = torch.zeros(E, dtype=torch.int32, device=x.device)
    counts.index_add_(0, flat.int(), torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    out = mlp(x[tok], w, offs).float() * wt.flatten()[order, None]
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, tok, out)
    return y.to(x.dtype)


def bf16_expert(cur, w, e):
    g, u = (cur @ w["w13"][e].t()).chunk(2, dim=-1)
    return (F.silu(g) * u) @ w["w2"][e].t()


def bf16_grouped(xs, w, offs):
    """Both projections with torch._grouped_mm."""
    g, u = torch._grouped_mm(xs, w["w13"].transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm((F.silu(g) * u).contiguous(), w["w2"].transpose(-2, -1), offs=offs)


def quant_rows(x):
    """e4m3 rows with one dynamic scale per row (amax / 448), as libmoe's W8A8 path."""
    s = x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    q = (x.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, s


def fp8_weights(w):
    """e4m3 weights with one scale per output row (per-tensor scales are the same, expanded)."""
    out = {"router": w["router"], "bias": w["bias"]}
    for n in ("w13", "w2"):
        t = w[n].float()
        s = t.abs().amax(dim=-1).clamp_min(1e-12) / E4M3_MAX  # [E, rows]
        out[n] = (t / s[..., None]).to(torch.float8_e4m3fn)
        out[n + "_s"] = s
    return out


def fp8_expert(cur, w, e):
    """One expert with torch._scaled_mm (a [m, k] x b [n, k], row scales of both)."""
    def scaled(a, b, sb):
        q, sa = quant_rows(a)
        return torch._scaled_mm(q, b.t(), scale_a=sa, scale_b=sb[None, :].contiguous(),
                                out_dtype=torch.bfloat16)
    g, u = scaled(cur, w["w13"][e], w["w13_s"][e]).chunk(2, dim=-1)
    return scaled(F.silu(g) * u, w["w2"][e], w["w2_s"][e])


def fp8_grouped(xs, w, offs):
    """Both projections with torch._scaled_grouped_mm (row-wise scales)."""
    def scaled(a, n):
        q, s = quant_rows(a)
        return torch._scaled_grouped_mm(q, w[n].transpose(-2, -1), s.flatten(), w[n + "_s"],
                                        offs=offs, out_dtype=torch.bfloat16)
    g, u = scaled(xs, "w13").chunk(2, dim=-1)
    return scaled(F.silu(g) * u, "w2")


def time_us(fn, graph, seconds=0.3):
    """Median GPU time of one call (CUDA events; CUDA-graph replay when `graph`)."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        g = None
        if graph:
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=s):
                    fn()
                g.replay()
                torch.cuda.synchronize()
            except Exception as exc:  # capture not possible: fall back to eager
                print(f"#   (graph capture failed: {type(exc).__name__}; eager)", file=sys.stderr)
                g = None
        run = g.replay if g is not None else fn
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        torch.cuda.synchronize()
        n = int(max(10, min(500, seconds / max(e0.elapsed_time(e1) * 1e-3, 1e-6))))
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        ev[0].record()
        for i in range(n):
            run()
            ev[i + 1].record()
        torch.cuda.synchronize()
        t = sorted(ev[i].elapsed_time(ev[i + 1]) * 1e3 for i in range(n))
    return t[n // 2], g is not None


def limit_us(p, m, distinct, fp8=False):
    flops = 2.0 * m * p["k"] * 3 * p["H"] * p["I"]
    byts = distinct * 3.0 * p["H"] * p["I"] * (1 if fp8 else 2)
    return max(byts / HBM, flops / (FP8 if fp8 else BF16)) * 1e6


def try_time(fn, graph):
    """time_us, or NaN where this torch lacks the op or refuses the shape."""
    try:
        return time_us(fn, graph)[0]
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        print(f"#   ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})", file=sys.stderr)
        return float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--tokens", default="1,8,64,512,2048,8192")
    ap.add_argument("--graph-max", type=int, default=512)
    ap.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--moe-json", nargs="*", default=[], help="moe-bench --json outputs")
    ap.add_argument("--json", help="write this script's results here")
    ap.add_argument("--markdown", help="append the side-by-side tables here (markdown)")
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    moe = {}
    for f in a.moe_json:
        with open(f) as fh:
            d = json.load(fh)
        moe[d["preset"]] = {pt["m"]: pt for pt in d["points"]}
    tokens = [int(t) for t in a.tokens.split(",")]
    results, md = [], []
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
    for name in a.presets.split(","):
        p = PRESETS[name]
        E, H, I = p["E"], p["H"], p["I"]
        w = {
            "router": torch.randn(E, H, device=dev) / H ** 0.5,
            "bias": 0.05 * torch.rand(E, device=dev),
            "w13": (torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) / H ** 0.5),
            "w2": (torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) / I ** 0.5),
        }
        fp8 = a.dtype == "fp8"
        if fp8:
            w = fp8_weights(w)
        loop, grp = (fp8_expert, fp8_grouped) if fp8 else (bf16_expert, bf16_grouped)
        xall = torch.randn(max(tokens), H, device=dev, dtype=torch.bfloat16)
        print(f"\n# {name}: E{E} k{p['k']} H{H} I{I} {a.dtype}")
        print(f"# {'tokens':>7} {'experts':>7} {'limit':>9} {'libmoe':>9} {'score':>6} "
              f"{'hf_loop':>9} {'score':>6} {'grouped':>9} {'score':>6}")
        md.append(f"\n### {name} (E{E} k{p['k']} H{H} I{I}, {a.dtype}), µs "
                  "(score = limit / time)\n")
        md.append("| tokens | experts hit | limit | libmoe | "
                  + ("_scaled_mm loop | torch._scaled_grouped_mm |" if fp8
                     else "hf loop | torch._grouped_mm |"))
        md.append("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for m in tokens:
            x = xall[:m]
            with torch.no_grad():
                ids, _ = route(x, p, w)
                distinct = int(torch.unique(ids).numel())
                lim = limit_us(p, m, distinct, fp8)
                t_loop = try_time(lambda: expert_loop(x, p, w, loop), graph=False)
                t_grp = try_time(lambda: sorted_rows(x, p, w, grp), graph=m <= a.graph_max)
            lm = moe.get(name, {}).get(m)
            t_moe = lm["time_us"] if lm else float("nan")
            lim_m = lm["limit_us"] if lm else lim
            print(f"  {m:>7} {distinct:>7} {lim_m:>9.1f} {t_moe:>9.1f} {lim_m / t_moe:>6.3f} "
                  f"{t_loop:>9.1f} {lim / t_loop:>6.3f} {t_grp:>9.1f} {lim / t_grp:>6.3f}")
            md.append(f"| {m} | {lm['distinct_experts'] if lm else distinct} | {lim_m:.1f} | "
                      f"{t_moe:.1f} ({lim_m / t_moe:.2f}) | {t_loop:.1f} ({lim / t_loop:.2f}) | "
                      f"{t_grp:.1f} ({lim / t_grp:.2f}) |")
            results.append(dict(preset=name, dtype=a.dtype, m=m, distinct=distinct, limit_us=lim,
                                hf_loop_us=t_loop, grouped_mm_us=t_grp, libmoe_us=t_moe))
        del w, xall
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)
    if a.markdown:
        with open(a.markdown, "a") as fh:
            fh.write("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
