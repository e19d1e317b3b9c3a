"""Context parallelism in the generated program (issue 19): train.py with cp=2 (2 ranks) and with dp=2 x cp=2 (4
ranks, FSDP2 over dp_shard x cp, and HSDP: dp_replicate 2 x FSDP over the cp ranks) trains like the
single-device model, with and without activation recomputation, causal attention, on HF Llama (sdpa) and the from-scratch GPT, with
tensor parallelism (cp=2 x tp=2: each tp rank's heads run the ring; with and without sequence parallelism), and full (non-causal)
attention on a small token tagger (torch's ring without load balancing); a dp=2 x cp=2 checkpoint
(torch.distributed.checkpoint over the flattened dp_shard x cp mesh) resumes into the uninterrupted run. Plans
written as tests/test_layouts.py writes them, and planned by the search with cp pinned, as a user would
(autoplan MODEL.py --gpu cpu --pin cp=2). One 4-process torchrun launch (tests/helpers/verify_many.py)."""

import json

import pytest

from autoplan.api import plan_model
from helpers.verify_many import verify_many
from test_layouts import MODELS, check_parity, check_resumed, mb, resume_jobs, write_case

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
CP_LAYOUTS = {
    ("gpt", "cp=2, 2 accumulated micro-batches"): dict(context_parallel_degree=2, **mb(2, 4)),
    ("gpt", "dp=2,zero=3,cp=2"): dict(data_parallel_shard_degree=2, fsdp_reshard_after_forward="always",
                                      context_parallel_degree=2, **mb(1, 4)),
    ("llama", "cp=2"): dict(context_parallel_degree=2, **mb(1, 8)),
    ("llama", "dp=2,zero=1,cp=2"): dict(data_parallel_shard_degree=2, context_parallel_degree=2, **mb(2, 2)),
    ("gpt", "cp=2,recompute=full"): dict(context_parallel_degree=2, activation_checkpoint="full", **mb(1, 8)),
    ("llama", "dp=2,zero=3,cp=2,recompute=selective"): dict(
        data_parallel_shard_degree=2, fsdp_reshard_after_forward="always", context_parallel_degree=2,
        activation_checkpoint="selective", **mb(1, 4)),
    ("llama", "hsdp dp_replicate=2,cp=2"): dict(data_parallel_replicate_degree=2, fsdp_reshard_after_forward="always",
                                                context_parallel_degree=2, **mb(1, 4)),
    ("gpt", "cp=2,tp=2,sp=on"): dict(context_parallel_degree=2, tensor_parallel_degree=2, **mb(2, 4)),
    ("llama", "cp=2,tp=2,sp=off"): dict(context_parallel_degree=2, tensor_parallel_degree=2,
                                        enable_sequence_parallel=False, **mb(1, 8)),
    ("llama", "cp=2,tp=2,sp=on,recompute=selective"): dict(context_parallel_degree=2, tensor_parallel_degree=2,
                                                          activation_checkpoint="selective", **mb(2, 4)),
}
RESUMED = ("llama", "dp=2,zero=1,cp=2")
FULL_ATTENTION = ("tagger", "cp=2, full attention")
PINNED = {("gpt", "pin cp=2"): ("cp=2", 2), ("llama", "pin dp=2,cp=2"): ("dp=2,cp=2", 4),
          ("gpt", "pin cp=2,tp=2"): ("cp=2,tp=2", 4)}
"""Planned by the search: pins and GPUs."""


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    root = tmp_path_factory.mktemp("context_parallel")
    folders = {key: write_case(root, f"{key[0]} {key[1]}", MODELS[key[0]].source, [MODELS[key[0]].chain_modules],
                               MODELS[key[0]].tensor_parallel_plan, **layout) for key, layout in CP_LAYOUTS.items()}
    folders[FULL_ATTENTION] = write_case(root, "tagger cp=2", TAGGER, [("embed", "pos", "blocks.0", "blocks.1", "head")],
                                         context_parallel_degree=2, **mb(2, 4))
    for (model, name), (pin, gpus) in PINNED.items():
        source = root / f"{model}_model.py"
        source.write_text(MODELS[model].source)
        folders[model, name] = root / f"{model}_planned_{pin.replace(',', '_').replace('=', '')}"
        plan_model(str(source), gpus, "cpu", global_batch=8, pin=pin, out=folders[model, name])
    keys = list(folders)
    result = verify_many([folders[k] for k in keys], steps=STEPS, timeout_s=900, nproc=4,
                         extra_jobs=resume_jobs(folders[RESUMED], 4, 0))
    return dict(zip(keys, result.results)), result.extra_errors, folders


@pytest.mark.parametrize("key", [*CP_LAYOUTS, FULL_ATTENTION, *PINNED], ids=lambda key: " ".join(key))
def test_context_parallel_program_trains_like_the_single_device_model(batch, key):
    results, _, folders = batch
    check_parity(results[key])
    assert "2-way context parallel" in (folders[key] / "train.py").read_text()
    parallelism = json.loads((folders[key] / "plan.json").read_text())["parallelism"]
    assert parallelism["context_parallel_degree"] == 2
    assert parallelism["tensor_parallel_degree"] == (2 if "tp=2" in key[1] else 1)


def test_a_context_parallel_checkpoint_resumes_into_the_uninterrupted_run(batch):
    _, errors, folders = batch
    failures = [e for e in errors if e]
    assert not failures, failures[0][-3000:]
    out = folders[RESUMED]
    check_resumed(out)
