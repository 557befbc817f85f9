# SPDX-License-Identifier: Apache-2.0
"""MoELayer against a torch reference of the layer formula (CPU backend): router in libmoe,
router logits given, routing given; explain/stats/expert_load; the ctypes structs against the
C header's sizes and offsets; library lookup errors; every bad input raises."""
import ctypes
import os
import shutil
import subprocess
import sys

import pytest
import torch

import libmoe
from libmoe import _lib

E, K, H, I = 8, 2, 32, 48


def ref_layer(x, g, u, d, ids, w, shared=None):
    """y[t] = sum_j w[t, j] * d[e] (silu(g[e] x) * u[e] x) (+ shared(x))."""
    y = torch.zeros_like(x, dtype=torch.float64)
    xd = x.double()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = torch.nn.functional.silu(g[e].double() @ xd[t]) * (u[e].double() @ xd[t])
            y[t] += float(w[t, j]) * (d[e].double() @ h)
    if shared is not None:
        sg, su, sd, gate = [s.double() for s in shared]
        h = torch.nn.functional.silu(xd @ sg.T) * (xd @ su.T)
        y += torch.sigmoid(xd @ gate.T) * (h @ sd.T)
    return y


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator().manual_seed(7)
    mk = lambda *s: torch.randn(*s, generator=g) / s[-1] ** 0.5  # noqa: E731
    return dict(g=mk(E, I, H), u=mk(E, I, H), d=mk(E, H, I), router=mk(E, H), sg=mk(40, H),
                su=mk(40, H), sd=mk(H, 40), gate=mk(1, H))


def make(rt, w, shared=False, **kw):
    extra = dict(num_shared_experts=1, shared_intermediate=40, shared_expert_gate=True) \
        if shared else {}
    layer = libmoe.MoELayer(rt, num_experts=E, top_k=K, hidden=H, intermediate=I,
                            dtype=torch.float32, max_tokens_per_rank=64, **extra, **kw)
    for e in range(E):
        layer.set_weight("gate_proj", e, w["g"][e])
        layer.set_weight("up_proj", e, w["u"][e])
        layer.set_weight("down_proj", e, w["d"][e])
    layer.set_weight("router", -1, w["router"])
    if shared:
        for k, n in (("shared_gate_proj", "sg"), ("shared_up_proj", "su"),
                     ("shared_down_proj", "sd")):
            layer.set_weight(k, -1, w[n])
        layer.set_weight("shared_expert_gate", -1, w["gate"][0])  # 1-D is [1, H]
    return layer


def torch_route(x, router):
    p = torch.softmax(x @ router.T, dim=-1)
    w, ids = torch.topk(p, K, dim=-1)
    return ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()


def test_router_logits_and_given(rt, weights):
    layer = make(rt, weights, shared=True)
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(rt.rank))
    ids, w = torch_route(x, weights["router"])
    shared = (weights["sg"], weights["su"], weights["sd"], weights["gate"])
    want = ref_layer(x, weights["g"], weights["u"], weights["d"], ids, w, shared)
    assert rel(layer(x), want) <= 1e-5
    assert rel(layer(x, router_logits=(x @ weights["router"].T).contiguous()), want) <= 1e-5
    wg = torch.rand(11, K)  # any weights, not the router's
    want_g = ref_layer(x, weights["g"], weights["u"], weights["d"], ids, wg, shared)
    assert rel(layer(x, ids, wg), want_g) <= 1e-5
    assert rel(layer.forward(x.reshape(1, 11, H), ids, wg).reshape(11, H), want_g) <= 1e-5
    y0 = layer(torch.empty(0, H), torch.empty(0, K, dtype=torch.int32), torch.empty(0, K))
    assert y0.shape == (0, H)
    xb = x.bfloat16()
    yb = layer(xb, ids, wg)
    assert yb.dtype == torch.bfloat16 and rel(yb.float(), want_g) <= 1e-2


def test_introspection(rt, weights):
    layer = make(rt, weights)
    x = torch.randn(6, H)
    ids = torch.tensor([[0, 1]] * 3 + [[2, 1]] * 3, dtype=torch.int32)
    layer(x, ids, torch.ones(6, K))
    load = layer.expert_load()
    assert load.tolist() == [3, 6, 3, 0, 0, 0, 0, 0]
    st = layer.stats()
    assert st["total_us"] > 0 and st["rows_received"] >= 0
    assert "cpu backend" in layer.explain(6)
    assert layer.info["num_local_experts"] * rt.world == E
    assert rt.backend == "cpu" and rt.device == torch.device("cpu") and 0 <= rt.rank < rt.world
    assert libmoe.version()[0] >= 0 and os.path.isfile(libmoe.library_path())


