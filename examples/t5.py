"""T5 encoder-decoder (Hugging Face transformers), built from a config, never downloaded.

Defaults are T5-small's shapes (60M parameters). Two inputs: the encoder's token ids and the
decoder's (teacher-forced) token ids, as a dict of keyword arguments. Shapes are module-level
constants a test can shrink; build_model(**overrides) passes T5Config overrides.

    autoplan examples/t5.py --gpus 8
"""

import torch
from torch.nn import functional as F
from transformers import T5Config, T5ForConditionalGeneration

VOCAB = 32128
D_MODEL = 512
D_FF = 2048
D_KV = 64
HEADS = 8
ENCODER_LAYERS = 6
DECODER_LAYERS = 6
SOURCE_LEN = 512
TARGET_LEN = 128


def config(**overrides) -> T5Config:
    settings = dict(vocab_size=VOCAB, d_model=D_MODEL, d_ff=D_FF, d_kv=D_KV, num_heads=HEADS,
                    num_layers=ENCODER_LAYERS, num_decoder_layers=DECODER_LAYERS, use_cache=False)
    settings.update(overrides)
    return T5Config(**settings)


def build_model(**overrides) -> T5ForConditionalGeneration:
    return T5ForConditionalGeneration(config(**overrides))


def example_batch(batch_size: int):
    source = torch.randint(0, VOCAB, (batch_size, SOURCE_LEN))
    target = torch.randint(0, VOCAB, (batch_size, TARGET_LEN + 1))
    inputs = {"input_ids": source, "decoder_input_ids": target[:, :-1]}
    return inputs, target[:, 1:]


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
