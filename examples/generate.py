#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Greedy generation with a small transformers MoE model built from a config with random weights
(no download), first as transformers runs it, then with its MoE blocks on libmoe
(libmoe.patch): the tokens must be the same.

    python examples/generate.py [--family qwen3_moe] [--device cpu|cuda] [--dtype f32|bf16]
                                [--new-tokens 16]
    mpirun -np 2 python examples/generate.py        # experts spread over the ranks (EP)
"""
import argparse
import copy
import sys
import time

import torch
import transformers as tf

import libmoe


def config(family):
    common = dict(vocab_size=512, hidden_size=256, num_attention_heads=8, num_key_value_heads=4,
                  max_position_embeddings=256, num_hidden_layers=4, tie_word_embeddings=False)
    if family == "mixtral":
        return tf.MixtralConfig(intermediate_size=512, num_local_experts=8,
                                num_experts_per_tok=2, **common)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(intermediate_size=512, moe_intermediate_size=256,
                                 shared_expert_intermediate_size=512, num_experts=16,
                                 num_experts_per_tok=4, norm_topk_prob=False, **common)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(intermediate_size=512, moe_intermediate_size=256, num_experts=16,
                                 num_experts_per_tok=4, head_dim=32, **common)
    if family == "deepseek_v3":
        common["num_key_value_heads"] = 8
        return tf.DeepseekV3Config(intermediate_size=512, moe_intermediate_size=128,
                                   n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                   topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                                   q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16,
                                   qk_nope_head_dim=16, v_head_dim=32, **common)
    raise SystemExit(f"unknown family {family}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="qwen3_moe",
                   choices=["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    dtype = torch.float32 if a.dtype == "f32" else torch.bfloat16

    torch.manual_seed(a.seed)
    model = tf.AutoModelForCausalLM.from_config(config(a.family))
    with torch.no_grad():  # weights far from the default tiny init: clear routing and tokens
        for name, w in model.named_parameters():
            if w.dim() >= 2:
                w.normal_(0.0, (4.0 if "lm_head" in name else 0.5) / w.shape[-1] ** 0.5)
    model = model.to(device=a.device, dtype=dtype).eval()

    rt = libmoe.Runtime(backend="cuda" if a.device == "cuda" else "cpu")
    prompt = torch.randint(0, model.config.vocab_size, (1, a.prompt_tokens),
                           generator=torch.Generator().manual_seed(a.seed + rt.rank))
    prompt = prompt.to(a.device)
    gen = dict(max_new_tokens=a.new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)

    with torch.no_grad():
        t0 = time.perf_counter()
        want = model.generate(prompt, **gen)[0, a.prompt_tokens:].tolist()
        t1 = time.perf_counter()
        n = libmoe.patch(model, rt)
        t2 = time.perf_counter()
        got = model.generate(prompt, **gen)[0, a.prompt_tokens:].tolist()
        t3 = time.perf_counter()
    same = got == want
    print(f"rank {rt.rank}/{rt.world}: {a.family} {a.dtype} on {a.device} ({rt.backend} backend), "
          f"{n} MoE blocks on libmoe, {a.new_tokens} new tokens")
    print(f"  transformers: {want}  ({t1 - t0:.2f} s)")
    print(f"  libmoe:       {got}  ({t3 - t2:.2f} s)")
    first = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), None)
    print(f"  same tokens: {'yes' if same else f'no (first difference at step {first})'}")
    rt.close()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
