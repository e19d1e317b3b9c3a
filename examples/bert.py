"""BERT masked-language model (Hugging Face transformers), built from a config, never downloaded.

Defaults are BERT-base's shapes (110M parameters). The batch is a dict of three tensors (token ids,
attention mask, segment ids), passed to forward as keyword arguments. Shapes are module-level
constants a test can shrink; build_model(**overrides) passes BertConfig overrides.

    autoplan examples/bert.py --gpus 8
"""

import torch
from torch.nn import functional as F
from transformers import BertConfig, BertForMaskedLM

VOCAB = 30522
HIDDEN = 768
INTERMEDIATE = 3072
LAYERS = 12
HEADS = 12
SEQ_LEN = 512


def config(**overrides) -> BertConfig:
    settings = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                    num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=SEQ_LEN)
    settings.update(overrides)
    return BertConfig(**settings)


def build_model(**overrides) -> BertForMaskedLM:
    return BertForMaskedLM(config(**overrides))


def example_batch(batch_size: int):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN))
    inputs = {
        "input_ids": ids,
        "attention_mask": torch.ones(batch_size, SEQ_LEN, dtype=torch.long),
        "token_type_ids": torch.zeros(batch_size, SEQ_LEN, dtype=torch.long),
    }
    return inputs, ids  # predict every token (a real MLM masks 15% of them; the cost is the same)


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
