"""Forward and backward of one optimizer step over the micro-batches, with or without a pipeline.

Both return this rank's mean loss over its micro-batches (None on ranks that do not compute the
loss), and leave gradients of the mean loss, reduced over the data-parallel ranks, in .grad.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autoplan.errors import UserError
from autoplan.runtime.data import call_model, microbatches
from autoplan.runtime.loss import LossFn, compute_loss
from autoplan.runtime.parallel import RankLayout, gradient_sync
from autoplan.runtime.split import PipelineSplit


class AccumulationStep:
    """No pipeline: run the micro-batches one after another and accumulate gradients, reducing them
    over the data-parallel ranks only in the last backward."""

    def __init__(self, module: nn.Module, num_microbatches: int, loss_fn: LossFn | None) -> None:
        self.module, self.num_microbatches, self.loss_fn = module, num_microbatches, loss_fn

    def __call__(self, inputs: Any, targets: Any) -> torch.Tensor:
        total = torch.zeros(())
        parts = microbatches((inputs, targets), self.num_microbatches)
        for i, (micro_inputs, micro_targets) in enumerate(parts):
            with gradient_sync(self.module, enabled=i == len(parts) - 1):
                output = call_model(self.module, micro_inputs)
                loss = compute_loss(self.loss_fn, output, micro_targets) / len(parts)
                loss.backward()
            total = total + loss.detach().cpu()
        return total


class PipelineStep:
    """One stage of a torch.distributed.pipelining schedule. The schedule splits the rank's batch
    into micro-batches, calls the loss on each one's output on the last stage and divides the
    gradients by the number of micro-batches (scale_grads), so they are those of the mean loss."""

    SCHEDULES = ("gpipe", "1f1b")

    def __init__(self, module: nn.Module, split: PipelineSplit, mesh: DeviceMesh, layout: RankLayout,
                 schedule: str, num_microbatches: int, loss_fn: LossFn | None, device: torch.device) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if schedule not in self.SCHEDULES:
            raise UserError(f"pipeline schedule {schedule!r} is not supported yet: use one of {self.SCHEDULES}")
        self.split, self.layout = split, layout
        # static shapes from the export: no shape-inference pass (whose extra backward upsets DDP)
        inputs, outputs = split.example_tensors(layout.pp_rank, device)
        stage = PipelineStage(module, layout.pp_rank, layout.pp_size, device, input_args=inputs,
                              output_args=outputs, group=mesh["pp"].get_group())
        schedule_class = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        self.schedule = schedule_class(stage, n_microbatches=num_microbatches, loss_fn=split.loss(loss_fn))

    def __call__(self, inputs: Any, targets: Any) -> torch.Tensor | None:
        args = self.split.flatten_inputs(inputs) if self.layout.is_first_stage else ()
        if not self.layout.is_last_stage:
            self.schedule.step(*args, return_outputs=False)
            return None
        if not isinstance(targets, torch.Tensor):
            raise UserError(f"pipeline parallelism needs the targets as one tensor, got {type(targets).__name__}")
        losses: list[torch.Tensor] = []
        self.schedule.step(*args, target=targets, losses=losses, return_outputs=False)
        return torch.stack([loss.detach() for loss in losses]).mean()
