"""Save and resume training with torch.distributed.checkpoint (DCP).

Every rank writes its own shards (FSDP2 and tensor-parallel DTensors stay sharded; replicated
tensors are written once) into DIR/step_<k>/, k = optimizer steps done.

Keys are the model's own names, whatever the split (what torchtitan does: each model part's state dict
merged under the original FQNs): a pipeline stage's names map to the model's by PipelineSplit.state_fqns, the
names wrappers add (DDP, activation checkpointing, torch.compile) are dropped (DCP's get_state_dict), and a
tensor with several names (a tied embedding and head) is stored once, under its first name in the model's
named_parameters order. The optimizer's state is flattened to one key per parameter under the same names
("state.<fqn>.exp_avg", "param_groups.<fqn>.lr"). So a checkpoint of any plan loads into any other (dp, FSDP,
HSDP, tp, pp, another number of processes): DCP reads each rank's share of every tensor from the shards saved.

Beside the shards each rank writes its train state, DIR/step_<k>/train_state_rank<r>.pt: its random
number generators (torch's CPU and CUDA generators, which dropout draws from, DTensor's included; Python's
`random`) and its data position (a make_dataloader loader's own state_dict() where it has one, e.g. torchdata's
StatefulDataLoader; else the steps done, and the loader skips that many batches). A resume under the same
layout (mesh shape) restores them, so a run with dropout continues the uninterrupted run's losses; under
another layout the ranks draw other streams anyway, and the run says it did not restore them.

A checkpoint is written whole or not at all: into the hidden DIR/.step_<k>.partial/ (each rank's train
state first, then DCP, which writes its .metadata last, once every rank's shards are in), renamed to
step_<k>/ by rank 0 when complete, so a run killed while saving leaves the checkpoints before intact. Only
the newest `keep` are kept. On resume the newest that loads is used; one that does not (a file cut short or
damaged since, or one of another model) is passed over, and the run says which.
"""

from __future__ import annotations

import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from autoplan.errors import UserError

STEP_DIR = re.compile(r"step_(\d+)")
TRAIN_STATE = "train_state_rank{rank}.pt"
"""Each rank's random number generators and data position, in the checkpoint's folder."""
DEFAULT_KEEP = 3
"""Checkpoints kept by default (train.py --keep-checkpoints): the newest and two to fall back on should the
newest not load; 0 keeps all."""
_REASON_CHARS = 160
"""How much of a failed load's first line the run prints."""
_OPTIMIZER_SECTIONS = ("state.", "param_groups.")
"""The prefixes of a flattened optimizer state dict's keys: "<section><parameter fqn>.<field>"."""


