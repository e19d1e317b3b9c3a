"""Re-plan and resume (issue 30): a checkpoint is keyed by the model's own names, so a run continues under
another plan: FSDP dp=2 -> pp=2 -> tp=2 -> HSDP 2x2 (2 -> 4 processes), each resuming the one before's
checkpoint, continues the uninterrupted FSDP run's losses within verify's parity tolerance. And a run with
dropout on whose model brings its own loader (which, like dropout, draws from torch's generator) resumes into
the uninterrupted run's losses exactly: the checkpoint holds each rank's generators and data position, skipping
batches for a plain DataLoader, the loader's own state for one with state_dict()/load_state_dict().

Everything in ONE 4-process torchrun launch (tests/helpers/verify_many.py run_batch).
"""

import json
from pathlib import Path

import pytest

from autoplan.codegen import write_program
from autoplan.verify import PARITY_TOLERANCE
from helpers.plans import pinned_plan
from helpers.verify_many import BatchJob, run_batch

pytestmark = pytest.mark.slow  # one 4-process torchrun launch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TINY_GPT = f'''
"""examples/gpt.py (tied lm_head) at tiny sizes."""
import importlib.util
import torch
_spec = importlib.util.spec_from_file_location("autoplan_example_gpt", {str(EXAMPLES / "gpt.py")!r})
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)
VOCAB, SEQ = 64, 8

def build_model():
    return gpt.GPT(vocab=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, n_embd=16)

def example_batch(batch_size):
    idx = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return idx[:, :-1], idx[:, 1:]

loss_fn = gpt.loss_fn
'''
GPT_CHAIN = ("wte", "wpe", "blocks.0", "blocks.1", "ln_f", "lm_head")
GPT_TP_PLAN = {**{f"blocks.{i}.{m}": style for i in range(2)
                  for m, style in (("attn.qkv", "colwise"), ("attn.proj", "rowwise"), ("mlp.fc", "colwise"),
                                   ("mlp.proj", "rowwise"))},
               "wte": "rowwise", "lm_head": "colwise"}
DROPOUT_NET = '''
"""Dropout 0.3 and its own shuffled loader: 40 samples, 5 batches per rank and epoch at dp=2."""
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
STATEFUL = {stateful}

def build_model():
    return nn.Sequential(nn.Linear(5, 32), nn.Tanh(), nn.Dropout(0.3), nn.Linear(32, 2))

def example_batch(batch_size):
    return torch.randn(batch_size, 5), torch.randn(batch_size, 2)

class ResumableLoader:
    """A loader with its own position (as torchdata's StatefulDataLoader): state_dict() / load_state_dict()."""
    def __init__(self, loader):
        self.loader, self.sampler, self.taken, self.start = loader, loader.sampler, 0, 0
    def __iter__(self):  # eager, as a DataLoader's: iter() starts the epoch (drawing its seed) at once
        start, self.start = self.start, 0
        self.taken, batches = start, iter(self.loader)
        for _ in range(start):
            next(batches)
        return self._counted(batches)
    def _counted(self, batches):
        for batch in batches:
            self.taken += 1
            yield batch
    def state_dict(self):
        return {{"taken": self.taken}}
    def load_state_dict(self, state):
        self.start = state["taken"]

def make_dataloader(rank, world_size, batch_size):
    generator = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(40, 5, generator=generator), torch.randn(40, 2, generator=generator))
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=1, drop_last=True)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)
    return ResumableLoader(loader) if STATEFUL else loader
