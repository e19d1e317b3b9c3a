"""torchtitan's "deepseek-v3 16B" flavor (pytorch/torchtitan torchtitan/models/deepseek_v3/__init__.py, "16B":
vocabulary 102400, hidden 2048, dense MLP 10944, 27 layers of which the first is dense, 16 heads, MLA with no
query compression (q_lora_rank 0), kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim
128, 64 routed experts of MLP 1408, top-6, 2 shared experts) as a transformers DeepseekV3Config, on 4096-token
sequences: the model of runs_frontier.csv's tt-1789-dsv3-16b-8xh100 row (benchmarks/accuracy.py). Built from
the config, never downloaded. transformers' router scores with a sigmoid and torchtitan's flavor with a
softmax; both cost the same. Self-contained: train.py runs a copy of this file."""

import torch
from torch.nn import functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

SEQ_LEN = 4096
DEEPSEEK_V3_16B = dict(
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=27, first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16,
    n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
    norm_topk_prob=False, routed_scaling_factor=1.0, q_lora_rank=None, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False)


def build_model() -> DeepseekV3ForCausalLM:
    return DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK_V3_16B, max_position_embeddings=SEQ_LEN,
                                                  use_cache=False))


def example_batch(batch_size: int):
    ids = torch.randint(0, DEEPSEEK_V3_16B["vocab_size"], (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
