"""benchmarks/models/deepseek_v3_16b.py (torchtitan's DeepSeek-V3 16B flavor: MLA, 64 routed experts top-6, 2 shared
experts) cut to its first 4 layers (the dense one and 3 mixture-of-experts layers), shallow enough to train on one
GPU: gpu_check.sh's moe step measures its step time and its allocated and reserved peak memory against the
prediction. Same widths, vocabulary and 4096-token sequences; train.py copies the file it imports."""

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from deepseek_v3_16b import DEEPSEEK_V3_16B, SEQ_LEN, example_batch, loss_fn  # noqa: F401 (the model contract)

LAYERS = 4


def build_model() -> DeepseekV3ForCausalLM:
    return DeepseekV3ForCausalLM(DeepseekV3Config(**{**DEEPSEEK_V3_16B, "num_hidden_layers": LAYERS},
                                                  max_position_embeddings=SEQ_LEN, use_cache=False))
