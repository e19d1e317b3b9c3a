"""autoplan.verify on generated programs: loss parity of every layout the program supports, each
against the single-device reference (6 torchrun launches, 2 steps each), and how verify reports
hung, failing and diverging runs (with stand-in train.py files that do not import torch)."""

import json
import os
import textwrap
import time
from pathlib import Path

import pytest

from autoplan.codegen import write_program
from autoplan.errors import UserError
from autoplan.plan import ClusterRef, ModelRef, Parallelism, Plan, Prediction, SolverInfo, Stage, Training
from autoplan.verify import verify

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
    return gpt.GPT(vocab=VOCAB, seq_len=SEQ, n_layer=4, n_head=2, n_embd=16)

def example_batch(batch_size):
    idx = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return idx[:, :-1], idx[:, 1:]

loss_fn = gpt.loss_fn
'''

SKIP_NET = '''
"""Dict inputs; h and the input `scale` skip from the first stage over the second one's units."""
import torch
from torch import nn

class SkipNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.mid = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)

    def forward(self, x, scale):
        h = torch.tanh(self.embed(x))
        return self.head(self.mid(h) + h) * scale

def build_model():
    return SkipNet()

def example_batch(batch_size):
    return {"x": torch.randn(batch_size, 6), "scale": torch.rand(batch_size, 1) + 0.5}, torch.randn(batch_size, 3)
