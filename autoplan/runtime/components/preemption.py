"""Save and stop on SIGUSR1: a preempted or time-limited job loses nothing.

SLURM signals a job before its time limit (job.sbatch: --signal=B:USR1@300); the script forwards USR1 to the
training processes and requeues the job once they have stopped. train.py's ranks then save a checkpoint at the
next step boundary, all of them together, and exit 0; the requeued job resumes from it (--resume).

A signal reaches the ranks at different moments, some inside a step, so each rank only notes it (the handler
does nothing else), and at every step boundary the ranks agree with one small all-reduce (MAX of a flag)
whether any of them got it. That collective runs every step: one scalar, beside the loss's own all-reduce.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

SAVE_AND_STOP_SIGNAL = signal.SIGUSR1
"""What SLURM sends before the time limit (job.sbatch's --signal=B:USR1@...)."""


class SaveAndStop:
    """Notes SIGUSR1 from when it is built (in the main thread; elsewhere Python cannot install a handler, and it
    notes nothing); requested() at a step boundary says, on every rank alike, whether any rank got it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.received = False
        self.installed = threading.current_thread() is threading.main_thread()
        self.previous = signal.signal(SAVE_AND_STOP_SIGNAL, self._note) if self.installed else None

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received = True

    def requested(self) -> bool:
        """Did any rank get the signal? A collective: call it on every rank at every step boundary."""
        if not (dist.is_available() and dist.is_initialized()):
            return self.received
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        """Give SIGUSR1 back the handler it had."""
        if self.installed:
            signal.signal(SAVE_AND_STOP_SIGNAL, self.previous if self.previous is not None else signal.SIG_DFL)
            self.installed = False


def stopped_line(steps_done: int, checkpoint: object | None) -> str:
    """What rank 0 prints when the run stops on the signal."""
    name = signal.Signals(SAVE_AND_STOP_SIGNAL).name
    if checkpoint is None:
        return (f"{name}: stopped after {steps_done} steps without a checkpoint (no --checkpoint-dir): the steps "
                f"trained are lost to a resume")
    return f"{name}: saved {checkpoint} after {steps_done} steps and stopped; --resume continues from it"
