"""Context parallelism in the generated program (issue 19): train.py with cp=2 (2 ranks), with dp=2 x cp=2 (4
ranks, FSDP2 over dp_shard x cp, and HSDP: dp_replicate 2 x FSDP over the cp ranks), with cp=2 inside a pp=2
pipeline (4 ranks: 1F1B, GPipe, interleaved with the first stage ending before the first block, full recompute)
and with tensor parallelism (cp=2 x tp=2: each tp rank's heads run the ring; with and without sequence
parallelism) trains like the single-device model, with and without activation recomputation, causal attention,
on HF Llama (sdpa) and the from-scratch GPT (and dp=2 x cp=2 on a tiny HF Mixtral, a mixture of experts),
and full (non-causal)
attention on a small token tagger (torch's ring without load balancing); a dp=2 x cp=2 checkpoint
(torch.distributed.checkpoint over the flattened dp_shard x cp mesh) resumes into the uninterrupted run. Plans
written as tests/test_layouts.py writes them, and planned by the search with cp pinned, as a user would
(autoplan MODEL.py --gpu cpu --pin cp=2), torchtitan's Llama among them (its blocks take the whole sequence's
freqs_cis table, sharded on its rows). One 4-process torchrun launch (tests/helpers/verify_many.py)."""

import json
from pathlib import Path

import pytest

from autoplan.api import PlanOptions, plan_model
from helpers.verify_many import BatchJob, verify_many
from test_layouts import MODELS, ModelCase, check_parity, check_resumed, mb, model_layout, resume_jobs, write_case

pytestmark = pytest.mark.slow  # one 4-process torchrun launch