def test_bad_inputs_raise(rt, weights):
    layer = make(rt, weights)
    own = layer.info["first_local_expert"]  # a rank keeps (and checks) only its experts
    x = torch.randn(4, H)
    ids = torch.zeros(4, K, dtype=torch.int32)
    w = torch.ones(4, K)
    bad = [
        (lambda: layer(x.double()), TypeError, "dtype"),
        (lambda: layer(x.half()), TypeError, "dtype"),
        (lambda: layer([1.0] * H), TypeError, "torch.Tensor"),
        (lambda: layer(torch.randn(4, H + 1)), ValueError, "hidden"),
        (lambda: layer(torch.randn(H, 4).T), ValueError, "contiguous"),
        (lambda: layer(torch.randn(65, H)), libmoe.MoEError, "max_tokens_per_rank"),
        (lambda: layer(x, ids), ValueError, "both or neither"),
        (lambda: layer(x, ids.long(), w), TypeError, "topk_ids.dtype"),
        (lambda: layer(x, ids, w.double()), TypeError, "topk_weights.dtype"),
        (lambda: layer(x, ids[:3], w[:3]), ValueError, "shape"),
        (lambda: layer(x, ids + E, w), libmoe.MoEError, "given_topk_ids[0][0] = 8"),
        (lambda: layer(x, ids - 1, w), libmoe.MoEError, "0..num_experts-1"),
        (lambda: layer(x, ids, w * float("nan")), libmoe.MoEError, "not finite"),
        (lambda: layer(x, ids, w, router_logits=torch.zeros(4, E)), ValueError, "one routing"),
        (lambda: layer(x, router_logits=torch.zeros(4, E + 1)), ValueError, "shape"),
        (lambda: layer.set_weight("nope", 0, w), ValueError, "weight kind"),
        (lambda: layer.set_weight("gate_proj", own, torch.randn(I, H + 1)),
         libmoe.MoEError, "INVALID_ARGUMENT"),
        (lambda: layer.set_weight("gate_proj", 0, torch.randn(2, I, H)), ValueError, "matrix"),
        (lambda: layer.set_weight("gate_proj", 0, torch.randn(I, H).double()), TypeError,
         "dtype"),
        (lambda: layer.set_weight("gate_proj", 0, "w"), TypeError, "torch.Tensor"),
        (lambda: layer.set_weight("gate_proj", own, torch.full((I, H), float("inf"))),
         libmoe.MoEError, "NUMERIC_ERROR"),
        (lambda: layer.explain(-1), libmoe.MoEError, "num_tokens"),
        (lambda: libmoe.MoELayer(rt, num_experts=4, top_k=5, hidden=H, intermediate=I),
         libmoe.MoEError, "top_k"),
        (lambda: libmoe.MoELayer(rt, num_experts=4, top_k=1, hidden=H, intermediate=I,
                                 scoring="nope"), ValueError, "scoring"),
        (lambda: libmoe.MoELayer(rt, num_experts=4, top_k=1, hidden=H, intermediate=I,
                                 dtype=torch.int8), TypeError, "dtype"),
        (lambda: libmoe.MoELayer(rt, num_experts=4, top_k=1, hidden=H, intermediate=I,
                                 fp8_math="w8a8_fast"), libmoe.MoEError,
         "MOE_FP8_MATH_W8A8_FAST needs weight_dtype FP8_E4M3"),
        (lambda: libmoe.MoELayer(rt, num_experts=4, top_k=1, hidden=H, intermediate=I,
                                 fp8_math="fast"), ValueError, "fp8_math"),
    ]
    if torch.cuda.is_available():
        bad.append((lambda: layer(x.cuda()), ValueError, "is on cuda"))
    else:
        bad.append((lambda: layer(x.to("meta")), ValueError, "is on meta"))
    for i, (call, exc, words) in enumerate(bad):
        with pytest.raises(exc) as info:
            call()
        assert words in str(info.value), f"case {i}: {info.value!r}"
    # the layer still works, its error messages come from moe_last_error()
    assert torch.isfinite(layer(x, ids, w)).all()
    with pytest.raises(libmoe.MoEError) as info:
        layer(x, ids + E, w)
    assert info.value.status == "MOE_STATUS_INVALID_ARGUMENT"


