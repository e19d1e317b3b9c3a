"""autoplan.runtime.distributed.context_parallel on 2 and 4 gloo ranks:

- torch's context_parallel (ring attention over sequence shards) on the CPU attention kernel: outputs and
  q/k/v gradients equal one device's SDPA on the whole sequence, causal (with torch's load balancing),
  full and grouped-query attention;
- unmodified models (HF Llama with rotary positions and grouped-query attention, the from-scratch GPT
  with learned positions) with their blocks fed sequence shards: the loss averaged over the ranks and the
  gradients averaged over them equal one device's on the whole sequence;
- the from-scratch GPT cut into two pipeline stages (runtime.split_model) exported with the blocks' sharding
  hooks in place, so each rank's stage graphs hold its shard's shapes, and their attention redirected to the
  function torch's context_parallel patches (attention_through_functional): run one after the other on the
  ranks' shards they equal one device too. (HF models staged so, and the generated program with cp inside
  pipeline stages: tests/test_context_parallel_stages.py and tests/test_context_parallel_program.py.)"""


from pathlib import Path

import pytest

from helpers.ranks import assert_every_rank_matches

MODELS = Path(__file__).parent / "models"

RING = """
import copy
import sys
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import _cp_options, context_parallel_unshard
from autoplan.runtime.distributed.context_parallel import SequenceShards, register_cpu_ring_attention, shard_block_inputs

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
register_cpu_ring_attention()
for causal, kv_heads in ((True, 4), (False, 4), (True, 2)):
    torch.manual_seed(0)
    batch, heads, seq, dim = 2, 4, 16, 8
    q = torch.randn(batch, heads, seq, dim)
    k, v = (torch.randn(batch, kv_heads, seq, dim) for _ in range(2))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, is_causal=causal, enable_gqa=kv_heads != heads)
    expected.backward(torch.ones_like(expected))
    shards = [t.clone() for t in (q, k, v)]
    balance, _cp_options.enable_load_balance = _cp_options.enable_load_balance, causal  # causal only
    with context_parallel(mesh, buffers=shards, buffer_seq_dims=[2, 2, 2]):
        mine = [t.clone().requires_grad_() for t in shards]
        out = F.scaled_dot_product_attention(*mine, is_causal=causal, enable_gqa=kv_heads != heads)
        out.backward(torch.ones_like(out))
    gathered = context_parallel_unshard(mesh, [out.detach()] + [t.grad for t in mine], [2] * 4)
    _cp_options.enable_load_balance = balance
    assert out.shape[2] == seq // dist.get_world_size()  # each rank held its share of the sequence
    for name, got, want in zip("out q k v".split(), gathered, [expected.detach()] + [t.grad for t in whole]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{name}, causal={causal}, kv_heads={kv_heads}")


def check_model(model, inputs, targets, loss_fn, blocks):
    reference = copy.deepcopy(model)
    expected = loss_fn(reference(**inputs) if isinstance(inputs, dict) else reference(inputs), targets)
    expected.backward()
    local_targets = targets.clone()
    with context_parallel(mesh, buffers=[local_targets], buffer_seq_dims=[1]):
        handles = shard_block_inputs(blocks(model), SequenceShards(mesh, targets.shape[1], torch.device("cpu")))
        assert local_targets.shape[1] == targets.shape[1] // dist.get_world_size()
        loss = loss_fn(model(**inputs) if isinstance(inputs, dict) else model(inputs), local_targets)
        loss.backward()
    for handle in handles:
        handle.remove()
    dist.all_reduce(loss := loss.detach().clone())  # every rank's mean over as many tokens
    torch.testing.assert_close(loss / dist.get_world_size(), expected.detach(), rtol=1e-5, atol=1e-6)
    for (name, param), want in zip(model.named_parameters(), reference.parameters()):
        dist.all_reduce(grad := param.grad.clone())
        torch.testing.assert_close(grad / dist.get_world_size(), want.grad, rtol=1e-4, atol=1e-6, msg=name)


sys.path.insert(0, MODELS)
import tiny_llama
import small_gpt
torch.manual_seed(0)
inputs, targets = tiny_llama.example_batch(2)
check_model(tiny_llama.build_model(attn_implementation="sdpa"), inputs, targets, tiny_llama.loss_fn,
            lambda model: model.model.layers)
torch.manual_seed(0)
inputs, targets = small_gpt.example_batch(2)
check_model(small_gpt.build_model(), inputs, targets, small_gpt.loss_fn, lambda model: model.blocks)
print("rank", dist.get_rank(), "matches")
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_ring_attention_and_models_on_sequence_shards_equal_one_device_on_the_whole_sequence(tmp_path, ranks):
    script = tmp_path / "ring.py"
    script.write_text(f"MODELS = {str(MODELS)!r}\n" + RING)
    assert_every_rank_matches(script, ranks)


STAGES = """
import copy
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from autoplan.runtime import split_model
from autoplan.runtime.distributed.context_parallel import (SequenceShards, attention_through_functional,
                                               register_cpu_ring_attention, shard_block_inputs)

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
register_cpu_ring_attention()


def check_stages(model, inputs, targets, loss_fn, blocks, stages):
    reference = copy.deepcopy(model)
    expected = loss_fn(reference(**inputs) if isinstance(inputs, dict) else reference(inputs), targets)
    expected.backward()
    shards = SequenceShards(mesh, targets.shape[1], torch.device("cpu"))
    handles = shard_block_inputs([model.get_submodule(b) for b in blocks], shards)
    split = split_model(model, inputs, stages)  # the slicing is recorded in the stages' graphs
    for handle in handles:
        handle.remove()
    assert [attention_through_functional(stage) for stage in split.stages] == [2, 2]
    assert split.boundary_meta[1][0][0][1] == targets.shape[1] // dist.get_world_size()  # a shard crosses
    local_targets = targets.clone()
    with context_parallel(mesh, buffers=[local_targets], buffer_seq_dims=[1]):
        flat = tuple(inputs.values()) if isinstance(inputs, dict) else (inputs,)
        for stage in split.stages:
            out = stage(*flat)
            flat = out if isinstance(out, tuple) else (out,)
        loss = split.loss(loss_fn)(flat, local_targets)
        loss.backward()
    dist.all_reduce(loss := loss.detach().clone())
    torch.testing.assert_close(loss / dist.get_world_size(), expected.detach(), rtol=1e-5, atol=1e-6)
    wanted = dict(reference.named_parameters())
    tied = {t.fqn for t in split.tied}
    for k, stage in enumerate(split.stages):
        for name, param in stage.named_parameters():
            fqn = split.parameter_fqns[k][name]
            if fqn in tied:  # one copy per stage: their sum is the gradient (TiedGradients)
                continue
            dist.all_reduce(grad := param.grad.clone())
            torch.testing.assert_close(grad / dist.get_world_size(), wanted[fqn].grad, rtol=1e-4, atol=1e-6, msg=fqn)


sys.path.insert(0, MODELS)
import small_gpt
torch.manual_seed(0)
model = small_gpt.build_model()
inputs, targets = small_gpt.example_batch(2)
check_stages(model, inputs, targets, small_gpt.loss_fn, [f"blocks.{i}" for i in range(4)],
             [("wte", "wpe", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "ln_f", "lm_head")])
print("rank", dist.get_rank(), "matches")
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_pipeline_stages_exported_on_sequence_shards_equal_one_device(tmp_path):
    script = tmp_path / "stages.py"
    script.write_text(f"MODELS = {str(MODELS)!r}\n" + STAGES)
    assert_every_rank_matches(script, 2)
