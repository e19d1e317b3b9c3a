"""Sequence parallelism through mixture-of-experts blocks (issue 28, cause 1).

Fast: chain/tensor_parallel.py decides from what each op computes (its dimension arguments, its shapes, the op
table's traits) that transformers' MoE blocks compute token by token: the (batch, sequence) -> tokens view, the
router's softmax and top-k over the experts, the sort and gathers of the routed rows, the grouped matmul and the
top-k combine. So sp=on is allowed with tp > 1 for HF Qwen3-MoE and Mixtral, each MoE block is a "sequence_local"
module of the plan (it runs on each tp rank's sequence shard), while blocks that do mix tokens stay refused with
their reason: a reshape moving the sequence into the features, expert-choice routing (a softmax over the tokens),
while OLMoE's attention (q/k norms over every head) is split with the norms' sums all-reduced over the ranks.

Pricing: under sequence parallelism each tp rank's router, experts and all-to-all see 1/tp of the tokens, and the
replicated MoE parameters' gradients are all-reduced over the tp ranks (closed form below).

Slow: `autoplan verify` (loss and every gradient, CPU/gloo) of the search's own plans: Qwen3-MoE and Mixtral at
tp=2 with sp=on, Mixtral at dp=2 x ep=2 x tp=2 with sp=on, and both at pp=2 x ep=2 x tp=2 with sp=on (4 ranks; the
stages call the MoE blocks as modules), in one launch."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from autoplan.api import PlanOptions, ProfileOptions, load_cluster, plan_model, profile_only
from autoplan.chain.tensor_parallel import tensor_parallel_facts
from autoplan.cost import calibration, comm
from autoplan.cost.context import Context
from autoplan.cost.evaluate import sequence_local_gradient_sum_s
from autoplan.cost.expert_parallel import expert_parallel_cost
from autoplan.layout import SUPPORTED
from autoplan.plan import Training

from helpers.verify_many import BatchJob, verify_many
from test_expert_parallel_program import SOURCES as MOE_SOURCES
from test_layouts import check_parity

ROOT = Path(__file__).resolve().parents[1]
HF = {"qwen3_moe": (ROOT / "tests" / "models" / "tiny_qwen3_moe.py").read_text(),
      "mixtral": MOE_SOURCES["mixtral"], "olmoe": MOE_SOURCES["olmoe"]}
"""transformers' Qwen3MoeForCausalLM, MixtralForCausalLM (examples/mixtral.py) and OlmoeForCausalLM, tiny."""

MIXING = '''
"""An attention pair (split by heads) and a block of experts that {what}."""
import torch
from torch import nn
from torch.nn import functional as F

HIDDEN, HEADS, SEQ, EXPERTS = 16, 4, 8, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.norm = nn.LayerNorm(HIDDEN)
        self.moe = Experts()

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (p(x).view(b, s, HEADS, h // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h))
        return x + self.moe(self.norm(x))


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.pairs = nn.Linear(2 * HIDDEN, 2 * HIDDEN)
        self.up = nn.Parameter(torch.randn(EXPERTS, HIDDEN, HIDDEN) / 4)

    def forward(self, x):
        b, s, h = x.shape
        tokens = x.reshape(-1, h)
{body}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(HIDDEN, 64)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    return Model()


def example_batch(batch_size):
    ids = torch.randint(0, 64, (batch_size, SEQ + 1))
    return ids[:, :-1], ids[:, 1:]


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1))
'''
BODIES = {
    # pairs of neighbouring tokens concatenated into one row's features: a reshape that moves sequence into features
    "moves the sequence into the features": (
        "        pairs = self.pairs(x.reshape(b, s // 2, 2 * h)).reshape(b, s, h)\n"
        "        return pairs + torch.einsum('th,thg->tg', tokens, self.up[self.gate(tokens).argmax(-1)]).view(b, s, h)",
        "aten.linear.default in blocks.0.moe.pairs would read a sequence shard, and it does not compute token by "
        "token: it computes along a dimension that holds several tokens"),
    # each expert chooses its tokens: the router's softmax runs over the tokens, not over the experts
    "routes by expert choice (a softmax over the tokens)": (
        "        weights = F.softmax(self.gate(tokens), dim=0)\n"
        "        return (tokens * weights.sum(-1, keepdim=True)).view(b, s, h)",
        "aten.mul.Tensor in blocks.0.moe would read a sequence shard, and it does not compute token by token: it "
        "combines a token's values with one computed from many tokens (a sum, sort or count over them)"),
    # expert choice without weights: each expert takes the tokens scoring highest for it (a top-k over the tokens)
    "picks each expert's tokens (a top-k over the tokens)": (
        "        chosen = self.gate(tokens).topk(tokens.shape[0] // 2, dim=0).indices[:, 0]\n"
        "        return torch.zeros_like(tokens).index_add(0, chosen, tokens[chosen] @ self.up[0]).view(b, s, h)",
        "aten.index.Tensor in blocks.0.moe would read a sequence shard, and it does not compute token by token: it "
        "picks tokens by a choice made across them (a top-k or count over the tokens: expert-choice routing)"),
}


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_sp")
    sources = dict(HF)
    sources.update({what: MIXING.format(what=what, body=body) for what, (body, _) in BODIES.items()})
    profiles = {}
    for i, (name, source) in enumerate(sources.items()):
        path = root / f"model{i}.py"
        path.write_text(source)
        profiles[name] = profile_only(str(path), "h100-sxm5-80gb", ProfileOptions(measure=False))
    return profiles


