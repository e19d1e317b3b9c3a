"""MPT: ALiBi attention, no biases, tied head.

Built from a transformers config at tiny shapes (no download, no weights). Dropout is 0 so the
distributed program can match the single-process reference exactly. Follows the model contract
(build_model, example_batch, loss_fn); run by benchmarks/model_zoo.py.
"""

import torch
from torch.nn import functional as F
from transformers import MptConfig, MptForCausalLM

VOCAB = 256
SEQ_LEN = 32


def config() -> MptConfig:
    return MptConfig(vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=SEQ_LEN,
                     resid_pdrop=0.0, emb_pdrop=0.0, attn_config={"alibi": True}, use_cache=False)


def build_model() -> MptForCausalLM:
    return MptForCausalLM(config())


def example_batch(batch_size: int):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]


def loss_fn(output, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
