"""runtime.attention_blocks: where context parallelism starts handing the ranks their share of the sequence, found
by running the meta-device model on fake tensors (no process group, no memory): the block of the first attention
call, whether the chain lists the blocks or modules inside them; causal or not; and the refusals."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoplan.errors import UserError
from autoplan.runtime.distributed.attention_blocks import find_attention_blocks

sys.path.insert(0, str(Path(__file__).parent / "models"))
import small_gpt  # noqa: E402
import tiny_llama  # noqa: E402


def on_meta(build):
    with torch.device("meta"):
        return build()


def test_the_gpt_shards_from_its_first_block_whatever_the_chain_lists():
    model, (inputs, _) = on_meta(small_gpt.build_model), small_gpt.example_batch(2)
    blocks = [f"blocks.{i}" for i in range(4)]
    coarse = find_attention_blocks(model, ["wte", "wpe", *blocks, "ln_f", "lm_head"], inputs)
    assert coarse.modules == (*blocks, "ln_f", "lm_head") and coarse.first == "blocks.0"
    assert coarse.causal and coarse.sequence_length == small_gpt.SEQ
    fine = [f"{b}.{part}" for b in blocks for part in ("ln_1", "attn", "ln_2", "mlp")]
    planned = find_attention_blocks(model, ["wte", "wpe", *fine, "ln_f", "lm_head"], inputs)
    assert planned.first == "blocks.0"  # not blocks.0.attn: the block's residual add must see the share too
    assert planned.modules == ("blocks.0", *fine, "ln_f", "lm_head")
    assert next(model.parameters()).is_meta  # the model stays on the meta device


def test_hf_llama_shards_from_its_first_decoder_layer_and_its_traced_mask_counts_as_causal():
    model, (inputs, _) = on_meta(tiny_llama.build_model), tiny_llama.example_batch(2)
    assert model.config._attn_implementation == "sdpa"
    chain = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(4)), "model.norm", "lm_head"]
    blocks = find_attention_blocks(model, chain, inputs)
    assert blocks.first == "model.layers.0" and blocks.modules == tuple(chain[1:])
    assert blocks.causal and blocks.sequence_length == 8


class Block(nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.qkv, self.causal = nn.Linear(8, 24), causal

    def forward(self, x):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        return x + F.scaled_dot_product_attention(q, k, v, is_causal=self.causal).squeeze(1)


class Encoder(nn.Module):
    """Full (non-causal) attention blocks after an embedding; `causal` says which block's is causal."""

    def __init__(self, causal=(False, False)):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(Block(c) for c in causal)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x


class Attends(nn.Module):
    """Attention in the model's own forward, before any chain module returns."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        q = x.unsqueeze(1)
        return self.head(F.scaled_dot_product_attention(q, q, q).squeeze(1))


IDS = torch.zeros(2, 8, dtype=torch.long)


def test_full_attention_is_not_causal_and_the_blocks_of_a_chain_start_at_the_attention():
    blocks = find_attention_blocks(on_meta(Encoder), ["embed", "blocks.0", "blocks.1"], IDS)
    assert not blocks.causal and blocks.modules == ("blocks.0", "blocks.1") and blocks.first == "blocks.0"


def test_the_refusals_say_why():
    with pytest.raises(UserError, match="calls no torch.nn.functional.scaled_dot_product_attention"):
        find_attention_blocks(on_meta(lambda: nn.Sequential(nn.Linear(8, 8))), ["0"], torch.zeros(2, 8))
    with pytest.raises(UserError, match=r"calls it before any of its 1 chain modules has returned, so nothing "
                                        r"\(embeddings, positions\) would see the whole sequence \(use cp=1\)"):
        find_attention_blocks(on_meta(Attends), ["head"], torch.zeros(2, 8, 8))
    with pytest.raises(UserError, match="1 of this Encoder's 2 attention calls are causal and the others not"):
        find_attention_blocks(on_meta(lambda: Encoder((False, True))), ["embed", "blocks.0", "blocks.1"], IDS)
    with pytest.raises(UserError, match="'blocks.7'"):
        find_attention_blocks(on_meta(Encoder), ["embed", "blocks.7"], IDS)


def test_the_region_refuses_targets_without_the_attention_sequence():
    from autoplan.runtime.distributed.context_parallel import ContextParallelRegion

    model = on_meta(Encoder)
    blocks = find_attention_blocks(model, ["embed", "blocks.0", "blocks.1"], IDS)
    region = ContextParallelRegion(None, model, blocks)  # the cp mesh is not reached: the targets are checked first
    assert region.blocks == [model.blocks[0], model.blocks[1]]
    with pytest.raises(UserError, match=r"no target tensor has the attention's 8 tokens along dimension 1 "
                                        r"\(shapes \[\(2,\), \(2, 3\)\]\)"):
        with region((torch.zeros(2), torch.zeros(2, 3))):
            pass