def test_missing_weights_and_destroyed(rt, weights):
    with libmoe.Runtime(backend="cpu") as rt2:
        layer = libmoe.MoELayer(rt2, num_experts=E, top_k=K, hidden=H, intermediate=I,
                                dtype=torch.float32, max_tokens_per_rank=8)
        with pytest.raises(libmoe.MoEError, match="not set"):
            layer(torch.randn(2, H))
        layer2 = make(rt2, weights)
    for call in (lambda: layer2(torch.randn(2, H)), lambda: layer2.explain(1),
                 lambda: layer2.set_weight("router", -1, weights["router"]),
                 lambda: rt2.max_tokens(3)):
        with pytest.raises(libmoe.MoEError, match="destroyed"):
            call()
    layer3 = make(rt, weights)
    layer3.close()
    with pytest.raises(libmoe.MoEError, match="destroyed"):
        layer3(torch.randn(2, H))


def test_max_tokens_collective(rt):
    assert rt.max_tokens(5 + rt.rank) == 5 + rt.world - 1


def test_library_lookup_error():
    code = ("import os, libmoe\n"
            "try:\n    libmoe.Runtime()\nexcept ImportError as e:\n    print(e)\n")
    env = dict(os.environ, LIBMOE_LIBRARY="/nonexistent/libmoe.so")
    for k in [k for k in env if k.startswith(("OMPI_", "PMIX_", "PMI_"))]:
        env.pop(k)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "/nonexistent/libmoe.so (LIBMOE_LIBRARY: no such file)" in out.stdout, out.stderr


CHECK_C = r"""
#include <stdio.h>
#include <stddef.h>
#include "moe/moe.h"
#define S(t) printf(#t " %zu\n", sizeof(t));
#define O(t, f) printf(#t "." #f " %zu\n", offsetof(t, f));
int main(void) {
  S(moe_runtime_config_t) S(moe_runtime_info_t) S(moe_layer_config_t) S(moe_layer_info_t)
  S(moe_tensor_t) S(moe_forward_args_t) S(moe_layer_stats_t)
  O(moe_runtime_info_t, workspace_bytes) O(moe_layer_config_t, ep_round_tokens)
  O(moe_layer_config_t, fp8_math) O(moe_layer_config_t, num_redundant_experts)
  O(moe_layer_info_t, ep_round_tokens)
  O(moe_forward_args_t, given_topk_weights) O(moe_forward_args_t, max_tokens_across_ranks)
  O(moe_layer_stats_t, bytes_sent) O(moe_tensor_t, scale_cols)
  return 0;
}
"""


def test_structs_match_header(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to read the header's layout")
    inc = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "include")
    src, exe = tmp_path / "layout.c", tmp_path / "layout"
    src.write_text(CHECK_C)
    subprocess.run([cc, "-std=c11", "-I", inc, str(src), "-o", str(exe)], check=True)
    got = dict(line.rsplit(" ", 1) for line in
               subprocess.run([str(exe)], capture_output=True, text=True).stdout.splitlines())
    py = {"moe_runtime_config_t": _lib.RuntimeConfig, "moe_runtime_info_t": _lib.RuntimeInfo,
          "moe_layer_config_t": _lib.LayerConfig, "moe_layer_info_t": _lib.LayerInfo,
          "moe_tensor_t": _lib.Tensor, "moe_forward_args_t": _lib.ForwardArgs,
          "moe_layer_stats_t": _lib.LayerStats}
    for key, value in got.items():
        if "." in key:
            t, f = key.split(".")
            assert getattr(py[t], f).offset == int(value), key
        else:
            assert ctypes.sizeof(py[key]) == int(value), key


def test_torch_compile_fullgraph_one_op(rt, weights):
    """torch.compile(fullgraph=True) takes the layer as one opaque op (aot_eager here: no C++
    compiler needed; the GPU tests use inductor)."""
    layer = make(rt, weights)
    ops = []

    def count_ops(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def step(x, ids, w):
        return layer(x * 2.0, ids, w) + 1.0

    x = torch.randn(5, H)
    ids = torch.tensor([[1, 2]] * 5, dtype=torch.int32)
    w = torch.rand(5, K)
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend=count_ops)(x, ids, w)
    assert torch.equal(got, step(x, ids, w))
    assert sum("libmoe.layer_forward" in o for o in ops) == 1, ops
    got2 = torch.compile(step, fullgraph=True, backend="aot_eager")(x, ids, w)
    assert torch.equal(got2, step(x, ids, w))
