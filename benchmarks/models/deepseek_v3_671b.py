"""DeepSeek-V3's shapes (deepseek-ai/DeepSeek-V3 config.json: vocabulary 129280, hidden 7168, 61 layers of which the
first 3 are dense (MLP 18432), 128 heads, MLA with q_lora_rank 1536 and kv_lora_rank 512, 256 routed experts of MLP
2048, top-8 in 4 of 8 groups, 1 shared expert; 671e9 parameters) as a transformers DeepseekV3Config, on 4096-token
sequences (benchmarks/planning_time.py --big). Built from the config, never downloaded. Self-contained: train.py
runs a copy of this file."""
import torch
from torch.nn import functional as F
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

SEQ_LEN = 4096
CFG = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
           num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128, num_key_value_heads=128,
           n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
           norm_topk_prob=True, routed_scaling_factor=2.5, q_lora_rank=1536, kv_lora_rank=512,
           qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False)


def build_model():
    return DeepseekV3ForCausalLM(DeepseekV3Config(**CFG, max_position_embeddings=SEQ_LEN, use_cache=False))


def example_batch(batch_size: int):
    ids = torch.randint(0, CFG["vocab_size"], (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets):
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
