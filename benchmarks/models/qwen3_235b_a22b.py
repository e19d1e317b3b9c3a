"""Qwen3-235B-A22B's shapes (Qwen/Qwen3-235B-A22B config.json: vocabulary 151936, hidden 4096, 94 layers, all of them
mixture-of-experts, 64 query heads and 4 KV heads of 128, 128 experts of MLP 1536, top-8 with normalised weights,
untied embeddings, rope theta 1e6; 235e9 parameters, 22e9 active) as a transformers Qwen3MoeConfig, on 4096-token
sequences (benchmarks/planning_time.py --big). Built from the config, never downloaded. Self-contained: train.py
runs a copy of this file."""
import torch
from torch.nn import functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

SEQ_LEN = 4096
CFG = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
           num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
           num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
           rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)


def build_model():
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**CFG, max_position_embeddings=SEQ_LEN, use_cache=False))


def example_batch(batch_size: int):
    ids = torch.randint(0, CFG["vocab_size"], (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets):
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
