"""autoplan verify's single-device reference run: the unsplit model trained on the whole global batch in one process.

    python -m autoplan.runtime.harness.reference train.py [--gradients-out DIR] [--dropout-out FILE] -- [train.py flags]

It imports the train.py given (importing runs none of its training: its main is not called) and trains what that
program trains, by its own definitions: the plan's constants (SEED, GLOBAL_BATCH, OPTIMIZER_IMPLEMENTATION), its
layout (parallel_config: the data-parallel degree), its flags (parse_args: --steps, --lr and the schedule's,
--clip-grad-norm, --model-file, --losses-out, --device), its model (load_model_source), its learning-rate schedule
(get_lr); in fp32, dropout off (runtime/distributed/dropout.py
NoDropout, counted: --dropout-out writes the calls per step). So the reference starts from the same weights,
reads the same batches (the DP ranks' shares of each global batch, in order) and makes the same updates as the
distributed run of the same train.py, which autoplan verify launches under torchrun with runtime/harness/hooks.py's
VerifyChecks; --gradients-out writes the first step's gradients after clipping (runtime/distributed/gradients.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import torch

from autoplan.contract import call_model, compute_loss
from autoplan.errors import UserError
from autoplan.procs import exit_skipping_teardown
from autoplan.runtime.components.data import TrainingData
from autoplan.runtime.distributed.batches import to_device
from autoplan.runtime.distributed.dropout import NoDropout
from autoplan.runtime.distributed.gradients import clip_grad_norm_, save_reference_gradients
from autoplan.runtime.components.optimizer import adamw

PROGRAM_MODULE = "autoplan_verified_program"
"""The module name a train.py is imported under (not "__main__": its main does not run)."""


def load_program(path: Path | str) -> ModuleType:
    """The train.py at `path`, imported (its RUNTIME_API checked first, as it does on import)."""
    spec = importlib.util.spec_from_file_location(PROGRAM_MODULE, Path(path))
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    return program


def train_reference(program: ModuleType, model_source: Any, device: torch.device, args: argparse.Namespace,
                    gradients_out: Path | None = None) -> list[float]:
    """`program`'s training on one device: the unsplit model, the whole global batch per step, the same initial
    weights, optimizer, schedule and clipping, in fp32; with `gradients_out`, the first step's gradients after
    clipping written there. `args`: program.parse_args's."""
    torch.manual_seed(program.SEED)
    model = model_source.build_model().to(device)
    optimizer = adamw(model.parameters(), args.lr, program.OPTIMIZER_IMPLEMENTATION, args.weight_decay, args.betas)
    dp = program.parallel_config().parallelism.dp  # the order the data-parallel ranks read the global batch in
    data = TrainingData(model_source, program.GLOBAL_BATCH, program.SEED, dp_rank=0, dp=dp)
    losses = []
    for step in range(args.steps):
        inputs, targets = to_device(data.global_batch_of(step), device)
        optimizer.zero_grad(set_to_none=True)
        loss = compute_loss(model_source.loss_fn, call_model(model, inputs), targets)
        loss.backward()
        clip_grad_norm_(list(model.parameters()), args.clip_grad_norm)
        if gradients_out is not None and step == 0:
            save_reference_gradients(gradients_out, model)
        for group in optimizer.param_groups:
            group["lr"] = program.get_lr(step, args)
        optimizer.step()
        losses.append(loss.item())
        print(f"step {step} | loss {losses[-1]:.6f}", flush=True)
    return losses


def run_reference(program_path: Path | str, train_argv: Sequence[str], gradients_out: Path | None = None,
                  dropout_out: Path | None = None) -> list[float]:
    """The reference run of the train.py at `program_path` with its flags `train_argv`, dropout off; its losses
    written to its --losses-out, the dropout calls it disabled per step to `dropout_out`."""
    program = load_program(program_path)
    args = program.parse_args(list(train_argv))
    model_source = program.load_model_source(args)
    dropout = NoDropout()
    with dropout:
        losses = train_reference(program, model_source, torch.device(args.device), args, gradients_out)
    if args.losses_out:
        Path(args.losses_out).write_text(json.dumps(losses))
    if dropout_out is not None:
        Path(dropout_out).write_text(json.dumps({"disabled_calls_per_step": dropout.calls / max(args.steps, 1)}))
    return losses


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The harness's own arguments (before a `--`) and train.py's (after it)."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m autoplan.runtime.harness.reference",
                                     description="autoplan verify's single-device reference run of a train.py")
    parser.add_argument("program", type=Path, help="the generated train.py")
    parser.add_argument("--gradients-out", type=Path, metavar="DIR",
                        help="write the first step's gradients (after clipping) to DIR/rank0.pt")
    parser.add_argument("--dropout-out", type=Path, metavar="FILE",
                        help="write the dropout calls disabled per step here (JSON)")
    return parser.parse_args(argv[:split]), argv[split + 1:]


def main(argv: Sequence[str]) -> None:
    args, train_argv = parse_args(argv)
    sys.argv = [str(args.program), *train_argv]  # what the program sees of its command line (its messages' name)
    try:
        run_reference(args.program, train_argv, args.gradients_out, args.dropout_out)
    except UserError as error:
        print(f"{args.program.name}: {error}", file=sys.stderr, flush=True)
        exit_skipping_teardown(2)


if __name__ == "__main__":
    main(sys.argv[1:])
    exit_skipping_teardown(0)