STEPS = 2
TAGGER = '''
"""A token tagger: learned positions, two blocks of full (non-causal) self-attention, a class per token."""
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, WIDTH, CLASSES = 32, 8, 16, 5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        q, k, v = (t.view(*t.shape[:2], 2, WIDTH // 2).transpose(1, 2) for t in self.qkv(self.norm(x)).chunk(3, -1))
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)
        return x + self.out(attended)


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model():
    return Tagger()


def example_batch(batch_size):
    ids = torch.randint(0, VOCAB, (batch_size, SEQ))
    return ids, (ids * 3 + ids.roll(1, dims=1)) % CLASSES


def loss_fn(output, targets):
    return F.cross_entropy(output.reshape(-1, CLASSES), targets.reshape(-1))
'''
ROOT = Path(__file__).resolve().parents[1]
MIXTRAL = f'''
"""examples/mixtral.py shrunk (HF Mixtral from config, sdpa): 4 experts (top-2), 2 layers, width 16, sequence 8."""
import importlib.util

spec = importlib.util.spec_from_file_location("autoplan_cp_mixtral", "{ROOT}/examples/mixtral.py")
mixtral = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mixtral)
(mixtral.VOCAB, mixtral.HIDDEN, mixtral.INTERMEDIATE, mixtral.LAYERS, mixtral.HEADS, mixtral.KV_HEADS, mixtral.EXPERTS,
 mixtral.EXPERTS_PER_TOKEN, mixtral.SEQ_LEN) = 64, 16, 32, 2, 4, 2, 4, 2, 8
build_model, example_batch, loss_fn = mixtral.build_model, mixtral.example_batch, mixtral.loss_fn
'''
MODELS = {**MODELS, "mixtral": ModelCase(MIXTRAL, MODELS["llama"].chain_modules, MODELS["llama"].four_stages, {})}
"""A mixture of experts too: the search prices cp for MoE models (each rank routes the tokens of its share)."""
CP_LAYOUTS = {
    ("mixtral", "dp=2,zero=3,cp=2"): dict(dp_shard=2, reshard=True,
                                          cp=2, **mb(1, 4)),
    ("gpt", "cp=2, 2 accumulated micro-batches"): dict(cp=2, **mb(2, 4)),
    ("gpt", "dp=2,zero=3,cp=2"): dict(dp_shard=2, reshard=True,
                                      cp=2, **mb(1, 4)),
    ("llama", "cp=2"): dict(cp=2, **mb(1, 8)),
    ("llama", "dp=2,zero=1,cp=2"): dict(dp_shard=2, cp=2, **mb(2, 2)),
    ("gpt", "cp=2,recompute=full"): dict(cp=2, recompute="full", **mb(1, 8)),
    ("llama", "dp=2,zero=3,cp=2,recompute=selective"): dict(
        dp_shard=2, reshard=True, cp=2,
        recompute="selective", **mb(1, 4)),
    ("llama", "hsdp dp_replicate=2,cp=2"): dict(dp_replicate=2, reshard=True,
                                                cp=2, **mb(1, 4)),
    ("gpt", "cp=2,tp=2,sp=on"): dict(cp=2, tp=2, **mb(2, 4)),
    ("llama", "cp=2,tp=2,sp=off"): dict(cp=2, tp=2,
                                        sp=False, **mb(1, 8)),
    ("llama", "cp=2,tp=2,sp=on,recompute=selective"): dict(cp=2, tp=2,
                                                          recompute="selective", **mb(2, 4)),
}
STAGED_LAYOUTS = {
    ("gpt", "cp=2,pp=2,1f1b"): dict(cp=2, pp=2,
                                    schedule="1f1b", **mb(4, 2)),
    ("llama", "cp=2,pp=2,gpipe"): dict(cp=2, pp=2,
                                       schedule="gpipe", **mb(4, 2)),
    ("llama", "cp=2,pp=2,interleaved"): dict(cp=2, pp=2,
                                             virtual_stages=2,
                                             schedule="interleaved", **mb(4, 2)),
    ("gpt", "cp=2,pp=2,1f1b,recompute=full"): dict(cp=2, pp=2,
                                                   schedule="1f1b", recompute="full",
                                                   **mb(4, 2)),
}
"""cp inside pipeline stages: the chain cut in halves (four stages for the interleaved schedule, the first one the
embeddings alone, so the whole sequence crosses to the first block's stage)."""
GRADIENTS = '''
"""cp 2 x tp 2 with sequence parallelism on or off (argv[1]) on a model source (argv[0], build_model, example_batch,
loss_fn): every gradient after one forward_backward against the single-device model's; rank 0 writes the largest
difference per parameter (argv[2]). AdamW's update is blind to a gradient's scale, so a gradient summed or averaged
wrongly over the cp or tp ranks would pass the loss parity: this checks it."""
import copy
import gc
import json

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import autoplan
from autoplan.contract import call_model
from autoplan.layout import Parallelism
from autoplan.runtime.distributed.config import ParallelConfig


def main(argv):
    source, sp, out, chain, plan = argv[0], argv[1] == "on", argv[2], json.loads(argv[3]), json.loads(argv[4])
    model_code = {}
    exec(open(source).read(), model_code)
    torch.manual_seed(0)
    model = model_code["build_model"]()
    reference = copy.deepcopy(model)
    inputs, targets = model_code["example_batch"](4)
    loss_fn = model_code["loss_fn"]
    loss_fn(call_model(reference, inputs), targets).backward()
    config = ParallelConfig(Parallelism(cp=2, tp=2, sp=sp, microbatch=4), stages=(tuple(chain),),
                            tensor_parallel_plan=plan)
    parallel = autoplan.parallelize(model, config, device="cpu", loss_fn=loss_fn, example_inputs=inputs)
    parallel.forward_backward(*parallel.shard_batch(inputs, targets))
    expected, found = dict(reference.named_parameters()), {}
    for name, param in parallel.model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        found[name] = (grad - expected[name].grad).abs().max().item()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, found)
    if dist.get_rank() == 0:
        with open(out, "w") as file:
            json.dump(gathered, file)
    del parallel, model
    gc.collect()
'''
"""Run as extra jobs on 4 ranks: GRADIENT_CASES."""
GRADIENT_CASES = (("gpt", "on"), ("llama", "off"))
RESUMED = ("llama", "dp=2,zero=1,cp=2")
RESUMED_WITH_TP = ("gpt", "cp=2,tp=2,sp=on")
FULL_ATTENTION = ("tagger", "cp=2, full attention")
PINNED = {("gpt", "pin cp=2"): ("cp=2", 2), ("llama", "pin dp=2,cp=2"): ("dp=2,cp=2", 4),
          ("llama", "pin cp=2,pp=2"): ("cp=2,pp=2", 4), ("gpt", "pin cp=2,tp=2"): ("cp=2,tp=2", 4)}
