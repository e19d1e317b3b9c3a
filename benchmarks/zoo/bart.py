"""BART encoder-decoder: learned positions (offset 2), cross-attention, tied embeddings, final_logits_bias.

Built from a transformers config at tiny shapes (no download, no weights). Dropout is 0 so the
distributed program can match the single-process reference exactly. Follows the model contract
(build_model, example_batch, loss_fn); run by benchmarks/model_zoo.py.
"""

import torch
from torch.nn import functional as F
from transformers import BartConfig, BartForConditionalGeneration

VOCAB = 256
SOURCE_LEN = 32
TARGET_LEN = 16


def config() -> BartConfig:
    return BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                      max_position_embeddings=SOURCE_LEN, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                      encoder_layerdrop=0.0, decoder_layerdrop=0.0, use_cache=False)


def build_model() -> BartForConditionalGeneration:
    return BartForConditionalGeneration(config())


def example_batch(batch_size: int):
    source = torch.randint(3, VOCAB, (batch_size, SOURCE_LEN))
    target = torch.randint(3, VOCAB, (batch_size, TARGET_LEN + 1))
    return {"input_ids": source, "decoder_input_ids": target[:, :-1]}, target[:, 1:]


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