@pytest.mark.parametrize("model", ["qwen3_moe", "mixtral"])
def test_transformers_moe_blocks_run_on_sequence_shards(captured, model):
    facts = tensor_parallel_facts(captured[model])
    assert facts.sequence_parallel_problem == ""
    local = {fqn for fqn, style in facts.plan.items() if style == "sequence_local"}
    assert local == {"model.layers.0.mlp", "model.layers.1.mlp"}  # the whole MoE block: router, experts, combine
    ops = {op.node: op for op in captured[model].ops}
    in_blocks = [n for n, op in ops.items() if op.module.startswith("model.layers.0.mlp") and op.inputs]
    assert {facts.role.get(n) for n in in_blocks} == {"sequence_local"}
    routed = {op.op for n, op in ops.items() if n in in_blocks}
    assert {"aten.topk.default", "aten.sort.default", "aten.index.Tensor"} <= routed  # what the analysis reasoned
    # the attention stays split by heads; the experts' weights stay whole (not in a Linear pair)
    assert facts.plan["model.layers.0.self_attn.q_proj"] == "colwise"
    assert not any(".experts" in p for p in facts.sharded_parameters)


def test_olmoe_runs_its_attention_split_and_its_moe_blocks_on_sequence_shards(captured):
    """OLMoE's q/k norms span every head: each tp rank sums its heads' squares and one all-reduce joins them
    (TensorParallelFacts.rank_sums), so its attention is split and sp applies (before: whole, sp refused)."""
    facts = tensor_parallel_facts(captured["olmoe"])
    assert facts.sequence_parallel_problem == ""
    assert facts.plan["model.layers.0.self_attn.q_proj"] == "colwise"
    assert {fqn for fqn, style in facts.plan.items() if style == "sequence_local"} == {"model.layers.0.mlp",
                                                                                      "model.layers.1.mlp"}


@pytest.mark.parametrize("what", list(BODIES))
def test_a_block_that_mixes_tokens_is_still_refused_with_its_reason(captured, what):
    facts = tensor_parallel_facts(captured[what])
    assert facts.plan["blocks.0.o"] == "rowwise"  # the pairs are found: only the block's mixing refuses sp
    assert facts.sequence_parallel_problem == BODIES[what][1]
    assert "sequence_local" not in facts.plan.values()


