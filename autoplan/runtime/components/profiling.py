"""train.py --profile DIR: a torch.profiler trace of the run's last steps (torchtitan's profiling option), one
Chrome/Perfetto trace per rank, to see where a step's time goes (kernels, collectives, gaps between them)."""

from __future__ import annotations

from pathlib import Path

import torch

PROFILED_STEPS = 2
"""Steps traced, the run's last ones: a steady state (compilation and the allocator's growth are behind them)."""


def trace_path(folder: Path, rank: int) -> Path:
    """Where rank `rank` writes its trace."""
    return folder / f"rank{rank}.trace.json"


class StepProfiler:
    """Traces the last PROFILED_STEPS of `steps` steps (one step before them warms the profiler up) into
    trace_path(folder, rank); call step() after every training step and close() after the loop. `folder` None:
    a no-op. Each traced step is a "ProfilerStep#k" span in the trace."""

    def __init__(self, folder: Path | None, steps: int, rank: int, device: torch.device):
        self._profiler = None
        if folder is None or steps <= 0:
            return
        folder.mkdir(parents=True, exist_ok=True)
        active = min(PROFILED_STEPS, steps)
        warmup = min(1, steps - active)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        target = trace_path(folder, rank)
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=steps - active - warmup, warmup=warmup, active=active, repeat=1),
            on_trace_ready=lambda prof: prof.export_chrome_trace(str(target)))
        self._profiler.start()

    def step(self) -> None:
        if self._profiler is not None:
            self._profiler.step()

    def close(self) -> None:
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
