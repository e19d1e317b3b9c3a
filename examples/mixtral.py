"""A Mixtral-architecture mixture of experts (Hugging Face transformers), built from a config.

Defaults: 8 experts, 2 active per token, scaled down from Mixtral-8x7B to ~3.5B parameters so that
it trains on one 8-GPU node (Mixtral-8x7B itself: HIDDEN=4096, INTERMEDIATE=14336, LAYERS=32,
VOCAB=32000). Experts run as grouped matmuls (transformers' "grouped_mm" experts implementation):
shapes stay static, and the FLOPs counted are those of the tokens each expert actually receives.

    autoplan examples/mixtral.py --gpus 8
    autoplan examples/mixtral.py:mixtral_8x7b --gpus 64     # Mixtral-8x7B itself (46.7B parameters)
"""

import torch
from torch.nn import functional as F
from transformers import MixtralConfig, MixtralForCausalLM

VOCAB = 32000
HIDDEN = 2048
INTERMEDIATE = 4096
LAYERS = 16
HEADS = 16
KV_HEADS = 8
EXPERTS = 8
EXPERTS_PER_TOKEN = 2
SEQ_LEN = 2048


def config(**overrides) -> MixtralConfig:
    settings = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                    num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                    num_local_experts=EXPERTS, num_experts_per_tok=EXPERTS_PER_TOKEN,
                    max_position_embeddings=SEQ_LEN, use_cache=False)
    settings.update(overrides)
    return MixtralConfig(**settings)


def build_model(**overrides) -> MixtralForCausalLM:
    return MixtralForCausalLM(config(**overrides))


def mixtral_8x7b() -> MixtralForCausalLM:
    """Mixtral-8x7B's shapes (46.7B parameters, 12.9B active per token), at this file's SEQ_LEN."""
    return build_model(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8)


def example_batch(batch_size: int):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