def test_sp_prices_the_experts_router_and_all_to_all_on_one_tp_ranks_tokens(captured):
    """Closed form: at tp=2, sp=on the MoE blocks' compute is half of sp=off's (each tp rank routes its sequence
    shard); the ep all-to-all moves half the rows; and each step all-reduces the replicated MoE parameters'
    gradients (router and experts at ep = 1) over the tp ranks."""
    profile = captured["qwen3_moe"]
    ctx = Context(profile, load_cluster(4, "h100-sxm5-80gb", 8, None, None), Training(global_batch_size=8),
                  SUPPORTED)
    local = frozenset(n for n, r in ctx.facts.role.items() if r == "sequence_local")
    off, on = (ctx._ops_table(local, 2, 2, sp) for sp in (False, True))
    # each op's roofline max(FLOPs, bytes) / tp, plus its kernel launches, which do not shrink with the tokens
    gpu, launches_fwd, launches_bwd = ctx.cluster.gpu, 0.0, 0.0
    for costs, module in zip(ctx.costs.modules, ctx.chain.modules):
        for op, node in zip(costs.ops, module.ops):
            if node in local and op.kind != "view":
                launches_fwd += gpu.kernel_overhead_s
                kernels = calibration.GEMM_BACKWARD_KERNELS if op.kind == "gemm" else 1
                launches_bwd += kernels * gpu.kernel_overhead_s if op.has_backward else 0.0
    assert sum(off.forward_s) > launches_fwd > 0
    assert sum(on.forward_s) == pytest.approx((sum(off.forward_s) - launches_fwd) / 2 + launches_fwd, rel=1e-9)
    assert sum(on.backward_s) == pytest.approx((sum(off.backward_s) - launches_bwd) / 2 + launches_bwd, rel=1e-9)
    # the all-to-all of an ep=2 group moves the rows of this tp rank's tokens: half the micro-batch's
    on_ep = ctx._sharded_modules(2, 2, True, 1, 2)
    ep_group, element = ctx.group(2, 2), ctx.dtype_bytes
    for layer, u in zip(ctx.experts, ctx._expert_module):
        half = expert_parallel_cost(layer, layer.tokens / profile.batch_size * 2 / 2, element, ep_group)
        assert on_ep.all_to_all_s[u] == pytest.approx(half.all_to_all_s)
        assert half.rows == pytest.approx(layer.tokens / profile.batch_size * layer.top_k)
    moe = sum(profile.parameters[p] for p in profile.parameters if ".mlp." in p)
    assert sum(ctx.sequence_local_numel) == moe
    group = ctx.groups(replace(_parallelism(), tp=2)).tp
    assert sequence_local_gradient_sum_s([moe], 4, 1, group) == pytest.approx(
        comm.all_reduce_s(moe * 4, 2, group.link, group.nodes))


def _parallelism():
    from autoplan.plan import Parallelism

    return Parallelism()


def test_sp_with_a_pipeline_runs_moe_blocks_on_local_tokens():
    """A pipeline stage calls the model's own MoE block (runtime/distributed/expert_calls.py modules_as_calls), so sp=on with
    pp > 1 is allowed, under every schedule (it was refused: the stage's graph inlined the block)."""
    from autoplan.layout import Layout, Scope, problems

    scope = Scope(sequence_local_modules=("model.layers.0.mlp", "model.layers.1.mlp"))
    assert not problems(Layout(tp=2, sp="on", pp=2), scope)
    assert not problems(Layout(tp=2, sp="on", pp=2, schedule="1f1b"), scope)
    assert not problems(Layout(tp=2, sp="on", pp=2, schedule="zbv", virtual_stages=2), scope)


PINNED = {"qwen3_moe tp=2,sp=on": ("qwen3_moe", "tp=2,sp=on", 2),
          "mixtral tp=2,sp=on": ("mixtral", "tp=2,sp=on", 2),
          "mixtral dp=2,ep=2,tp=2,sp=on": ("mixtral", "dp=2,ep=2,tp=2,sp=on", 4),
          "qwen3_moe pp=2,ep=2,tp=2,sp=on": ("qwen3_moe", "pp=2,ep=2,tp=2,sp=on", 4),
          "mixtral pp=2,ep=2,tp=2,sp=on": ("mixtral", "pp=2,ep=2,tp=2,sp=on", 4)}
"""The pipelines' stages call the MoE blocks as modules (their graphs inlined them before, and sp was refused)."""


