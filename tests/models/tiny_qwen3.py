"""Hugging Face Qwen3 (per-head RMSNorm on queries and keys between q_proj/k_proj and attention) built from a
tiny Qwen3Config, never downloaded. `build_moe` builds Qwen3-MoE at the same sizes."""

import torch
from torch.nn import functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM, SEQ_LEN = 64, 32, 64, 2, 4, 2, 8, 8


def build_model() -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=SEQ_LEN, tie_word_embeddings=False, use_cache=False))


def build_moe() -> Qwen3MoeForCausalLM:
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, moe_intermediate_size=INTERMEDIATE // 2,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ_LEN, tie_word_embeddings=False,
        use_cache=False))


def example_batch(batch_size: int):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
