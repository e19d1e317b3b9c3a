"""Llama (Hugging Face transformers), built from a config, never downloaded.

Defaults are Llama-3-8B's shapes. Every shape is a module-level constant, so a test or benchmark can
shrink or grow the model (set e.g. LAYERS before calling build_model), or pass config overrides:
build_model(num_hidden_layers=2). llama3_8b() and llama3_70b() are Llama-3-8B and -70B by name, whatever the
constants are set to.

    autoplan examples/llama.py:llama3_8b --gpus 8
    autoplan examples/llama.py:llama3_70b --gpus 8
"""

import torch
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 128256
HIDDEN = 4096
INTERMEDIATE = 14336
LAYERS = 32
HEADS = 32
KV_HEADS = 8
SEQ_LEN = 2048


def config(**overrides) -> LlamaConfig:
    settings = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                    num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                    max_position_embeddings=SEQ_LEN, rope_theta=500000.0, tie_word_embeddings=False,
                    use_cache=False)
    settings.update(overrides)
    return LlamaConfig(**settings)


def build_model(**overrides) -> LlamaForCausalLM:
    return LlamaForCausalLM(config(**overrides))


LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8)
"""Llama-3-8B's shapes (Meta-Llama-3-8B's config.json): 8.03e9 parameters."""


def llama3_8b() -> LlamaForCausalLM:
    """Llama-3-8B, trained here on SEQ_LEN-token sequences (2048 unless changed)."""
    return build_model(**LLAMA3_8B)


LLAMA3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8)
"""Llama-3-70B's shapes (Meta-Llama-3-70B's config.json): 70.6e9 parameters."""


def llama3_70b() -> LlamaForCausalLM:
    """Llama-3-70B, trained here on SEQ_LEN-token sequences (2048 unless changed): on 8 H100s only FSDP with
    CPU offload fits it (autoplan examples/llama.py:llama3_70b --gpus 8); on 64 H100s with tp=8 sequence
    parallelism keeps a quarter less activation memory (--gpus 64 --pin tp=8)."""
    return build_model(**LLAMA3_70B)


def example_batch(batch_size: int):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
