"""runtime.context_parallel for pipeline stages, in one process (no process group: a rank's place in the cp group is
all the export needs): the share a rank cuts (torch's head-tail balancing, as runs of positions), the stages of the
from-scratch GPT and of HF Llama exported on it (boundary shapes, attention maskless and causal), transformers'
causal mask left to is_causal only where it is SDPA's own triangle, and the refusal of a mask left in a stage.
The stages' parity on 4 ranks is tests/test_context_parallel_program.py's."""

import sys
from pathlib import Path

import pytest
import torch

from autoplan.errors import UserError
from autoplan.runtime.distributed.attention_blocks import find_attention_blocks
from autoplan.runtime.distributed.context_parallel import (PipelineContextParallel, SequenceShards, causal_mask_as_is_causal,
                                               check_maskless, functional_attention, load_balanced, positions_given)
from autoplan.runtime.distributed.batches import to_device
from autoplan.runtime.distributed.split import split_model

sys.path.insert(0, str(Path(__file__).parent / "models"))
import small_gpt  # noqa: E402
import tiny_llama  # noqa: E402

LLAMA_STAGES = [("model.embed_tokens",), ("model.layers.0", "model.layers.1"), ("model.layers.2", "model.layers.3"),
                ("model.norm", "lm_head")]


class Rank:
    """The cp mesh as SequenceShards reads it: its size and this rank's place."""

    def __init__(self, rank: int, size: int = 2) -> None:
        self.rank, self._size = rank, size

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self.rank


def test_a_rank_cuts_torch_head_tail_chunks_as_runs_of_positions():
    with load_balanced(True):
        shares = [SequenceShards(Rank(r), 8, torch.device("cpu")) for r in range(2)]
    assert [s.positions.tolist() for s in shares] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [s.runs for s in shares] == [[(0, 2), (6, 2)], [(2, 4)]]
    x = torch.arange(16.0).view(2, 8)
    assert shares[0].shard(x, 1).tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    with load_balanced(False):
        assert SequenceShards(Rank(1), 8, torch.device("cpu")).positions.tolist() == [4, 5, 6, 7]


def test_a_block_gets_its_share_of_activations_and_of_a_position_table_handed_whole():
    """torchtitan's Llama hands every block `freqs_cis`, (sequence, features) complex and needing no gradient,
    and the block reads its first rows for its own sequence: the table is sharded on its rows, the activations on
    their sequence dimension; a weight-like tensor (requires grad) and other shapes pass as they are."""
    with load_balanced(True):
        shards = SequenceShards(Rank(0), 8, torch.device("cpu"))
    hidden = torch.arange(16.0).view(2, 8).requires_grad_()
    table = torch.polar(torch.ones(8, 3), torch.arange(24.0).view(8, 3))
    trained = torch.ones(8, 3, requires_grad=True)
    scale = torch.ones(3)
    args, kwargs = shards.shard_sequences(((hidden, table), {"trained": trained, "scale": scale}))
    assert args[0].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert torch.equal(args[1], table[[0, 1, 6, 7]])
    assert args[1][0:4].shape == (4, 3)  # what `freqs_cis[0:seqlen]` reads on this rank: its own positions
    assert kwargs["trained"] is trained and kwargs["scale"] is scale


def export_stages(module, stages, rank=1):
    model = module.build_model().to("meta")
    inputs, _ = module.example_batch(2)
    chain = [m for stage in stages for m in stage]
    blocks = find_attention_blocks(model, chain, to_device(inputs, "meta"))
    cp = PipelineContextParallel(Rank(rank), blocks, torch.device("cpu"))
    with cp.export(model, inputs):
        split = split_model(model, to_device(inputs, "meta"), stages, torch.device("cpu"))
    cp.prepare(split.stages)
    return split, cp


def attention_calls(split):
    return [node for stage in split.stages for graph in stage.modules() if isinstance(graph, torch.fx.GraphModule)
            for node in graph.graph.nodes if node.target is functional_attention]


@pytest.mark.parametrize("module, stages", [
    (tiny_llama, LLAMA_STAGES),
    (small_gpt, [("wte", "wpe", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "ln_f", "lm_head")])],
    ids=["hf llama", "gpt"])
def test_stages_exported_on_a_share_send_the_share_and_attend_causally_without_a_mask(module, stages):
    split, cp = export_stages(module, stages)
    seq = cp.attention.sequence_length
    assert cp.shards.positions.tolist() == [2, 3, 4, 5]
    sent = [meta[0][0] for meta in split.boundary_meta[1:-1]]
    if module is tiny_llama:  # the embeddings alone on stage 0: the whole sequence reaches the first block
        assert [shape[1] for shape in sent] == [seq, seq // 2, seq // 2]
    else:
        assert [shape[1] for shape in sent] == [seq // 2]
    assert split.boundary_meta[-1][0][0][1] == seq // 2  # the logits of the rank's share
    calls = attention_calls(split)
    assert len(calls) == 4
    for call in calls:
        assert (call.args[3:] + (None,))[0] is None and call.kwargs.get("attn_mask") is None
        assert call.args[5] if len(call.args) > 5 else call.kwargs["is_causal"]


def test_transformers_keeps_its_mask_unless_it_is_the_causal_triangle_of_positions_it_made():
    model = tiny_llama.build_model()
    inputs, _ = tiny_llama.example_batch(2)
    given = dict(inputs, position_ids=torch.arange(8).expand(2, 8))
    assert not positions_given(model, inputs) and positions_given(model, given)

    class Forwarding(torch.nn.Module):  # position ids through **kwargs
        def forward(self, input_ids, **kwargs):
            return model(input_ids, **kwargs)

    assert positions_given(Forwarding(), given) and not positions_given(Forwarding(), inputs)

    def masks(inputs, positions):
        with causal_mask_as_is_causal(positions):
            exported = torch.export.export(model, (), inputs, strict=False)
        return [n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask") for n in exported.graph.nodes
                if n.target is torch.ops.aten.scaled_dot_product_attention.default]

    assert masks(inputs, False) == [None] * 4
    assert all(m is not None for m in masks(given, True))  # its inputs' positions may pack several sequences
    padded = dict(inputs, attention_mask=torch.ones(2, 8, dtype=torch.long))
    assert all(m is not None for m in masks(padded, False))  # a padding mask is not the triangle
    plain = torch.export.export(model, (), inputs, strict=False)  # outside: transformers' own tracing answer
    assert all(n.args[3] is not None for n in plain.graph.nodes
               if n.target is torch.ops.aten.scaled_dot_product_attention.default)


def test_a_mask_left_in_a_stage_is_refused_with_the_stage_and_call():
    model = tiny_llama.build_model()
    inputs, _ = tiny_llama.example_batch(2)
    split = split_model(model, inputs, LLAMA_STAGES)  # exported without the causal path: the mask stays
    check_maskless(split.stages[0], 0)  # the embeddings attend to nothing
    with pytest.raises(UserError, match=r"stage 1's attention call \w+ takes a mask tensor \(\w+\), and "
                                        r"torch's ring attention takes is_causal or no mask"):
        check_maskless(split.stages[1], 1)