ROWS = '''
"""On a generated program's ranks: the tokens (rows) each MoE block's experts module receives in one forward and
backward of the plan's first batch, and its type (plain tensor or DTensor); rank 0 writes them as JSON."""
import importlib.util
import json
from pathlib import Path

import torch
import torch.distributed as dist

import autoplan


def main(argv):
    folder, out = Path(argv[0]), Path(argv[1])
    spec = importlib.util.spec_from_file_location("autoplan_moe_sp_train", folder / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    source = train.runtime.load_source(f"{train.MODEL_FILE}:{train.FACTORY}")
    config, device = train.parallel_config(False), torch.device("cpu")
    parallel = train.build_parallel_model(source, config, autoplan.init_mesh(config, device), device)
    seen = []
    for part in parallel.parts.values():
        for name, module in part.named_modules():
            if name.endswith("mlp.experts"):
                module.register_forward_pre_hook(lambda m, args: seen.append([type(args[0]).__name__,
                                                                              args[0].shape[0]]))
    data = train.runtime.TrainingData(source, train.GLOBAL_BATCH, train.SEED, parallel.rank.dp_rank, parallel.rank.dp)
    inputs, targets = data.batch(0)
    parallel.forward_backward(inputs, targets)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, seen)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"rows": gathered, "microbatch": train.MICROBATCH}))
'''
"""Run as an extra job on each plan's ranks."""


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_sp_verify")
    folders = {}
    for key, (model, pin, gpus) in PINNED.items():
        source = root / f"{model}.py"
        source.write_text(HF[model])
        folders[key] = root / key.replace(" ", "_").replace("=", "").replace(",", "_")
        plan_model(str(source), gpus, "cpu", PlanOptions(global_batch=8, pin=pin, out=folders[key]))
    rows = root / "rows.py"
    rows.write_text(ROWS)
    jobs = [BatchJob(folder, (str(folder), str(folder / "rows.json")), PINNED[key][2], program=rows)
            for key, folder in folders.items()]
    batch = verify_many(list(folders.values()), steps=2, timeout_s=1200, nproc=4, extra_jobs=jobs)
    assert not any(batch.extra_errors), batch.extra_errors
    return dict(zip(folders, batch.results)), folders


@pytest.mark.slow  # one 4-process torchrun launch
@pytest.mark.parametrize("key", list(PINNED))
def test_the_searchs_sp_plans_through_moe_blocks_train_like_one_device(verified, key):
    results, folders = verified
    plan = json.loads((folders[key] / "plan.json").read_text())
    assert plan["parallelism"]["enable_sequence_parallel"] and plan["parallelism"]["tensor_parallel_degree"] == 2
    assert {"model.layers.0.mlp", "model.layers.1.mlp"} <= {
        m for m, style in plan["tensor_parallel_plan"].items() if style == "sequence_local"}
    check_parity(results[key])
    # each tp rank's experts route its own sequence shard: half of its micro-batch's tokens, as plain tensors
    seen = json.loads((folders[key] / "rows.json").read_text())
    tokens = seen["microbatch"] * 8  # tiny models' sequence length
    for rank in seen["rows"]:
        assert rank and all(kind == "Tensor" for kind, _ in rank), rank
        assert {rows for _, rows in rank} == {tokens // 2}, (rank, tokens)


def test_a_norm_summed_over_the_ranks_is_priced_as_one_all_reduce_of_its_sum(captured):
    """OLMoE's four q/k-norm means (one per norm, per token) are the ops marked `sums_ranks`, and each costs one
    forward all-reduce of its output over the tp ranks, nothing else; the same op without the mark costs nothing."""
    from autoplan.cost.compute import TableSetting, _tp_forward

    profile = captured["olmoe"]
    ctx = Context(profile, load_cluster(4, "h100-sxm5-80gb", 8, None, None), Training(global_batch_size=8),
                  SUPPORTED)
    summed = [op for module in ctx.costs.modules for op in module.ops if op.sums_ranks]
    assert len(summed) == 4 and {op.tp_role for op in summed} == {"interior"}
    link = ctx.group(2, 2).link
    setting = TableSetting(gpu=ctx.cluster.gpu, capture_dtype="fp32", train_dtype="bf16", tp=2, microbatch=4,
                           tp_link=link, use_measured=False)
    for op in summed:
        assert op.output_bytes > 0
        assert _tp_forward(op, setting, 0.5) == pytest.approx(comm.all_reduce_s(op.output_bytes * 4 * 0.5, 2, link))
        assert _tp_forward(replace(op, sums_ranks=False), setting, 0.5) == 0.0
        assert _tp_forward(op, replace(setting, tp=1), 0.5) == 0.0
