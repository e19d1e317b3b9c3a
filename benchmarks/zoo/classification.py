"""Sequence classification: one label per sequence.

The zoo of benchmarks/model_zoo.py: transformers families built from configs at tiny shapes
(no download, no weights), one factory per family (`autoplan benchmarks/zoo/classification.py:NAME`),
dropout 0 in the configs. They follow the model contract; the default loss (cross-entropy on
`.logits`) applies.
"""

import torch
from transformers import (
    DebertaV2Config,
    DebertaV2ForSequenceClassification,
    GPT2Config,
    GPT2ForSequenceClassification,
)

VOCAB = 256
SEQ_LEN = 32
LABELS = 3

FAMILIES = (
    "deberta_v2",
    "gpt2_seqcls",
)
"""The factories of this file, in the zoo's order."""


def deberta_v2():
    """DeBERTa-v2 sequence classification: disentangled relative attention (c2p + p2c, log buckets),
    pooler."""
    return DebertaV2ForSequenceClassification(
        DebertaV2Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=SEQ_LEN,
            relative_attention=True,
            position_buckets=16,
            max_relative_positions=SEQ_LEN,
            pos_att_type=["p2c", "c2p"],
            position_biased_input=False,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pooler_dropout=0.0,
            num_labels=LABELS,
        )
    )


def gpt2_seqcls():
    """GPT-2 sequence classification: the score is read at each sequence's last non-pad token (found from
    the ids at run time), learned positions, Conv1D projections."""
    return GPT2ForSequenceClassification(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ_LEN,
            n_embd=64,
            n_layer=2,
            n_head=4,
            pad_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            summary_first_dropout=0.0,
            num_labels=LABELS,
            use_cache=False,
        )
    )


build_model = deberta_v2
"""The contract's default factory: this file's first family."""


def example_batch(batch_size: int):
    ids = torch.randint(3, VOCAB, (batch_size, SEQ_LEN))
    inputs = {"input_ids": ids, "attention_mask": torch.ones(batch_size, SEQ_LEN, dtype=torch.long)}
    return (inputs, torch.randint(0, LABELS, (batch_size,)))
