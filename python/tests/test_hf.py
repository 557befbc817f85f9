# SPDX-License-Identifier: Apache-2.0
"""Every supported transformers MoE block patched into a small random model (f32, CPU backend):
the same logits (rel <= 1e-5) and greedy tokens as the unpatched model, router logits included.
Under mpirun -np N the same holds with the experts spread over the ranks (EP)."""
import copy

import pytest
import torch

import libmoe
from conftest import FAMILIES, make_model

ROUTING = [(f, "block") for f in FAMILIES] + [
    (f, "libmoe") for f in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def prompt(rt, seed=1, length=7):
    g = torch.Generator().manual_seed(seed + 100 * rt.rank)  # each rank its own tokens
    return torch.randint(0, 96, (2, length), generator=g)


@pytest.mark.parametrize("family,routing", ROUTING)
def test_patched_model_matches(rt, family, routing):
    model = make_model(family)
    patched = copy.deepcopy(model)
    n = libmoe.patch(patched, rt, routing=routing)
    assert n == sum(1 for m in model.modules() if libmoe.supported(m)) and n >= 2
    assert not any(libmoe.supported(m) for m in patched.modules())
    ids = prompt(rt)
    rl = routing == "block"  # with routing="libmoe" the router modules do not run
    with torch.no_grad():
        ref = model(ids, output_router_logits=rl)
        out = patched(ids, output_router_logits=rl)
    err = rel(out.logits, ref.logits)
    assert err <= 1e-5, f"{family}/{routing}: logits rel err {err:.3g}"
    if routing == "block" and getattr(ref, "router_logits", None) is not None:
        assert len(out.router_logits) == len(ref.router_logits) == n
        assert torch.equal(out.router_logits[0], ref.router_logits[0])  # the same input
        for a, b in zip(out.router_logits, ref.router_logits):
            assert rel(a, b) <= 1e-5
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        want = model.generate(ids, **gen)
        got = patched.generate(ids, **gen)
    assert torch.equal(got, want), f"{family}/{routing}: greedy tokens differ"


@pytest.mark.parametrize("family", FAMILIES)
def test_block_same_output_and_shape(rt, family):
    model = make_model(family, seed=3)
    block = next(m for m in model.modules() if libmoe.supported(m))
    mod = libmoe.from_hf(block, rt)
    x = torch.randn(3, 5, block.experts.gate_up_proj.shape[-1])
    with torch.no_grad():
        want = block(x)
        got = mod(x)
    assert isinstance(got, torch.Tensor) and got.shape == want.shape == x.shape
    assert rel(got, want) <= 1e-5
    # the layer holds this rank's experts only
    info = mod.layer.info
    assert info["num_local_experts"] * rt.world == block.experts.gate_up_proj.shape[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_block(rt, family):
    """bf16: libmoe (f32 accumulation) is no farther from the f32 block with the same
    (bf16-exact) weights than transformers' bf16 block is (a whole model is not compared in
    bf16: there one rounding can flip a later layer's top-k choice either way)."""
    model = make_model(family, seed=5, dtype=torch.bfloat16)
    block = next(m for m in model.modules() if libmoe.supported(m))
    mod = libmoe.from_hf(block, rt)
    x = torch.randn(4, 6, mod.hidden).bfloat16()
    with torch.no_grad():
        truth = copy.deepcopy(block).float()(x.float())
        ref, out = block(x).float(), mod(x)
    assert out.dtype == torch.bfloat16
    e_t, e_l = rel(ref, truth), rel(out.float(), truth)
    assert e_l <= 1.5 * e_t + 1e-3, f"libmoe {e_l:.3g}, transformers {e_t:.3g} from f32"


def test_unsupported_and_limits(rt):
    with pytest.raises(TypeError, match="not a supported MoE block"):
        libmoe.from_hf(torch.nn.Linear(4, 4), rt)
    model = make_model("mixtral")
    block = next(m for m in model.modules() if libmoe.supported(m))
    with pytest.raises(ValueError, match="routing"):
        libmoe.from_hf(block, rt, routing="nope")
    mod = libmoe.from_hf(block, rt, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens = 4"):
        mod(torch.randn(1, 5, 64))
    v2 = make_model("deepseek_v2")
    b2 = next(m for m in v2.modules() if libmoe.supported(m))
    with pytest.raises(NotImplementedError, match="routing='block'"):
        libmoe.from_hf(b2, rt, routing="libmoe")


def test_compiled_block_fullgraph(rt):
    """torch.compile(fullgraph=True) of a from_hf block: the router in the graph, libmoe as one
    opaque op (aot_eager: no C++ compiler needed; the GPU tests use inductor)."""
    model = make_model("qwen2_moe", seed=4)
    block = next(m for m in model.modules() if libmoe.supported(m))
    mod = libmoe.from_hf(block, rt)
    x = torch.randn(2, 3, 64)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(mod, fullgraph=True, backend="aot_eager")(x)
        want = block(x)
    assert rel(got, want) <= 1e-5


@pytest.mark.parametrize("layout", ["tp", "all_gather_deterministic", "redundant"])
def test_layouts(rt, layout):
    """MoELayer options through from_hf: TP over every rank, all-gather dispatch with
    deterministic sums, or redundant expert slots (EPLB); the same output as the block."""
    model = make_model("deepseek_v3", seed=6)
    block = next(m for m in model.modules() if libmoe.supported(m))
    kw = {"tp": dict(tp_size=rt.world, ep_size=1),
          "all_gather_deterministic": dict(dispatch="all_gather", deterministic=1),
          "redundant": dict(num_redundant_experts=rt.world)}[layout]
    mod = libmoe.from_hf(block, rt, **kw)
    if layout == "tp":
        assert mod.layer.info["tp_size"] == rt.world
    x = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(rt.rank))
    with torch.no_grad():
        assert rel(mod(x), block(x)) <= 1e-5
    with pytest.raises(TypeError, match="come from the block"):
        libmoe.from_hf(block, rt, top_k=1)