def _options(strict: bool = True):
    """Optimizer state flattened to one key per parameter ("state.<fqn>.exp_avg",
    "param_groups.<fqn>.lr"): pipeline ranks hold different parameters, and a nested
    param_groups list would be one object that DCP writes from rank 0 only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True, strict=strict)


def first_names(model: nn.Module) -> dict[str, str]:
    """Every name of each of the model's parameters and buffers -> the tensor's first name (named_parameters /
    named_buffers order), the one checkpoints store it under."""
    first: dict[int, str] = {}
    names: dict[str, str] = {}
    for fqn, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names[fqn] = first.setdefault(id(tensor), fqn)
    return names


class StateNames:
    """This rank's state-dict keys (DCP's get_state_dict of its parts) <-> the model's own names."""

    def __init__(self, parts: Mapping[int, nn.Module], state_fqns: list[dict[str, str]] | None,
                 model_names: Mapping[str, str]) -> None:
        self.pipelined = state_fqns is not None
        self.module = (nn.ModuleDict({f"stage{s}": module for s, module in sorted(parts.items())})
                       if self.pipelined else next(iter(parts.values())))
        if not self.pipelined and len(parts) != 1:
            raise ValueError(f"without a pipeline a rank holds one part, got stages {sorted(parts)}")
        self.state_fqns, self.model_names = state_fqns, model_names

    def model_name(self, key: str) -> str | None:
        """The model's name for a key of the parts' state dict ("stage<s>.<name in the stage>" with a
        pipeline), None for a stage's tensor that is not the model's (a constant the export lifted)."""
        if self.pipelined:
            stage, _, name = key.partition(".")
            fqn = self.state_fqns[int(stage.removeprefix("stage"))].get(name)
            if fqn is None:
                return None
        else:
            fqn = key
        return self.model_names.get(fqn, fqn)

    def to_model(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """A model state dict under the model's names (a tensor held twice, e.g. a tied weight: once)."""
        renamed: dict[str, Any] = {}
        for key, value in state.items():
            name = self.model_name(key)
            if name is not None:
                renamed.setdefault(name, value)
        return renamed

    def from_model(self, keys: list[str], state: Mapping[str, Any]) -> dict[str, Any]:
        """The parts' state dict `keys` filled from one under the model's names."""
        return {key: state[name] for key in keys if (name := self.model_name(key)) is not None}

    def optimizer_key(self, key: str) -> str | None:
        section = next(s for s in _OPTIMIZER_SECTIONS if key.startswith(s))
        parameter, _, field = key[len(section):].rpartition(".")
        name = self.model_name(parameter)
        return None if name is None else f"{section}{name}.{field}"

    def optimizer_to_model(self, state: Mapping[str, Any]) -> dict[str, Any]:
        renamed: dict[str, Any] = {}
        for key, value in state.items():
            name = self.optimizer_key(key)
            if name is not None:
                renamed.setdefault(name, value)
        return renamed

    def optimizer_from_model(self, keys: list[str], state: Mapping[str, Any]) -> dict[str, Any]:
        return {key: state[name] for key in keys if (name := self.optimizer_key(key)) is not None}


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is on any (a collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32)
    backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    value = value.to(backend_device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _first_problem(problem: str | None) -> str | None:
    """The first rank's problem, on every rank (a collective); None when no rank has one."""
    if not (dist.is_available() and dist.is_initialized()):
        return problem
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((f"rank {r}'s {p}" for r, p in enumerate(problems) if p is not None), None)


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


def rng_state() -> dict[str, Any]:
    """This process's random number generators: torch's CPU generator, every CUDA device's (dropout and DTensor's
    offset-based RNG draw from these), Python's `random`."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _layout(model: Any) -> tuple:
    """What must match for a rank's generators and data position to carry over: the world size and mesh."""
    mesh = getattr(model, "mesh", None)
    if mesh is None:
        return (_world(),)
    return (_world(), tuple(mesh.mesh_dim_names or ()), tuple(mesh.shape))


def _parts_of(model: Any) -> tuple[dict[int, nn.Module], list[dict[str, str]] | None, Mapping[str, str]]:
    """(parts, stage names -> the model's, every model name -> first name) of an autoplan.Parallelized or a
    plain module."""
    if isinstance(model, nn.Module):
        return {0: model}, None, first_names(model)
    split = model.split
    return dict(model.parts), (split.state_fqns if split is not None else None), model.model_names


class Checkpointer:
    """Model and optimizer state of this rank's parts, its generators and data position, saved every few steps
    and loaded on resume.

    model: the autoplan.Parallelized the run trains (or, in one process, the model itself); data: the run's
    runtime.TrainingData, whose position goes with each checkpoint (None: the steps done only)."""

    def __init__(self, directory: Path | None, model: Any, optimizer: torch.optim.Optimizer,
                 keep: int = DEFAULT_KEEP, data: Any = None) -> None:
        if keep < 0:
            raise UserError(f"--keep-checkpoints must be 0 (all) or more, got {keep}")
        self.directory = Path(directory) if directory is not None else None
        parts, state_fqns, model_names = _parts_of(model)
        self.names = StateNames(parts, state_fqns, model_names)
        self.model, self.optimizer = self.names.module, optimizer
        self.keep, self.data, self.layout = keep, data, _layout(model)

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

    def _parts_state(self) -> tuple[dict, dict]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(self.model, self.optimizer, options=_options())

    def _state(self) -> dict:
        """Model and optimizer state under the model's own names (see the module's docstring)."""
        model_state, optimizer_state = self._parts_state()
        return {"model": self.names.to_model(model_state), "optimizer": self.names.optimizer_to_model(optimizer_state)}

    def _train_state(self, steps_done: int) -> dict:
        data = self.data.position() if self.data is not None else None
        return {"steps_done": steps_done, "layout": self.layout, "rng": rng_state(), "data": data}

    def save(self, steps_done: int) -> Path:
        """Write DIR/step_<steps_done>/ whole or not at all (see the module's docstring); a collective."""
        import torch.distributed.checkpoint as dcp

        if self.directory is None:
            raise UserError("saving a checkpoint needs --checkpoint-dir")
        path = self.directory / f"step_{steps_done}"
        partial = self.directory / f".{path.name}.partial"
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)  # what a run killed while saving it left
            partial.mkdir(parents=True)
        _barrier()
        torch.save(self._train_state(steps_done), partial / TRAIN_STATE.format(rank=_rank()))
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

    def _read_train_state(self, step: int) -> tuple[dict | None, str | None]:
        """This rank's train state in step_<step>/ (None if the checkpoint has none for it) and why it does not
        load (None if it does)."""
        path = self.directory / f"step_{step}" / TRAIN_STATE.format(rank=_rank())
        if not path.is_file():
            return None, None
        try:
            return torch.load(path, weights_only=True), None
        except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as error:
            return None, f"{path.name}: {_reason(error)}"  # cut short, damaged, or not torch.save's

    def _load_step(self, step: int) -> dict | None:
        """Load step_<step>/ into the parts and the optimizer; this rank's train state (None without one). Raises
        CheckpointException on every rank when a rank's part does not load."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import set_state_dict

        train_state, problem = self._read_train_state(step)
        problem = _first_problem(problem)  # every rank passes over the checkpoint together
        if problem is not None:
            raise CheckpointException("train state", {_rank(): (ValueError(problem), None)})
        model_state, optimizer_state = self._parts_state()
        state = {"model": self.names.to_model(model_state), "optimizer": self.names.optimizer_to_model(optimizer_state)}
        dcp.load(state, checkpoint_id=self.directory / f"step_{step}")  # in place, resharded to this layout
        set_state_dict(self.model, self.optimizer,
                       model_state_dict=self.names.from_model(list(model_state), state["model"]),
                       optim_state_dict=self.names.optimizer_from_model(list(optimizer_state), state["optimizer"]),
                       options=_options(strict=False))  # strict=False: a stage's lifted constants are not saved
        return train_state

    def _restore(self, step: int, train_state: dict | None) -> str:
        """Move the data to `step` and, under the layout that saved them, set the generators; says what it did."""
        same = train_state is not None and tuple(train_state["layout"]) == self.layout
        if self.data is not None:  # before the generators: skipping a loader's batches may draw from them
            self.data.restore(train_state["data"] if same else None, step)
        if same:
            set_rng_state(train_state["rng"])
        if not _any_rank(not same):  # every rank says the same
            return "random generators and data position restored"
        if train_state is None:
            return "no random generator state in it: the generators start afresh, the data at the step"
        return (f"saved by another layout ({_describe(tuple(train_state['layout']))}, this run "
                f"{_describe(self.layout)}): the generators start afresh, the data at the step")

    def load(self, total_steps: int | None = None) -> int:
        """Load the newest checkpoint that loads and say which (rank 0 prints one line), passing over newer ones
        that do not; returns the steps it had done, 0 (and says so) when there is none. `total_steps`: the run's
        --steps, to say when the checkpoint leaves nothing to train. A collective: DCP hands a rank's failure to
        every rank, so all of them pass over the same checkpoints. A UserError (one line, naming each checkpoint
        and why) when none loads."""
        from torch.distributed.checkpoint.api import CheckpointException

        steps = self.complete_steps()
        if not steps:
            _say(f"resume: no checkpoint in {self.directory} (no step_<k>/ with a .metadata): training from step 0")
            return 0
        passed_over = []
        for step in steps:
            try:
                train_state = self._load_step(step)
            except CheckpointException as error:  # a BaseException: DCP's wrapper of every rank's failure
                passed_over.append(f"step_{step} did not load ({_reason(error)})")
                continue
            restored = self._restore(step, train_state)
            nothing_left = total_steps is not None and step >= total_steps
            _say(self._resumed_line(step, total_steps, passed_over) + ("" if nothing_left else f"; {restored}"))
            return step
        raise UserError(f"resume: none of the {len(steps)} checkpoints in {self.directory} loads: "
                        + "; ".join(passed_over) + " (start afresh without --resume, or point --checkpoint-dir "
                        "at a checkpoint of this model)")

    def _resumed_line(self, step: int, total_steps: int | None, passed_over: list[str]) -> str:
        line = f"resume: loaded {self.directory / f'step_{step}'} ({step} steps done)"
        if passed_over:
            line += ", the newest that loads: " + "; ".join(passed_over)
        if total_steps is not None and step >= total_steps:
            line += f"; --steps is {total_steps}: nothing to train (raise --steps to train further)"
        elif total_steps is not None:
            line += f"; training steps {step} to {total_steps - 1}"
        return line


def _describe(layout: tuple) -> str:
    """"2 processes, mesh pp 1 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 1" for a _layout."""
    text = f"{layout[0]} process{'es' if layout[0] != 1 else ''}"
    if len(layout) == 3:
        text += ", mesh " + " x ".join(f"{name} {size}" for name, size in zip(layout[1], layout[2]))
    return text
