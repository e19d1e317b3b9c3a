"""Hugging Face Qwen3-MoE at tiny sizes (built from a config, no download): 4 routed experts, top-2, QK-norm."""

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

VOCAB, SEQ_LEN = 64, 8


def build_model():
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, max_position_embeddings=SEQ_LEN, attention_dropout=0.0, output_router_logits=False,
        use_cache=False, tie_word_embeddings=False))


def example_batch(batch_size: int):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets):
    return torch.nn.functional.cross_entropy(output.logits.reshape(-1, VOCAB), targets.reshape(-1))
