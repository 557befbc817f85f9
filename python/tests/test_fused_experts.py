# SPDX-License-Identifier: Apache-2.0
"""fused_experts (vLLM's layout) against a torch reference: f32 and bf16, top-k 1..4, int64 and
int32 ids, inplace, FP8 e4m3 weights with per-tensor, per-channel and 128x128 block scales
(against the dequantised weights), static activation scales (a1_scale, a2_scale) against the
static W8A8 reference, the router weights on the input (top-1), the layer cache, and every bad
argument."""
import pytest
import torch

import libmoe


def ref(x, w1, w2, tw, ti, act="silu"):
    """vLLM's semantics in float64: y[t] = sum_j tw[t,j] * w2[e] (act(g) * u), [g; u] = w1[e] x."""
    I = w1.shape[1] // 2
    y = torch.zeros(x.shape, dtype=torch.float64)
    f = torch.nn.functional.silu if act == "silu" else \
        (lambda v: torch.nn.functional.gelu(v, approximate="tanh"))
    for t in range(x.shape[0]):
        for j in range(ti.shape[1]):
            e = int(ti[t, j])
            gu = w1[e].double() @ x[t].double()
            y[t] += float(tw[t, j]) * (w2[e].double() @ (f(gu[:I]) * gu[I:]))
    return y


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def data(E=8, H=64, I=128, T=9, k=2, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    tw = torch.rand(T, k, generator=g)
    ti = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return x, w1, w2, tw, ti


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_f32(rt, k, act):
    x, w1, w2, tw, ti = data(k=k, seed=k)
    y = libmoe.fused_experts(x, w1, w2, tw, ti, activation=act, runtime=rt)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel(y, ref(x, w1, w2, tw, ti, act)) <= 1e-5
    y32 = libmoe.fused_experts(x, w1, w2, tw, ti.to(torch.int32), activation=act, runtime=rt)
    assert torch.equal(y, y32)


def test_bf16_and_inplace(rt):
    x, w1, w2, tw, ti = data(dtype=torch.bfloat16, seed=3)
    want = ref(x, w1, w2, tw, ti)
    y = libmoe.fused_experts(x, w1, w2, tw, ti, runtime=rt)
    assert y.dtype == torch.bfloat16 and rel(y, want) <= 1e-2
    xi = x.clone()
    out = libmoe.fused_experts(xi, w1, w2, tw.bfloat16(), ti, inplace=True, runtime=rt)
    assert out is xi and rel(xi, want) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_weight_on_input(rt, dtype):
    """apply_router_weight_on_input (top-1, Llama 4): y[t] = W2 act(W1 (w x)) against the
    reference with the weights moved to the input; the output weighted instead differs."""
    x, w1, w2, tw, ti = data(k=1, seed=8, dtype=dtype)
    tw = tw * 3.0  # away from 1, so where the weight goes shows
    xw = (x * tw.to(dtype)).to(dtype)
    want = ref(xw, w1, w2, torch.ones_like(tw), ti)
    y = libmoe.fused_experts(x, w1, w2, tw, ti, apply_router_weight_on_input=True, runtime=rt)
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    assert y.dtype == dtype and rel(y, want) <= bound
    assert rel(ref(x, w1, w2, tw, ti), want) > 10 * bound


def test_cache_follows_weights(rt):
    x, w1, w2, tw, ti = data(seed=4)
    a = libmoe.fused_experts(x, w1, w2, tw, ti, runtime=rt)
    w2.mul_(2.0)  # in place: a new version of the tensor, so a new layer
    b = libmoe.fused_experts(x, w1, w2, tw, ti, runtime=rt)
    assert rel(b, 2 * a) <= 1e-6
    big = torch.randn(5000, x.shape[1])  # past the default capacity: a larger layer
    ids = torch.zeros(5000, 2, dtype=torch.int64)
    ids[:, 1] = 1
    y = libmoe.fused_experts(big, w1, w2, torch.ones(5000, 2), ids, runtime=rt)
    assert torch.isfinite(y).all()
    libmoe.clear_cache()


def quant(w, kind):
    """e4m3 codes and vLLM-layout scales of w [E, R, C] (per tensor, channel or 128x128 block)."""
    E, R, C = w.shape
    if kind == "tensor":
        s = w.abs().amax(dim=(1, 2)) / 448.0
        sb = s.reshape(E, 1, 1)
    elif kind == "channel":
        s = w.abs().amax(dim=2, keepdim=True) / 448.0
        sb = s
    else:
        blocks = w.reshape(E, R // 128, 128, C // 128, 128)
        s = blocks.abs().amax(dim=(2, 4)) / 448.0
        sb = s.repeat_interleave(128, 1).repeat_interleave(128, 2)
    q = (w / sb).to(torch.float8_e4m3fn)
    return q, s, q.float() * sb


@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
def test_fp8(rt, kind):
    x, w1, w2, tw, ti = data(E=4, H=256, I=128, T=6, seed=5)
    q1, s1, d1 = quant(w1, kind)
    q2, s2, d2 = quant(w2, kind)
    kw = dict(use_fp8_w8a8=True, w1_scale=s1, w2_scale=s2, runtime=rt)
    if kind == "channel":
        kw["per_channel_quant"] = True
    if kind == "block":
        kw["block_shape"] = [128, 128]
    y = libmoe.fused_experts(x, q1, q2, tw, ti, **kw)
    # W8A8: activations quantised per token too; within e4m3's rounding of the dequantised ref
    assert rel(y, ref(x, d1, d2, tw, ti)) <= 6e-2
    # fp8_accum="fast" (W8A8_FAST): a layer of its own; the CPU backend sums in f32 as W8A8 does
    fast = libmoe.fused_experts(x, q1, q2, tw, ti, fp8_accum="fast", **kw)
    assert torch.equal(fast, y)


def ref_static(x, q1, s1, q2, s2, a1, a2, tw, ti):
    """W8A8 with static activation scales, written out: x rounded to bf16 (as libmoe gathers it),
    quantised by a1 (saturating at +-448, round to nearest even), the e4m3 products summed in
    float64, act(g) * u rounded to bf16 (as GEMM 1 stores h) and quantised by a2. a1 / a2: a
    float per expert; s1 / s2: per-tensor weight scales [E]."""
    def q8(v, s):
        return (v / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).double() * s
    I = q1.shape[1] // 2
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ti.shape[1]):
            e = int(ti[t, j])
            xq = q8(x[t].bfloat16().double(), a1[e])
            gu = (q1[e].double() * float(s1[e])) @ xq
            h = (torch.nn.functional.silu(gu[:I]) * gu[I:]).bfloat16().double()
            y[t] += float(tw[t, j]) * ((q2[e].double() * float(s2[e])) @ q8(h, a2[e]))
    return y


def test_fp8_static_activation_scales(rt):
    """a1_scale / a2_scale as vLLM passes them (one for every expert) and one per expert: against
    the static W8A8 reference, and away from the dynamic result (a1 at half of x's largest value
    over 448: the largest values saturate)."""
    x, w1, w2, tw, ti = data(E=4, H=256, I=128, T=6, seed=7)
    q1, s1, _ = quant(w1, "tensor")
    q2, s2, _ = quant(w2, "tensor")
    kw = dict(use_fp8_w8a8=True, w1_scale=s1, w2_scale=s2, runtime=rt)
    dyn = libmoe.fused_experts(x, q1, q2, tw, ti, **kw)
    a1 = float(x.abs().max()) / 448.0 / 2.0
    a2 = 0.02
    for a1s, a2s, a1e, a2e in (
            (torch.tensor([a1]), torch.tensor(a2), [a1] * 4, [a2] * 4),  # vLLM's form
            (a1, a2, [a1] * 4, [a2] * 4),  # plain numbers
            (torch.tensor([a1, 2 * a1, a1, 3 * a1]), None, [a1, 2 * a1, a1, 3 * a1], None)):
        y = libmoe.fused_experts(x, q1, q2, tw, ti, a1_scale=a1s, a2_scale=a2s, **kw)
        if a2e is None:  # GEMM 2 dynamic: the reference's a2 is each row's own amax / 448
            want = None
            assert rel(y, dyn) > 1e-3
        else:
            want = ref_static(x, q1, s1, q2, s2, a1e, a2e, tw, ti)
            # 5e-8 measured (f32 against float64 sums); a bf16 rounding of h that the two
            # sums put on either side of a tie would flip one e4m3 code: still far below 1e-4
            assert rel(y, want) <= 1e-4, rel(y, want)
            assert rel(dyn, want) > 3 * rel(y, want)  # the static scales were used
    libmoe.clear_cache()


def test_bad_arguments(rt):
    x, w1, w2, tw, ti = data(seed=6)
    q1, t1, _ = quant(w1, "tensor")
    q2, t2, _ = quant(w2, "tensor")
    c1, c2 = quant(w1, "channel")[1], quant(w2, "channel")[1]
    f = libmoe.fused_experts
    cases = [
        (lambda: f(x, w1, w2, tw, ti.float(), runtime=rt), TypeError, "topk_ids.dtype"),
        (lambda: f(x, w1, w2, tw.int(), ti, runtime=rt), TypeError, "topk_weights.dtype"),
        (lambda: f(x, w1, w2, tw[:3], ti, runtime=rt), ValueError, "[T, k]"),
        (lambda: f(x[:3], w1, w2, tw, ti, runtime=rt), ValueError, "[T, k]"),
        (lambda: f(x[None], w1, w2, tw, ti, runtime=rt), ValueError, "[T, H]"),
        (lambda: f(x, w1[:, :-1], w2, tw, ti, runtime=rt), ValueError, "w1 [E, 2I, H]"),
        (lambda: f(x, w1, w2.transpose(1, 2), tw, ti, runtime=rt), ValueError, "w2 [E, H, I]"),
        (lambda: f(x, w1[0], w2, tw, ti, runtime=rt), ValueError, "3-D"),
        (lambda: f(x, w1.double(), w2.double(), tw, ti, runtime=rt), TypeError, "w1.dtype"),
        (lambda: f(x.half(), w1, w2, tw, ti, runtime=rt), TypeError, "x.dtype"),
        (lambda: f(x, w1, w2, tw, ti + 8, runtime=rt), libmoe.MoEError, "given_topk_ids"),
        (lambda: f(x, w1, w2, tw * float("inf"), ti, runtime=rt), libmoe.MoEError,
         "not finite"),
        (lambda: f(x, w1, w2, tw, ti, expert_map=torch.arange(8), runtime=rt),
         NotImplementedError, "expert_map"),
        (lambda: f(x, w1, w2, tw, ti, apply_router_weight_on_input=True, runtime=rt),
         NotImplementedError, "apply_router_weight_on_input with top_k = 2"),
        (lambda: f(x, w1, w2, tw, ti, use_int8_w8a8=True, runtime=rt), NotImplementedError,
         "use_int8_w8a8"),
        (lambda: f(x, w1, w2, tw, ti, bogus=1, runtime=rt), TypeError, "bogus"),
        (lambda: f(x, w1, w2, tw, ti, use_fp8_w8a8=True, runtime=rt), TypeError,
         "float8_e4m3fn"),
        (lambda: f(x, w1, w2, tw, ti, activation="relu", runtime=rt), ValueError, "activation"),
        (lambda: f(x, w1, w2, tw, ti, a1_scale=torch.ones(1), runtime=rt), ValueError,
         "need use_fp8_w8a8=True"),
        (lambda: f(x, q1, q2, tw, ti, use_fp8_w8a8=True, w1_scale=c1, w2_scale=c2,
                   per_channel_quant=True, a2_scale=torch.ones(1), runtime=rt),
         NotImplementedError, "per-tensor weight scales"),
        (lambda: f(x, q1, q2, tw, ti, use_fp8_w8a8=True, w1_scale=t1, w2_scale=t2,
                   a1_scale=torch.ones(3), runtime=rt), ValueError, "one per expert (8)"),
        (lambda: f(x, q1, q2, tw, ti, use_fp8_w8a8=True, w1_scale=t1, w2_scale=t2,
                   a1_scale=torch.tensor(-1.0), runtime=rt), libmoe.MoEError,
         "input_scale"),
        (lambda: f(x, "w1", w2, tw, ti, runtime=rt), TypeError, "torch.Tensor"),
        (lambda: f(x, q1, q2, tw, ti, use_fp8_w8a8=True, w1_scale=t1, w2_scale=t2,
                   fp8_accum="sloppy", runtime=rt), ValueError, "'promoted' or 'fast'"),
        (lambda: f(x, w1, w2, tw, ti, fp8_accum="fast", runtime=rt), ValueError,
         "needs use_fp8_w8a8=True"),
    ]
    for i, (call, exc, words) in enumerate(cases):
        with pytest.raises(exc) as info:
            call()
        assert words in str(info.value), f"case {i}: {info.value!r}"
    assert torch.isfinite(f(x, w1, w2, tw, ti, runtime=rt)).all()
