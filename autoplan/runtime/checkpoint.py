"""Save and resume training with torch.distributed.checkpoint (DCP).

Every rank writes its own shards (FSDP2 and tensor-parallel DTensors stay sharded; replicated
tensors are written once) into DIR/step_<k>/, k = optimizer steps done. A pipeline rank's stages are
saved under "stage<s>." prefixes, so a checkpoint resumes with the same pipeline split.

A checkpoint is written whole or not at all: into the hidden DIR/.step_<k>.partial/ (DCP writes its
.metadata last, once every rank's shards are in), renamed to step_<k>/ by rank 0 when complete, so a run
killed while saving leaves the checkpoints before intact. Only the newest `keep` are kept. On resume the
newest that loads is used; one that does not (a file cut short or damaged since) is passed over, and the
run says which.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from autoplan.errors import UserError

STEP_DIR = re.compile(r"step_(\d+)")
DEFAULT_KEEP = 3
"""Checkpoints kept by default (train.py --keep-checkpoints): the newest and two to fall back on should the
newest not load; 0 keeps all."""
_REASON_CHARS = 160
"""How much of a failed load's first line the run prints."""


def _options():
    """Optimizer state flattened to one key per parameter ("state.<fqn>.exp_avg",
    "param_groups.<fqn>.lr"): pipeline ranks hold different parameters, and a nested
    param_groups list would be one object that DCP writes from rank 0 only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _container(parts: Mapping[int, nn.Module], pipelined: bool) -> nn.Module:
    """One module holding this rank's parts (the model itself without a pipeline)."""
    if not pipelined:
        (module,) = parts.values()
        return module
    return nn.ModuleDict({f"stage{s}": module for s, module in sorted(parts.items())})


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _say(text: str) -> None:
    if _rank() == 0:
        print(text, flush=True)


def _reason(error: BaseException) -> str:
    """The first line of what made a load fail (DCP wraps each rank's exception in a CheckpointException)."""
    failures = getattr(error, "failures", None) or {}
    root = next((failure[0] for failure in failures.values() if isinstance(failure, tuple) and failure), error)
    lines = str(root).strip().splitlines()
    text = f"{type(root).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS - 3] + "..."


class Checkpointer:
    """Model and optimizer state of this rank's parts, saved every few steps and loaded on resume."""

    def __init__(self, directory: Path | None, parts: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer,
                 pipelined: bool, keep: int = DEFAULT_KEEP) -> None:
        if keep < 0:
            raise UserError(f"--keep-checkpoints must be 0 (all) or more, got {keep}")
        self.directory = Path(directory) if directory is not None else None
        self.model, self.optimizer = _container(parts, pipelined), optimizer
        self.keep = keep

    def due(self, steps_done: int, total_steps: int, every: int) -> bool:
        """Save now? After the last step, and every `every` steps (0: only the last), if a directory is set."""
        if self.directory is None:
            return False
        return steps_done == total_steps or (every > 0 and steps_done % every == 0)

    def complete_steps(self) -> list[int]:
        """Steps done in each complete checkpoint (a step_<k>/ with DCP's .metadata, written last), newest first."""
        if self.directory is None or not self.directory.is_dir():
            return []
        steps = [int(m.group(1)) for p in self.directory.iterdir()
                 if (m := STEP_DIR.fullmatch(p.name)) and (p / ".metadata").is_file()]
        return sorted(steps, reverse=True)

    def latest_step(self) -> int | None:
        """Steps done in the newest complete checkpoint, or None."""
        return next(iter(self.complete_steps()), None)

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=_options())
        return {"model": model_state, "optimizer": optimizer_state}

    def save(self, steps_done: int) -> Path:
        """Write DIR/step_<steps_done>/ whole or not at all (see the module's docstring); a collective."""
        import torch.distributed.checkpoint as dcp

        if self.directory is None:
            raise UserError("saving a checkpoint needs --checkpoint-dir")
        path = self.directory / f"step_{steps_done}"
        partial = self.directory / f".{path.name}.partial"
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)  # what a run killed while saving it left
        _barrier()
        dcp.save(self._state(), checkpoint_id=partial)  # returns on every rank once .metadata is written
        if _rank() == 0:
            replaced = self.directory / f".{path.name}.replaced"
            if path.exists():  # a rerun without --resume saves the same step again
                shutil.rmtree(replaced, ignore_errors=True)
                path.rename(replaced)
            partial.rename(path)
            shutil.rmtree(replaced, ignore_errors=True)
            self._prune(steps_done)
        _barrier()
        return path

    def _prune(self, saved: int) -> None:
        """Delete all but the newest `keep` complete checkpoints, never the one just saved."""
        if self.keep == 0:
            return
        others = [step for step in self.complete_steps() if step != saved]
        for step in others[self.keep - 1:]:
            shutil.rmtree(self.directory / f"step_{step}", ignore_errors=True)

    def _load_step(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=self.directory / f"step_{step}")
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=_options())

    def load(self, total_steps: int | None = None) -> int:
        """Load the newest checkpoint that loads and say which (rank 0 prints one line), passing over newer ones
        that do not; returns the steps it had done, 0 (and says so) when there is none. `total_steps`: the run's
        --steps, to say when the checkpoint leaves nothing to train. A collective: DCP hands a rank's failure to
        every rank, so all of them pass over the same checkpoints."""
        from torch.distributed.checkpoint.api import CheckpointException

        steps = self.complete_steps()
        if not steps:
            _say(f"resume: no checkpoint in {self.directory} (no step_<k>/ with a .metadata): training from step 0")
            return 0
        passed_over = []
        for step in steps:
            try:
                self._load_step(step)
            except CheckpointException as error:  # a BaseException: DCP's wrapper of every rank's failure
                passed_over.append(f"step_{step} did not load ({_reason(error)})")
                continue
            _say(self._resumed_line(step, total_steps, passed_over))
            return step
        raise UserError(f"resume: none of the {len(steps)} checkpoints in {self.directory} loads: "
                        + "; ".join(passed_over))

    def _resumed_line(self, step: int, total_steps: int | None, passed_over: list[str]) -> str:
        line = f"resume: loaded {self.directory / f'step_{step}'} ({step} steps done)"
        if passed_over:
            line += ", the newest that loads: " + "; ".join(passed_over)
        if total_steps is not None and step >= total_steps:
            line += f"; --steps is {total_steps}: nothing to train (raise --steps to train further)"
        elif total_steps is not None:
            line += f"; training steps {step} to {total_steps - 1}"
        return line
