"""Hugging Face DeepSeek-V3 at tiny sizes (built from a config, no download): multi-head latent attention (low-rank
q and kv with their norms, a shared rotary key), the first layer dense (first_k_dense_replace=1), then MoE layers of
4 routed experts (top-2 of 2 groups, sigmoid router with a bias) plus a shared expert."""

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

VOCAB, SEQ_LEN = 64, 8


def build_model():
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=12, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=4, max_position_embeddings=SEQ_LEN, attention_dropout=0.0,
        use_cache=False, tie_word_embeddings=False))


def example_batch(batch_size: int):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets):
    return torch.nn.functional.cross_entropy(output.logits.reshape(-1, VOCAB), targets.reshape(-1))
