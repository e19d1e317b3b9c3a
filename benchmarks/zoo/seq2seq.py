"""Encoder-decoder: a source sequence, the target shifted right into the decoder.

The zoo of benchmarks/model_zoo.py: transformers families built from configs at tiny shapes
(no download, no weights), one factory per family (`autoplan benchmarks/zoo/seq2seq.py:NAME`),
dropout 0 in the configs. They follow the model contract; the default loss (cross-entropy on
`.logits`) applies.
"""

import torch
from transformers import BartConfig, BartForConditionalGeneration

VOCAB = 256
SOURCE_LEN = 32
TARGET_LEN = 16

FAMILIES = ("bart",)
"""The factories of this file, in the zoo's order."""


def bart():
    """BART encoder-decoder: learned positions (offset 2), cross-attention, tied embeddings,
    final_logits_bias."""
    return BartForConditionalGeneration(
        BartConfig(
            vocab_size=VOCAB,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_position_embeddings=SOURCE_LEN,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            encoder_layerdrop=0.0,
            decoder_layerdrop=0.0,
            use_cache=False,
        )
    )


build_model = bart
"""The contract's default factory: this file's first family."""


def example_batch(batch_size: int):
    source = torch.randint(3, VOCAB, (batch_size, SOURCE_LEN))
    target = torch.randint(3, VOCAB, (batch_size, TARGET_LEN + 1))
    return ({"input_ids": source, "decoder_input_ids": target[:, :-1]}, target[:, 1:])