"""Planned by the search: pins and GPUs."""
PINNED_FILES = {("titan llama", "pin cp=2"): (ROOT / "tests" / "models" / "titan_llama.py", "cp=2", 2)}
"""Planned by the search from a model file: torchtitan's Llama hands every block its whole `freqs_cis` table."""


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    root = tmp_path_factory.mktemp("context_parallel")
    folders = {key: write_case(root, f"{key[0]} {key[1]}", MODELS[key[0]].source, [MODELS[key[0]].chain_modules],
                               MODELS[key[0]].tensor_parallel_plan, **layout) for key, layout in CP_LAYOUTS.items()}
    folders.update({key: model_layout(root, *key, layout) for key, layout in STAGED_LAYOUTS.items()})
    folders[FULL_ATTENTION] = write_case(root, "tagger cp=2", TAGGER, [("embed", "pos", "blocks.0", "blocks.1", "head")],
                                         cp=2, **mb(2, 4))
    for (model, name), (pin, gpus) in PINNED.items():
        source = root / f"{model}_model.py"
        source.write_text(MODELS[model].source)
        folders[model, name] = root / f"{model}_planned_{pin.replace(',', '_').replace('=', '')}"
        plan_model(str(source), gpus, "cpu", PlanOptions(global_batch=8, pin=pin, out=folders[model, name]))
    for key, (source, pin, gpus) in PINNED_FILES.items():
        folders[key] = root / f"{key[0]} {key[1]}".replace(" ", "_").replace("=", "")
        plan_model(str(source), gpus, "cpu", PlanOptions(global_batch=8, pin=pin, out=folders[key]))
    keys = list(folders)
    gradients = root / "gradients.py"
    gradients.write_text(GRADIENTS)
    gradient_jobs = []
    for model, sp in GRADIENT_CASES:
        source = root / f"{model}_gradients_model.py"
        source.write_text(MODELS[model].source)
        argv = (str(source), sp, str(root / f"gradients_{model}_sp_{sp}.json"),
                json.dumps(MODELS[model].chain_modules), json.dumps(MODELS[model].tensor_parallel_plan))
        gradient_jobs.append(BatchJob(root, argv, 4, program=gradients))
    result = verify_many([folders[k] for k in keys], steps=STEPS, timeout_s=1200, nproc=4,
                         extra_jobs=[*resume_jobs(folders[RESUMED], 4, 0), *gradient_jobs,
                                     *resume_jobs(folders[RESUMED_WITH_TP], 4, 5)])
    return dict(zip(keys, result.results)), result.extra_errors, folders, root


@pytest.mark.parametrize("key", [*CP_LAYOUTS, *STAGED_LAYOUTS, FULL_ATTENTION, *PINNED, *PINNED_FILES], ids=lambda key: " ".join(key))
def test_context_parallel_program_trains_like_the_single_device_model(batch, key):
    results, _, folders, _ = batch
    check_parity(results[key])
    assert "2-way context parallel" in (folders[key] / "train.py").read_text()
    parallelism = json.loads((folders[key] / "plan.json").read_text())["parallelism"]
    assert parallelism["context_parallel_degree"] == 2
    assert parallelism["pipeline_parallel_degree"] == (2 if "pp=2" in key[1] else 1)
    assert parallelism["tensor_parallel_degree"] == (2 if "tp=2" in key[1] else 1)


def test_a_context_parallel_checkpoint_resumes_into_the_uninterrupted_run(batch):
    _, errors, folders, _ = batch
    failures = [e for e in errors[:3] if e]
    assert not failures, failures[0][-3000:]
    out = folders[RESUMED]
    check_resumed(out)


@pytest.mark.parametrize("case", GRADIENT_CASES, ids=lambda case: f"{case[0]} sp={case[1]}")
def test_with_tensor_parallelism_every_gradient_is_the_single_device_models(batch, case):
    _, errors, _, root = batch
    error = errors[3 + GRADIENT_CASES.index(case)]
    assert not error, error[-3000:]
    ranks = json.loads((root / f"gradients_{case[0]}_sp_{case[1]}.json").read_text())
    assert len(ranks) == 4 and all(len(rank) > 10 for rank in ranks)
    for rank in ranks:
        assert max(rank.values()) <= 1e-6, rank


def test_a_context_and_tensor_parallel_checkpoint_resumes_into_the_uninterrupted_run(batch):
    _, errors, folders, _ = batch
    failures = [e for e in errors[5:] if e]
    assert not failures, failures[0][-3000:]
    check_resumed(folders[RESUMED_WITH_TP])
