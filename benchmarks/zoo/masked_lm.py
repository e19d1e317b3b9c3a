"""Masked language models: every position predicts its own token (a real MLM masks 15% of
them; the cost is the same).

The zoo of benchmarks/model_zoo.py: transformers families built from configs at tiny shapes
(no download, no weights), one factory per family (`autoplan benchmarks/zoo/masked_lm.py:NAME`),
dropout 0 in the configs. They follow the model contract; the default loss (cross-entropy on
`.logits`) applies.
"""

import torch
from transformers import AlbertConfig, AlbertForMaskedLM, RobertaConfig, RobertaForMaskedLM

VOCAB = 256
SEQ_LEN = 32

FAMILIES = (
    "albert",
    "roberta_mlm",
)
"""The factories of this file, in the zoo's order."""


def albert():
    """ALBERT masked-LM: one transformer layer shared by all 4 layers (cross-layer weight sharing),
    factorized embeddings (32 -> 64)."""
    return AlbertForMaskedLM(
        AlbertConfig(
            vocab_size=VOCAB,
            embedding_size=32,
            hidden_size=64,
            num_hidden_layers=4,
            num_hidden_groups=1,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=SEQ_LEN,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            classifier_dropout_prob=0.0,
        )
    )


def roberta_mlm():
    """RoBERTa masked-LM: learned positions offset by the padding index, tied MLM head with a bias."""
    return RobertaForMaskedLM(
        RobertaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=SEQ_LEN + 2,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


build_model = albert
"""The contract's default factory: this file's first family."""


def example_batch(batch_size: int):
    ids = torch.randint(3, VOCAB, (batch_size, SEQ_LEN))
    inputs = {"input_ids": ids, "attention_mask": torch.ones(batch_size, SEQ_LEN, dtype=torch.long)}
    return (inputs, ids)
