"""train.py --profile DIR (runtime.StepProfiler): the run's last steps traced with torch.profiler, one trace per
rank, each traced step a ProfilerStep span; a run too short for a warm-up step still traces what it has."""

import json

import pytest
import torch

from autoplan.runtime.components.profiling import PROFILED_STEPS, StepProfiler, trace_path


def _traced_steps(path) -> list[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return [e["name"] for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_the_last_steps_are_traced(tmp_path, steps):
    profiler = StepProfiler(tmp_path, steps, rank=3, device=torch.device("cpu"))
    weight = torch.randn(16, 16, requires_grad=True)
    for _ in range(steps):
        (weight @ weight).sum().backward()
        profiler.step()
    profiler.close()
    traced = _traced_steps(trace_path(tmp_path, 3))
    want = min(PROFILED_STEPS, steps)
    assert len(traced) == want
    assert traced[-1] == f"ProfilerStep#{steps - 1}"  # the last step, counted from 0


def test_without_a_folder_nothing_is_traced(tmp_path):
    profiler = StepProfiler(None, 4, rank=0, device=torch.device("cpu"))
    profiler.step()
    profiler.close()
    assert not list(tmp_path.iterdir())
