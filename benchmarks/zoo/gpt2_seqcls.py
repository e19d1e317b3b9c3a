"""GPT-2 sequence classification: the score is read at each sequence's last non-pad token (found
from the ids at run time), learned positions, Conv1D projections.

Built from a transformers config at tiny shapes (no download, no weights). Dropout is 0 so the
distributed program can match the single-process reference exactly. Follows the model contract
(build_model, example_batch, loss_fn); run by benchmarks/model_zoo.py.
"""

import torch
from torch.nn import functional as F
from transformers import GPT2Config, GPT2ForSequenceClassification

VOCAB = 256
SEQ_LEN = 32
LABELS = 3


def config() -> GPT2Config:
    return GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=4, pad_token_id=0,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0, num_labels=LABELS,
                      use_cache=False)


def build_model() -> GPT2ForSequenceClassification:
    return GPT2ForSequenceClassification(config())


def example_batch(batch_size: int):
    ids = torch.randint(3, VOCAB, (batch_size, SEQ_LEN))
    inputs = {"input_ids": ids, "attention_mask": torch.ones(batch_size, SEQ_LEN, dtype=torch.long)}
    return inputs, torch.randint(0, LABELS, (batch_size,))


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, targets)
