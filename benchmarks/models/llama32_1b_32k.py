"""benchmarks/models/llama32_1b.py (Llama-3.2-1B's shapes) on 32,768-token sequences: gpu_check.sh's long step
measures a step where attention dominates (and the memory that grows with the sequence: activations, logits and
the loss) against the prediction, on one GPU. train.py copies the file it imports."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llama32_1b import LLAMA32_1B, loss_fn  # noqa: F401 (the model contract)

SEQ_LEN = 32768


def build_model() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**LLAMA32_1B, max_position_embeddings=SEQ_LEN, use_cache=False))


def example_batch(batch_size: int):
    ids = torch.randint(0, LLAMA32_1B["vocab_size"], (batch_size, SEQ_LEN + 1))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]
