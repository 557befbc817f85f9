# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: one CPU runtime per test session (collective under mpirun), small random
transformers MoE models built from configs (no download), and the GPU gate."""
import os

import pytest
import torch

import libmoe


@pytest.fixture(scope="session")
def rt():
    with libmoe.Runtime(backend="cpu", timeout_ms=60000) as r:
        yield r


def require_gpu():
    """Skips without a CUDA GPU (or a CUDA build), fails instead with MOE_REQUIRE_GPU=1."""
    why = None
    if not torch.cuda.is_available():
        why = "no CUDA GPU visible to torch"
    if why is None:
        try:
            libmoe.Runtime(backend="cuda").close()
        except libmoe.MoEError as e:
            why = f"libmoe has no CUDA backend here: {e}"
    if why:
        if os.environ.get("MOE_REQUIRE_GPU", "0") not in ("", "0"):
            pytest.fail(f"MOE_REQUIRE_GPU=1 but {why}")
        pytest.skip(why)


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2"]


def make_config(family):
    import transformers as tf
    common = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, tie_word_embeddings=False)
    if family == "mixtral":
        return tf.MixtralConfig(intermediate_size=96, num_hidden_layers=2, num_local_experts=8,
                                num_experts_per_tok=2, **common)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=48,
                                 shared_expert_intermediate_size=80, num_experts=8,
                                 num_experts_per_tok=3, norm_topk_prob=False,
                                 decoder_sparse_step=1, num_hidden_layers=2, **common)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=48, num_experts=8,
                                 num_experts_per_tok=2, norm_topk_prob=True, head_dim=16,
                                 decoder_sparse_step=1, num_hidden_layers=2, **common)
    mla = dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
               v_head_dim=16, num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=96,
               moe_intermediate_size=32, n_shared_experts=2, num_experts_per_tok=4,
               routed_scaling_factor=2.5, n_group=4, topk_group=2)
    common["num_key_value_heads"] = 4
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(n_routed_experts=16, norm_topk_prob=True, **mla, **common)
    if family == "deepseek_v2":
        return tf.DeepseekV2Config(n_routed_experts=16, topk_method="group_limited_greedy",
                                   **mla, **common)
    raise ValueError(family)


def make_model(family, seed=0, dtype=torch.float32):
    """A small random model of the family (weights larger than the default init, so routing and
    logits are far from ties), in eval mode."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    return model.to(dtype).eval()
