"""Save and resume training with torch.distributed.checkpoint (DCP).

Every rank writes its own shards (FSDP2 and tensor-parallel DTensors stay sharded; replicated
tensors are written once) into DIR/step_<k>/, k = optimizer steps done. A pipeline rank's stages are
saved under "stage<s>." prefixes, so a checkpoint resumes with the same pipeline split.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from autoplan.errors import UserError

STEP_DIR = re.compile(r"step_(\d+)")


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


class Checkpointer:
    """Model and optimizer state of this rank's parts, saved every few steps and loaded on resume."""

    def __init__(self, directory: Path | None, parts: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer,
                 pipelined: bool) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.model, self.optimizer = _container(parts, pipelined), optimizer

    def due(self, steps_done: int, total_steps: int, every: int) -> bool:
        """Save now? After the last step, and every `every` steps (0: only the last), if a directory is set."""
        if self.directory is None:
            return False
        return steps_done == total_steps or (every > 0 and steps_done % every == 0)

    def latest_step(self) -> int | None:
        """Steps done in the newest complete checkpoint (DCP writes .metadata last), or None."""
        if self.directory is None or not self.directory.is_dir():
            return None
        steps = [int(m.group(1)) for p in self.directory.iterdir()
                 if (m := STEP_DIR.fullmatch(p.name)) and (p / ".metadata").is_file()]
        return max(steps, default=None)

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=_options())
        return {"model": model_state, "optimizer": optimizer_state}

    def save(self, steps_done: int) -> Path:
        import torch.distributed.checkpoint as dcp

        if self.directory is None:
            raise UserError("saving a checkpoint needs --checkpoint-dir")
        path = self.directory / f"step_{steps_done}"
        dcp.save(self._state(), checkpoint_id=path)
        return path

    def load(self) -> int:
        """Load the newest checkpoint; returns the steps it had done (0 if there is none)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        step = self.latest_step()
        if step is None:
            return 0
        state = self._state()
        dcp.load(state, checkpoint_id=self.directory / f"step_{step}")
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=_options())
        return step
