"""benchmarks/models/chaos_gpt.py without attention-weight dropout, for the context-parallel layout of
benchmarks/chaos.py: context parallelism's ring attention runs no dropout on the attention weights, so the planner
refuses cp for the model that drops them; the embeddings', projections' and MLP's dropout stay."""

import chaos_gpt
from chaos_gpt import example_batch  # noqa: F401 (the model contract)

chaos_gpt.ATTENTION_DROPOUT = 0.0


def build_model():
    return chaos_gpt.build_model()