'''
PP_MB = dict(microbatches=2, microbatch=2)
GPT_LAYOUTS = {  # name: (world size, stages, Parallelism fields)
    "fsdp": (2, [GPT_CHAIN], dict(dp_shard=2, reshard=True,
                                  microbatches=1, microbatch=4)),
    "pp": (2, [GPT_CHAIN[:3], GPT_CHAIN[3:]], dict(pp=2, schedule="1f1b",
                                                   microbatches=4,
                                                   microbatch=2)),
    "tp": (2, [GPT_CHAIN], dict(tp=2, sp=True,
                                microbatches=1, microbatch=8)),
    "hsdp": (4, [GPT_CHAIN], dict(dp_replicate=2, dp_shard=2,
                                  reshard=True, microbatches=1,
                                  microbatch=2)),
}
REPLANS = ["fsdp", "pp", "tp", "hsdp"]
"""Each trains SEGMENT steps, resuming the checkpoint of the one before."""
SEGMENT = 2
DROPOUT_STEPS, DROPOUT_SAVED = 8, 3  # the resume crosses the loaders' epoch boundary (5 batches per epoch)


def _program(root: Path, name: str, source: str, stages, tensor_parallel_plan=None, **parallelism) -> Path:
    folder = root / name
    folder.mkdir()
    model_file = folder / "user_model.py"
    model_file.write_text(source)
    plan = pinned_plan(model_file, stages, tokens_per_sample=8, tensor_parallel_plan=tensor_parallel_plan,
                       **parallelism)
    write_program(plan, folder / "out", model_file)
    return folder / "out"


def _gpt_jobs(root: Path) -> list[BatchJob]:
    """The uninterrupted FSDP run, the re-planned chain (each on the ranks of the one before where it can), FSDP
    straight to HSDP."""
    outs = {name: _program(root, name, TINY_GPT, stages, GPT_TP_PLAN if name == "tp" else None, **fields)
            for name, (_, stages, fields) in GPT_LAYOUTS.items()}
    schedule = ("--decay-steps", str(SEGMENT * len(REPLANS)))  # every segment on the uninterrupted run's schedule
    common = ("--device", "cpu", "--checkpoint-dir", str(root / "gpt_checkpoints"), *schedule)
    jobs = [BatchJob(outs["fsdp"], ("--device", "cpu", "--steps", str(SEGMENT * len(REPLANS)),
                                    "--losses-out", str(root / "gpt_uninterrupted.json")), 2)]
    chain = []
    for i, name in enumerate(REPLANS):
        argv = (*common, "--steps", str(SEGMENT * (i + 1)), "--losses-out", str(root / f"gpt_{name}.json"))
        world = GPT_LAYOUTS[name][0]
        follow = chain[-1] if chain and jobs[chain[-1]].world == world else None
        chain.append(len(jobs))
        jobs.append(BatchJob(outs[name], argv + (("--resume",) if i else ()), world, same_ranks_as=follow))
    direct = ("--device", "cpu", "--checkpoint-dir", str(root / "fsdp_checkpoints"), *schedule)  # FSDP -> HSDP
    jobs.append(BatchJob(outs["fsdp"], (*direct, "--steps", str(SEGMENT)), 2))
    jobs.append(BatchJob(outs["hsdp"], (*direct, "--steps", str(2 * SEGMENT), "--resume", "--losses-out",
                                        str(root / "gpt_fsdp_to_hsdp.json")), 4))
    return jobs


def _dropout_jobs(root: Path, first_index: int) -> list[BatchJob]:
    jobs = []
    for stateful in (False, True):
        name = f"dropout_{'stateful' if stateful else 'plain'}"
        out = _program(root, name, DROPOUT_NET.format(stateful=stateful), [("0", "1", "2", "3")],
                       dp_replicate=2, microbatches=1,
                       microbatch=4)
        checkpoints = ("--checkpoint-dir", str(root / f"{name}_checkpoints"))
        saved = len(jobs)
        jobs += [
            BatchJob(out, ("--device", "cpu", "--steps", str(DROPOUT_STEPS), "--losses-out",
                           str(root / f"{name}_uninterrupted.json")), 2),
            BatchJob(out, ("--device", "cpu", "--steps", str(DROPOUT_SAVED), "--decay-steps", str(DROPOUT_STEPS),
                           *checkpoints), 2),
            BatchJob(out, ("--device", "cpu", "--steps", str(DROPOUT_STEPS), *checkpoints, "--resume",
                           "--losses-out", str(root / f"{name}_resumed.json")), 2,
                     same_ranks_as=first_index + saved + 1),
        ]
    return jobs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(root, errors of the GPT jobs, errors of the dropout jobs); the 4-process jobs last, the dropout jobs
    on ranks 0-1 while the re-planned chain's 2-process part runs on ranks 2-3."""
    root = tmp_path_factory.mktemp("replan")
    gpt = _gpt_jobs(root)
    four = [job for job in gpt if job.world == 4]  # after every 2-process job: same_ranks_as indices unchanged
    two = [job for job in gpt if job.world == 2]
    jobs = two + _dropout_jobs(root, len(two)) + four
    errors = run_batch(jobs, nproc=4, timeout_s=900)
    return root, errors[:len(two)] + errors[-len(four):], errors[len(two):-len(four)]


def _losses(root: Path, name: str) -> list[float]:
    return json.loads((root / f"{name}.json").read_text())


def test_a_checkpoint_resumes_under_another_plan(runs):
    """FSDP dp=2 -> pp=2 -> tp=2 -> HSDP 2x2 on 4 processes, and FSDP straight to HSDP: each continues the
    uninterrupted losses."""
    root, errors, _ = runs
    failed = [e for e in errors if e]
    assert not failed, failed[0][-3000:]
    uninterrupted = _losses(root, "gpt_uninterrupted")
    assert len(uninterrupted) == SEGMENT * len(REPLANS)
    for i, name in enumerate(REPLANS):
        got = _losses(root, f"gpt_{name}")
        want = uninterrupted[SEGMENT * i:SEGMENT * (i + 1)]
        assert len(got) == SEGMENT, (name, got)
        assert max(abs(g - w) for g, w in zip(got, want)) <= PARITY_TOLERANCE, (name, got, want)
    direct = _losses(root, "gpt_fsdp_to_hsdp")
    assert len(direct) == SEGMENT
    assert max(abs(g - w) for g, w in zip(direct, uninterrupted[SEGMENT:2 * SEGMENT])) <= PARITY_TOLERANCE
    assert sorted(p.name for p in (root / "gpt_checkpoints").iterdir()) == [
        f"step_{SEGMENT * (i + 1)}" for i in range(1, len(REPLANS))]


@pytest.mark.parametrize("loader", ["plain", "stateful"])
def test_a_resumed_run_with_dropout_continues_the_uninterrupted_losses(runs, loader):
    root, _, dropout_errors = runs
    assert not any(dropout_errors), next(e for e in dropout_errors if e)[-3000:]
    uninterrupted = _losses(root, f"dropout_{loader}_uninterrupted")
    assert len(uninterrupted) == DROPOUT_STEPS
    assert _losses(root, f"dropout_{loader}_resumed") == uninterrupted[DROPOUT_SAVED:]
