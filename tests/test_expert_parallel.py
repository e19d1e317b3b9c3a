"""autoplan.runtime.expert_parallel on 2 and 4 gloo ranks: transformers' MoE models (Mixtral with grouped
matmul experts, OLMoE, Qwen2-MoE with a shared expert; built from configs) with their experts sharded over
the ranks and tokens routed by all-to-all. Each rank trains on its own quarter or half of the batch (ep
borrows data-parallel ranks): the loss averaged over the ranks equals one device's on the whole batch;
non-expert gradients averaged over the ranks, and each rank's expert gradients divided by the rank count,
equal one device's (for the experts that rank holds)."""

from pathlib import Path

import pytest

from helpers.ranks import assert_every_rank_matches

ROOT = Path(__file__).resolve().parents[1]

ROUTED = """
import copy
import gc
import importlib.util
import sys
import torch
import torch.distributed as dist
from autoplan.runtime.expert_parallel import is_experts_module, shard_experts


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mixtral = load(f"{ROOT}/examples/mixtral.py", "autoplan_test_mixtral")
(mixtral.VOCAB, mixtral.HIDDEN, mixtral.INTERMEDIATE, mixtral.LAYERS, mixtral.HEADS, mixtral.KV_HEADS, mixtral.EXPERTS,
 mixtral.EXPERTS_PER_TOKEN, mixtral.SEQ_LEN) = 64, 16, 32, 2, 4, 2, 4, 2, 8
zoo = load(f"{ROOT}/benchmarks/zoo/causal_lm.py", "autoplan_test_zoo_causal_lm")
dist.init_process_group("gloo")
ranks, rank = dist.get_world_size(), dist.get_rank()
for name, build, batch, loss_fn in (("mixtral", mixtral.build_model, mixtral.example_batch, mixtral.loss_fn),
                                    ("olmoe", zoo.olmoe, zoo.example_batch, None),
                                    ("qwen2_moe", zoo.qwen2_moe, zoo.example_batch, None)):
    torch.manual_seed(0)
    model = build()
    loss_fn = loss_fn or (lambda output, targets: torch.nn.functional.cross_entropy(
        output.logits.reshape(-1, output.logits.shape[-1]), targets.reshape(-1)))
    reference = copy.deepcopy(model)
    inputs, targets = batch(2 * ranks)
    expected = loss_fn(reference(**inputs), targets)
    expected.backward()
    shards = {fqn: shard_experts(module, dist.group.WORLD) for fqn, module in list(model.named_modules())
              if is_experts_module(module)}
    assert shards, name
    mine = slice(2 * rank, 2 * rank + 2)
    loss = loss_fn(model(**{k: v[mine] for k, v in inputs.items()}), targets[mine])
    loss.backward()
    dist.all_reduce(total := loss.detach().clone())
    torch.testing.assert_close(total / ranks, expected.detach(), rtol=1e-5, atol=1e-6, msg=name)
    wanted = dict(reference.named_parameters())
    for fqn, param in model.named_parameters():
        owner, want = fqn.rsplit(".", 1)[0], wanted[fqn].grad
        if owner in shards:
            shard = shards[owner]
            assert param.shape[0] == shard.local == shard.num_experts // ranks
            want = want[shard.first:shard.first + shard.local]
            grad = param.grad / ranks
        else:
            dist.all_reduce(grad := param.grad.clone())
            grad = grad / ranks
        torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6, msg=f"{name} {fqn}")
print("rank", rank, "matches")
# free the routed modules (their forwards hold the group) before the group goes, as train.py does: a gloo group
# torn down during interpreter exit can abort the process ("terminate called without an active exception")
del model, reference, shards, loss, expected
gc.collect()
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 4])
def test_moe_models_with_experts_sharded_and_tokens_routed_train_as_one_device(tmp_path, ranks):
    script = tmp_path / "routed.py"
    script.write_text(f"ROOT = {str(ROOT)!r}\n" + ROUTED)
    assert_every_rank_matches(script, ranks)


REPLICATED = """
import copy
import gc
import importlib.util
import torch
import torch.distributed as dist
from autoplan.runtime.expert_parallel import (expert_mesh, expert_parameters, is_experts_module,
                                              reduce_expert_gradients, shard_experts)

spec = importlib.util.spec_from_file_location("autoplan_test_mixtral", f"{ROOT}/examples/mixtral.py")
mixtral = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mixtral)
(mixtral.VOCAB, mixtral.HIDDEN, mixtral.INTERMEDIATE, mixtral.LAYERS, mixtral.HEADS, mixtral.KV_HEADS, mixtral.EXPERTS,
 mixtral.EXPERTS_PER_TOKEN, mixtral.SEQ_LEN) = 64, 16, 32, 2, 4, 2, 4, 2, 8
dist.init_process_group("gloo")
dp, rank, ep = dist.get_world_size(), dist.get_rank(), 2
mesh = expert_mesh("cpu", pp=1, dp=dp, ep=ep)
torch.manual_seed(0)
model = mixtral.build_model()
reference = copy.deepcopy(model)
inputs, targets = mixtral.example_batch(2 * dp)
expected = mixtral.loss_fn(reference(**inputs), targets)
expected.backward()
shards = {fqn: shard_experts(module, mesh["ep"].get_group()) for fqn, module in list(model.named_modules())
          if is_experts_module(module)}
experts = expert_parameters(model)
assert len(experts) == 2 * len(shards)  # gate_up_proj and down_proj per layer
mine = slice(2 * rank, 2 * rank + 2)  # this data-parallel rank's samples
loss = mixtral.loss_fn(model(**{k: v[mine] for k, v in inputs.items()}), targets[mine])
loss.backward()
reduce_expert_gradients(experts, mesh["dp_mod_ep"].get_group(), dp)
wanted = dict(reference.named_parameters())
held = {id(p) for p in experts}
for fqn, param in model.named_parameters():
    want = wanted[fqn].grad
    if id(param) in held:  # this rank's experts: the ep index picks them
        shard = shards[fqn.rsplit(".", 1)[0]]
        assert shard.rank == rank % ep and shard.local == 4 // ep
        want, grad = want[shard.first:shard.first + shard.local], param.grad
    else:  # data parallelism averages the rest over every rank
        dist.all_reduce(grad := param.grad.clone())
        grad = grad / dp
    torch.testing.assert_close(grad, want, rtol=1e-4, atol=1e-6, msg=fqn)
print("rank", rank, "matches")
del model, reference, shards, experts, loss, expected, mesh  # before the groups go (see ROUTED)
gc.collect()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_experts_split_over_ep_and_replicated_over_dp_over_ep_train_as_one_device(tmp_path):
    """dp=4 with ep=2: two ep groups of two ranks each split the 4 experts, and their replicas sum the expert
    gradients (reduce_expert_gradients), as FSDP/DDP would over dp/ep ranks, divided by dp."""
    script = tmp_path / "replicated.py"
    script.write_text(f"ROOT = {str(ROOT)!r}\n" + REPLICATED)
    assert_every_rank_matches(script, 4)


def test_experts_modules_are_told_from_routers_and_plain_mlps():
    import importlib.util

    from autoplan.runtime.expert_parallel import is_experts_module

    spec = importlib.util.spec_from_file_location("autoplan_test_mixtral_find", ROOT / "examples" / "mixtral.py")
    mixtral = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mixtral)
    model = mixtral.build_model(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    found = [name for name, module in model.named_modules() if is_experts_module(module)]
    assert found == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]  # not the routers (mlp.gate)
