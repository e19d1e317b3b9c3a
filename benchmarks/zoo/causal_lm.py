"""Causal language models: next-token prediction on random token ids.

The zoo of benchmarks/model_zoo.py: transformers families built from configs at tiny shapes
(no download, no weights), one factory per family (`autoplan benchmarks/zoo/causal_lm.py:NAME`),
dropout 0 in the configs. They follow the model contract; the default loss (cross-entropy on
`.logits`) applies.
"""

import torch
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    GPTBigCodeConfig,
    GPTBigCodeForCausalLM,
    GPTJConfig,
    GPTJForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    MptConfig,
    MptForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PhiConfig,
    PhiForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Starcoder2Config,
    Starcoder2ForCausalLM,
)

VOCAB = 256
SEQ_LEN = 32

FAMILIES = (
    "bloom",
    "falcon",
    "falcon_gqa",
    "gemma",
    "gpt_bigcode",
    "gpt_neox",
    "gptj",
    "mistral",
    "mixtral_moe",
    "mpt",
    "olmoe",
    "opt",
    "phi",
    "phi3",
    "qwen2",
    "qwen2_moe",
    "starcoder2",
)
"""The factories of this file, in the zoo's order."""


def bloom():
    """BLOOM: ALiBi position biases (no position embeddings), embedding LayerNorm, tied head."""
    return BloomForCausalLM(
        BloomConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            n_layer=2,
            n_head=4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cache=False,
        )
    )


def falcon():
    """Falcon (7B-style): multi-query attention, ALiBi, parallel attention + MLP block, biased linears."""
    return FalconForCausalLM(
        FalconConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            multi_query=True,
            alibi=True,
            parallel_attn=True,
            new_decoder_architecture=False,
            bias=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cache=False,
        )
    )


def falcon_gqa():
    """Falcon (40B/180B-style new decoder architecture): grouped-query attention (2 KV heads), rotary,
    parallel attention + MLP with two LayerNorms, no biases."""
    return FalconForCausalLM(
        FalconConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            new_decoder_architecture=True,
            num_kv_heads=2,
            alibi=False,
            bias=False,
            max_position_embeddings=SEQ_LEN,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cache=False,
        )
    )


def gemma():
    """Gemma: embeddings scaled by sqrt(hidden) and tied to the head, multi-query attention, GeGLU MLP."""
    return GemmaForCausalLM(
        GemmaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=SEQ_LEN,
            tie_word_embeddings=True,
            attention_dropout=0.0,
            use_cache=False,
        )
    )


def gpt_bigcode():
    """GPTBigCode (StarCoder): multi-query attention with a fused c_attn, learned positions."""
    return GPTBigCodeForCausalLM(
        GPTBigCodeConfig(
            vocab_size=VOCAB,
            n_positions=SEQ_LEN,
            n_embd=64,
            n_layer=2,
            n_head=4,
            multi_query=True,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
        )
    )


def gpt_neox():
    """GPT-NeoX: parallel residual (attention + MLP), partial rotary (rotary_pct 0.25), fused biased QKV."""
    return GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=SEQ_LEN,
            rotary_pct=0.25,
            use_parallel_residual=True,
            attention_dropout=0.0,
            hidden_dropout=0.0,
            use_cache=False,
        )
    )


def gptj():
    """GPT-J: parallel attention + MLP block, partial rotary (rotary_dim 8 of head dim 16), biased lm_head."""
    return GPTJForCausalLM(
        GPTJConfig(
            vocab_size=VOCAB,
            n_positions=SEQ_LEN,
            n_embd=64,
            n_layer=2,
            n_head=4,
            rotary_dim=8,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
        )
    )


def mistral():
    """Mistral: multi-query attention (1 KV head) with a sliding window (8 < sequence 32)."""
    return MistralForCausalLM(
        MistralConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=SEQ_LEN,
            sliding_window=8,
            attention_dropout=0.0,
            use_cache=False,
        )
    )


def mixtral_moe():
    """Mixtral: 4 routed experts (top-2), grouped-query attention, sliding window 8 (the examples' mixtral
    has none)."""
    return MixtralForCausalLM(
        MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=SEQ_LEN,
            sliding_window=8,
            attention_dropout=0.0,
            output_router_logits=False,
            use_cache=False,
        )
    )


def mpt():
    """MPT: ALiBi attention, no biases, tied head."""
    return MptForCausalLM(
        MptConfig(
            vocab_size=VOCAB,
            d_model=64,
            n_heads=4,
            n_layers=2,
            expansion_ratio=2,
            max_seq_len=SEQ_LEN,
            resid_pdrop=0.0,
            emb_pdrop=0.0,
            attn_config={"alibi": True},
            use_cache=False,
        )
    )


def olmoe():
    """OLMoE: 8 routed experts (top-2), q/k normalization."""
    return OlmoeForCausalLM(
        OlmoeConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=SEQ_LEN,
            attention_dropout=0.0,
            output_router_logits=False,
            use_cache=False,
        )
    )


def opt():
    """OPT: learned positions with an offset of 2, pre-LayerNorm, biased linears, tied head."""
    return OPTForCausalLM(
        OPTConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=SEQ_LEN,
            word_embed_proj_dim=64,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            layerdrop=0.0,
            use_cache=False,
        )
    )


def phi():
    """Phi(-2): parallel attention + MLP block, partial rotary (factor 0.5), biased lm_head."""
    return PhiForCausalLM(
        PhiConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=SEQ_LEN,
            partial_rotary_factor=0.5,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
            use_cache=False,
        )
    )


def phi3():
    """Phi-3: fused qkv and gate_up projections, grouped-query attention, sliding window (8 < sequence 32)."""
    return Phi3ForCausalLM(
        Phi3Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ_LEN,
            original_max_position_embeddings=SEQ_LEN,
            sliding_window=8,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            use_cache=False,
        )
    )


def qwen2():
    """Qwen2: grouped-query attention (4 query heads, 2 KV heads), biased q/k/v projections, sliding-window
    attention (window 8 < sequence 32) on the second layer."""
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ_LEN,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
            attention_dropout=0.0,
            tie_word_embeddings=False,
            use_cache=False,
        )
    )


def qwen2_moe():
    """Qwen2-MoE: 4 routed experts (top-2) plus a gated shared expert in every layer, grouped-query
    attention."""
    return Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
            max_position_embeddings=SEQ_LEN,
            attention_dropout=0.0,
            output_router_logits=False,
            use_cache=False,
        )
    )


def starcoder2():
    """StarCoder2: grouped-query attention, sliding window (8 < sequence 32), biased linears, LayerNorm."""
    return Starcoder2ForCausalLM(
        Starcoder2Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ_LEN,
            sliding_window=8,
            attention_dropout=0.0,
            residual_dropout=0.0,
            embedding_dropout=0.0,
            use_cache=False,
        )
    )


build_model = bloom
"""The contract's default factory: this file's first family."""


def example_batch(batch_size: int):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return ({"input_ids": ids[:, :-1]}, ids[:, 1:])
