# SPDX-License-Identifier: Apache-2.0
"""The CUDA backend from PyTorch (skipped without a GPU; MOE_REQUIRE_GPU=1 makes that a
failure): a layer against the CPU backend, the current stream and no host synchronisation
(captured in torch.cuda.graph and replayed with new inputs), torch.compile(fullgraph=True) with
inductor, bad given ids reported at synchronize, CPU
tensors refused, a from_hf block captured in a graph, and examples/generate.py in bf16 (the same first 16 greedy tokens)."""
import os
import subprocess
import sys

import pytest
import torch

import libmoe
from conftest import make_model, require_gpu

E, K, H, I = 16, 4, 256, 512
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


@pytest.fixture(scope="module")
def grt():
    require_gpu()
    with libmoe.Runtime(backend="cuda", device=torch.cuda.current_device()) as r:
        yield r


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make(runtime, seed=0, dtype="bf16"):
    g = torch.Generator().manual_seed(seed)
    layer = libmoe.MoELayer(runtime, num_experts=E, top_k=K, hidden=H, intermediate=I,
                            num_shared_experts=1, shared_intermediate=256, dtype=dtype,
                            max_tokens_per_rank=256)
    for e in range(E):
        for kind, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            layer.set_weight(kind, e, (torch.randn(*shape, generator=g) / shape[1] ** 0.5))
    for kind, shape in (("shared_gate_proj", (256, H)), ("shared_up_proj", (256, H)),
                        ("shared_down_proj", (H, 256)), ("router", (E, H))):
        layer.set_weight(kind, -1, torch.randn(*shape, generator=g) / shape[1] ** 0.5)
    return layer


def routing(T, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    return ids, torch.rand(T, K, generator=g)


def test_against_cpu_backend(grt, rt):
    gpu, cpu = make(grt), make(rt)
    for T in (1, 7, 200):
        x = torch.randn(T, H)
        ids, w = routing(T, T)
        want = cpu(x, ids, w)
        for dt in (torch.float32, torch.bfloat16):
            got = gpu(x.to("cuda", dt), ids.cuda(), w.cuda())
            gpu.synchronize()
            assert got.device.type == "cuda" and got.dtype == dt
            assert rel(got.float().cpu(), want) <= 1e-2
        got = gpu(x.cuda())  # libmoe's own router
        assert rel(got.cpu(), cpu(x)) <= 1e-2


def test_graph_capture_and_replay(grt, rt):
    layer, ref = make(grt), make(rt)
    T = 8
    x, (ids, w) = torch.randn(T, H, device="cuda"), routing(T, 1)
    ids, w = ids.cuda(), w.cuda()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on a side stream, as torch.cuda.graph wants
        layer(x, ids, w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = layer(x, ids, w)
    for seed in (2, 3):
        x.copy_(torch.randn(T, H))
        i2, w2 = routing(T, seed)
        ids.copy_(i2)
        w.copy_(w2)
        y.fill_(float("nan"))
        g.replay()
        layer.synchronize()
        assert rel(y.cpu(), ref(x.cpu(), i2, w2)) <= 1e-2


def test_torch_compile_inductor(grt):
    layer = make(grt)
    x, (ids, w) = torch.randn(4, H, device="cuda"), routing(4, 5)
    ids, w = ids.cuda(), w.cuda()

    def step(x):
        return torch.nn.functional.silu(layer(x * 0.5, ids, w)) + x

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(x)
    assert rel(got, step(x)) <= 1e-6


def test_bad_given_ids_at_synchronize(grt):
    layer = make(grt)
    x = torch.randn(3, H, device="cuda")
    ids, w = routing(3, 7)
    ids[1, 2] = E  # out of range: found on the device, reported at synchronize
    layer(x, ids.cuda(), w.cuda())
    with pytest.raises(libmoe.MoEError, match="INVALID_ARGUMENT"):
        layer.synchronize()
    ids[1, 2] = 0
    w[0, 0] = float("nan")
    layer(x, ids.cuda(), w.cuda())
    with pytest.raises(libmoe.MoEError, match="NUMERIC_ERROR"):
        layer.synchronize()
    w[0, 0] = 1.0
    assert torch.isfinite(layer(x, ids.cuda(), w.cuda())).all()
    layer.synchronize()
    with pytest.raises(ValueError, match="is on cpu"):
        layer(x.cpu(), ids.cuda(), w.cuda())
    with pytest.raises(ValueError, match="topk_ids is on cpu"):
        layer(x, ids, w.cuda())


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_hf_block_in_graph(grt, family):
    """A from_hf block (the block's router in torch, the experts in libmoe) captured in a CUDA
    graph and replayed with new hidden states matches the transformers block."""
    model = make_model(family, dtype=torch.bfloat16).cuda()
    block = next(m for m in model.modules() if libmoe.supported(m))
    mod = libmoe.from_hf(block, grt)
    x = torch.randn(1, 5, mod.hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            mod(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = mod(x)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            g.replay()
            mod.layer.synchronize()
            want = block(x)
            assert rel(y.float(), want.float()) <= 2e-2


def test_generate_example_bf16_gpu():
    require_gpu()
    env = dict(os.environ)
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(libmoe.__file__)))
    env["PYTHONPATH"] = pkg + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "generate.py"),
                        "--device", "cuda", "--dtype", "bf16", "--new-tokens", "16"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "same tokens: yes" in r.stdout, r.stdout