'''

GPT_STAGES = [("wte", "wpe", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3", "ln_f", "lm_head")]
GPT_UNITS = [tuple(u for stage in GPT_STAGES for u in stage)]
MLP_UNITS = [("inp", *(f"layers.{i}" for i in range(6)), "out")]


def make_plan(model_path: Path, global_batch: int, stages, **parallelism) -> Plan:
    par = Parallelism(**parallelism)
    return Plan(
        model=ModelRef(path=str(model_path)),
        cluster=ClusterRef(gpu="cpu", num_gpus=par.world_size, gpus_per_node=8, memory_per_gpu_bytes=2**30),
        training=Training(global_batch_size=global_batch, learning_rate=1e-2, seed=3),
        parallelism=par,
        stages=tuple(Stage(index=i, modules=tuple(m), predicted_time_s=0.01, predicted_memory_bytes=1e6)
                     for i, m in enumerate(stages)),
        predicted=Prediction(step_time_s=0.05, samples_per_s=160.0, tokens_per_s=None, model_flops_per_step=1e6,
                             mfu=0.1, peak_memory_bytes=1e6),
        solver=SolverInfo(name="pinned", status="optimal", time_s=0.0, candidates_evaluated=1),
    )


def write_out(tmp_path: Path, model_text: str | None, plan_args: tuple, model_file: Path | None = None) -> Path:
    if model_file is None:
        model_file = tmp_path / "user_model.py"
        model_file.write_text(model_text)
    plan = make_plan(model_file, *plan_args[:2], **plan_args[2])
    out = tmp_path / "out"
    write_program(plan, out, model_file)
    (out / "plan.json").write_text(plan.to_json())
    return out


CASES = {
    "mlp dp=2 DDP, 2 accumulated micro-batches": (
        None, EXAMPLES / "mlp.py", (8, MLP_UNITS, dict(data_parallel_replicate_degree=2,
                                                       pipeline_parallel_num_microbatches=2, pipeline_parallel_microbatch_size=2))),
    "gpt dp=2 FSDP2 zero 3, 2 accumulated micro-batches, full recompute": (
        TINY_GPT, None, (8, GPT_UNITS, dict(data_parallel_shard_degree=2, zero_stage=3, activation_checkpoint="full",
                                            pipeline_parallel_num_microbatches=2, pipeline_parallel_microbatch_size=2))),
    "gpt pp=2 gpipe, tied lm_head across stages": (
        TINY_GPT, None, (8, GPT_STAGES, dict(pipeline_parallel_degree=2, pipeline_parallel_schedule="gpipe",
                                             pipeline_parallel_num_microbatches=4, pipeline_parallel_microbatch_size=2))),
    "skip net pp=2 1f1b, 4 micro-batches, dict inputs, full recompute": (
        SKIP_NET, None, (8, [("embed",), ("mid", "head")], dict(
            pipeline_parallel_degree=2, pipeline_parallel_schedule="1f1b", activation_checkpoint="full",
            pipeline_parallel_num_microbatches=4, pipeline_parallel_microbatch_size=2))),
    "gpt dp=2 DDP x pp=2 gpipe": (
        TINY_GPT, None, (8, GPT_STAGES, dict(data_parallel_replicate_degree=2, pipeline_parallel_degree=2,
                                             pipeline_parallel_schedule="gpipe", pipeline_parallel_num_microbatches=2,
                                             pipeline_parallel_microbatch_size=2))),
    "gpt dp=2 FSDP2 x pp=2 1f1b": (
        TINY_GPT, None, (8, GPT_STAGES, dict(data_parallel_shard_degree=2, zero_stage=3, pipeline_parallel_degree=2,
                                             pipeline_parallel_schedule="1f1b", pipeline_parallel_num_microbatches=2,
                                             pipeline_parallel_microbatch_size=2))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_parity_with_the_single_device_reference(tmp_path, case):
    model_text, model_file, plan_args = CASES[case]
    out = write_out(tmp_path, model_text, plan_args, model_file)
    measure = case.startswith("mlp")  # one case also measures step time and memory
    result = verify(out, steps=2, timeout_s=240, measure=measure)
    assert result.passed, (result.reference_losses, result.losses)
    assert result.parity_max_abs_diff <= 1e-4
    report = json.loads((out / "verify.json").read_text())
    assert report["nproc"] == make_plan(Path("m.py"), *plan_args[:2], **plan_args[2]).parallelism.world_size
    assert len(report["losses"]) == len(report["reference_losses"]) == 2
    assert report["reference_losses"][0] != report["reference_losses"][1]  # step 2 sees the update
    if measure:
        assert report["measured_step_time_s"] > 0 and report["measured_peak_memory_bytes"] > 2**20
        assert report["predicted_step_time_s"] == 0.05


def test_nproc_other_than_the_plan_is_rejected_with_the_arithmetic(tmp_path):
    out = write_out(tmp_path, TINY_GPT, CASES["gpt dp=2 DDP x pp=2 gpipe"][2])
    with pytest.raises(UserError, match=r"--nproc 2 .* dp 2 x tp 1 x pp 2 = 4 processes"):
        verify(out, nproc=2)


def fake_program(tmp_path: Path, body: str) -> Path:
    """A plan folder whose train.py is a stand-in (no torch import: starts fast)."""
    out = write_out(tmp_path, SKIP_NET, (4, [("embed", "mid", "head")], dict(data_parallel_replicate_degree=2,
                                                                            pipeline_parallel_microbatch_size=2)))
    header = "import json, os, sys, time\nreference = '--reference' in sys.argv\n" \
             "out = sys.argv[sys.argv.index('--losses-out') + 1]\nrank = int(os.environ.get('RANK', 0))\n"
    (out / "train.py").write_text(header + textwrap.dedent(body))
    return out


def test_a_hung_run_is_killed_with_its_whole_process_group(tmp_path):
    out = fake_program(tmp_path, f"""
        open({str(tmp_path)!r} + f"/pid.{{os.getpid()}}", "w").close()
        print("waiting forever", file=sys.stderr, flush=True)
        time.sleep(600)
    """)
    with pytest.raises(UserError, match=r"reference run did not finish within 6 s(.|\n)*waiting forever"):
        verify(out, timeout_s=6)
    pids = [int(p.name.split(".")[1]) for p in tmp_path.glob("pid.*")]
    assert len(pids) >= 2  # the reference and at least one rank had started
    deadline = time.monotonic() + 5  # SIGKILL is delivered asynchronously to the group's members
    while time.monotonic() < deadline and any(is_alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(is_alive(pid) for pid in pids)


def is_alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a parent that never reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_failing_rank_is_reported_with_its_traceback(tmp_path):
    out = fake_program(tmp_path, """
        if not reference and rank == 1:
            raise RuntimeError("stage 1 blew up")
        if reference or rank == 0:
            json.dump([1.0, 0.5], open(out, "w"))
    """)
    with pytest.raises(UserError, match=r"distributed run \(2 processes\) failed(.|\n)*stage 1 blew up"):
        verify(out, steps=2)


def test_diverging_losses_fail_and_are_written_down(tmp_path):
    out = fake_program(tmp_path, """
        if reference or rank == 0:
            json.dump([1.0, 0.5] if reference else [1.0, 0.4], open(out, "w"))
    """)
    result = verify(out, steps=2)
    assert not result.passed and result.parity_max_abs_diff == pytest.approx(0.1)
    report = json.loads((out / "verify.json").read_text())
    assert report["passed"] is False and report["losses"] == [1.0, 0.4]
