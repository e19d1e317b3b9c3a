"""GPT-2 (Hugging Face transformers), built from a config, never downloaded.

Defaults are GPT-2 small's shapes (124M parameters, LM head tied to the token embedding). Shapes are
module-level constants a test can shrink; build_model(**overrides) passes GPT2Config overrides.

    autoplan examples/hf_gpt2.py --gpus 8
"""

import torch
from torch.nn import functional as F
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 50257
HIDDEN = 768
LAYERS = 12
HEADS = 12
SEQ_LEN = 1024


def config(**overrides) -> GPT2Config:
    settings = dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=SEQ_LEN,
                    bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, use_cache=False)
    settings.update(overrides)
    return GPT2Config(**settings)


def build_model(**overrides) -> GPT2LMHeadModel:
    return GPT2LMHeadModel(config(**overrides))


def example_batch(batch_size: int):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
