"""Forward and backward of one optimizer step over the micro-batches, with or without a pipeline.

Both return this rank's mean loss over its micro-batches (None on ranks that do not compute the
loss), and leave gradients of the mean loss, reduced over the data-parallel ranks, in .grad.
Tensor parallelism needs plain tensors that meet DTensors to count as replicated, during forward
and backward alike, so both run inside tensor_parallel_context. Under context parallelism each micro-batch
runs inside its ContextParallelRegion, or with a pipeline the whole schedule step inside the
PipelineContextParallel region (its stages were exported on the rank's share of the sequence).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Mapping

import torch
from torch import nn
from torch.utils import _pytree as pytree

from autoplan.contract import LossFn, call_model, compute_loss
from autoplan.errors import UserError
from autoplan.layout import SCHEDULE_BY_NAME, SCHEDULES, Parallelism
from autoplan.runtime.distributed.context_parallel import ContextParallelRegion, PipelineContextParallel
from autoplan.runtime.distributed.batches import microbatches
from autoplan.runtime.distributed.failures import stage_failures
from autoplan.runtime.distributed.mesh import RankSetup
from autoplan.runtime.distributed.parallel import ddp_replicas, gradient_sync
from autoplan.runtime.distributed.split import PipelineSplit
from autoplan.runtime.distributed.tensor_parallel import (ParallelLoss, loss_parallel_context, plain_tensor,
                                              reduce_partial_gradients, tensor_parallel_context)


def _autocast(module: nn.Module, dtype: torch.dtype, device: torch.device):
    """torch.autocast for mixed precision, unless FSDP2 already computes in `dtype` (its policy)."""
    from torch.distributed.fsdp import FSDPModule

    if dtype == torch.float32 or isinstance(module, FSDPModule):
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _is_low_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16)


class AccumulationStep:
    """No pipeline: run the micro-batches one after another and accumulate gradients, reducing them
    over the data-parallel ranks only in the last backward."""

    def __init__(self, module: nn.Module, parallelism: Parallelism, loss_fn: LossFn | None,
                 dtype: torch.dtype = torch.float32, context_parallel: ContextParallelRegion | None = None) -> None:
        """`parallelism`: the layout (its microbatches, tp and loss_parallel are what this step reads)."""
        self.module, self.microbatches = module, parallelism.microbatches
        self.tensor_parallel, self.loss_parallel = parallelism.tp_enabled, parallelism.loss_parallel_enabled
        self.loss_fn = ParallelLoss(loss_fn) if self.loss_parallel else loss_fn
        self.dtype = dtype
        self.context_parallel = context_parallel
        """With cp > 1: each micro-batch's forward, loss and backward run in it, on the rank's share of the
        sequence (the returned loss is the mean over that share's tokens)."""

    def __call__(self, inputs: Any, targets: Any) -> torch.Tensor:
        total = torch.zeros(())
        parts = microbatches((inputs, targets), self.microbatches)
        device = next(iter(self.module.parameters())).device
        with tensor_parallel_context(self.tensor_parallel), loss_parallel_context(self.loss_parallel):
            for i, (micro_inputs, micro_targets) in enumerate(parts):
                with gradient_sync(self.module, enabled=i == len(parts) - 1), \
                        self._sequence_shares(micro_targets) as micro_targets:
                    with _autocast(self.module, self.dtype, device):
                        output = call_model(self.module, micro_inputs)
                    if self.dtype != torch.float32:  # the loss in fp32, as the pipeline's last stage has it
                        output = pytree.tree_map(lambda t: t.float() if _is_low_float(t) else t, output)
                    loss = compute_loss(self.loss_fn, output, micro_targets) / len(parts)
                    loss.backward()
                total = total + plain_tensor(loss.detach()).float().cpu()
        if self.tensor_parallel:
            reduce_partial_gradients(self.module)
        return total

    def _sequence_shares(self, targets: Any):
        """The context-parallel region yielding the rank's share of `targets`; without cp, `targets` as they are."""
        if self.context_parallel is None:
            return nullcontext(targets)
        return self.context_parallel(targets)


class CastOutputs(nn.Module):
    """A pipeline stage computing in a lower precision (autocast, or FSDP2's policy) whose outputs
    go back to the dtypes the pipeline's static metadata expects."""

    def __init__(self, module: nn.Module, dtypes: tuple[torch.dtype, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.module, self.dtypes, self.dtype, self.device = module, dtypes, dtype, device

    def forward(self, *args: Any) -> Any:
        with _autocast(self.module, self.dtype, self.device):
            output = self.module(*args)
        flat = output if isinstance(output, tuple) else (output,)
        cast = tuple(t.to(d) if isinstance(t, torch.Tensor) and t.dtype != d else t for t, d in zip(flat, self.dtypes))
        return cast if isinstance(output, tuple) else cast[0]


def own_outputs(module: nn.Module) -> nn.Module:
    """`module`, whose outputs become copies that no op of the stage saves or views (a forward hook: torch's
    schedules tell DDP and FSDP stages by the module's type, so it is not wrapped). A schedule that splits backward
    (torch's stage_backward_input) detaches a stage's outputs in place after the input-gradient pass: torch refuses
    that for views (a tensor-parallel stage's output is a view of its local shard), and the weight-gradient pass
    then fails on an output an op saved for backward (tried: a stage ending in a LayerNorm under tp=2, 'Trying to use
    a saved tensor that has been detached in-place'). One copy of the boundary activation per micro-batch."""

    def owned(_module: nn.Module, _args: Any, output: Any) -> Any:
        flat = output if isinstance(output, tuple) else (output,)
        copies = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in flat)
        return copies if isinstance(output, tuple) else copies[0]

    module.register_forward_hook(owned)
    return module


def on_demand_receive_stage():
    """torch.distributed.pipelining's PipelineStage with its receive buffers made when a receive is posted and let go
    once the micro-batch's compute has taken the tensor. The stock stage allocates one buffer per micro-batch, for
    each tensor it receives (its inputs, its outputs' gradients), at the first step and keeps them all for good
    (stage.py _setup_forward_recv_info, _create_grad_recv_info; pytorch/pytorch#136380): measured here on a 2-stage
    1F1B GPT with 4 micro-batches, 1 MiB of 6.6 MiB at the last stage's peak; at 512 micro-batches of a 1T-parameter
    layout, ~200 GiB per GPU. Made on demand, a received input lives as long as the micro-batch's forward keeps it
    (fwd_cache, its saved tensors) and a received gradient until its backward has run."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import _make_tensor_from_meta

    class OnDemandReceiveStage(PipelineStage):
        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            out = super()._prepare_forward_infra(*args, **kwargs)
            self._let_go(self.args_recv_info.values())
            return out

        def _setup_backward_recv_info(self, num_microbatches: int) -> None:
            super()._setup_backward_recv_info(num_microbatches)
            self._let_go(self.grad_recv_info.values())

        def _get_recv_ops(self, recv_infos):
            self._allocate(recv_infos)
            return super()._get_recv_ops(recv_infos)

        def _retrieve_recv_activations(self, fwd_chunk_id: int):
            activations = super()._retrieve_recv_activations(fwd_chunk_id)
            self._let_go([self.args_recv_info[fwd_chunk_id]])
            return activations

        def _retrieve_recv_grads(self, bwd_chunk_id: int):
            self._allocate(self.grad_recv_info[bwd_chunk_id], zeros=True)  # a same-rank stage's None gradient
            grads = super()._retrieve_recv_grads(bwd_chunk_id)
            self._let_go([self.grad_recv_info[bwd_chunk_id]])
            return grads

        def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True,
                               last_backward=False):
            super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                       last_backward=last_backward)
            if full_backward:
                _drop_graph(loss)
            elif loss is not None:
                self._losses_awaiting_weights[bwd_chunk_id] = loss

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            _drop_graph(self._losses_awaiting_weights.pop(bwd_chunk_id, None))

        @property
        def _losses_awaiting_weights(self) -> dict:
            if "_awaiting" not in self.__dict__:
                self.__dict__["_awaiting"] = {}
            return self.__dict__["_awaiting"]

        def _allocate(self, recv_infos, zeros: bool = False) -> None:
            for info in recv_infos:
                if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
                    buffer = _make_tensor_from_meta(info.tensor_meta, self.device)
                    info.buffer = buffer.zero_() if zeros else buffer

        @staticmethod
        def _let_go(recv_tuples) -> None:
            for recv_infos in recv_tuples:
                for info in recv_infos:
                    if not info.is_root_arg and info.tensor_meta is not None:
                        info.buffer = None

    return OnDemandReceiveStage


def _drop_graph(loss: torch.Tensor | None) -> None:
    """Detach a last stage's micro-batch loss in place once its backward has run: the schedule keeps the loss until
    the step ends, and through its graph's AccumulateGrad nodes every received input of the step (the autograd
    leaves) would stay alive with it."""
    if loss is not None and loss.grad_fn is not None and not loss._is_view():
        loss.detach_()


class PipelineStep:
    """This rank's stages of a torch.distributed.pipelining schedule (autoplan.layout.SCHEDULE_TABLE names its
    class: one stage for GPipe and 1F1B; stages pp_rank, pp_rank + pp, ... for the interleaved ones; stages pp_rank
    and 2 pp - 1 - pp_rank for the V-shaped ones). The schedule splits the rank's batch
    into micro-batches, calls the loss on each one's output on the last stage and divides the
    gradients by the number of micro-batches (scale_grads), so they are those of the mean loss."""

    def __init__(self, parts: Mapping[int, nn.Module], split: PipelineSplit, setup: RankSetup,
                 loss_fn: LossFn | None, context_parallel: PipelineContextParallel | None = None) -> None:
        """`setup`: the layout (its schedule, microbatches, tp and loss_parallel), the mesh, this rank's place in it,
        the device and the compute dtype."""
        from torch.distributed import pipelining

        p, mesh, device, dtype = setup.parallelism, setup.mesh, setup.device, setup.dtype
        schedule = p.schedule
        if schedule not in SCHEDULES:
            raise UserError(f"pipeline schedule {schedule!r} is not supported: use one of {', '.join(SCHEDULES)}")
        facts = SCHEDULE_BY_NAME[schedule]
        least, most = facts.virtual_stages
        if len(parts) < least or (most is not None and len(parts) > most):
            raise UserError(f"the {schedule} schedule runs {least if least == most else f'{least} or more'} "
                            f"stage(s) per rank, this rank has {len(parts)}")
        schedule_class = getattr(pipelining, facts.torch_class)
        self.split, self.rank, self.tensor_parallel, self.parts = split, setup.rank, p.tp_enabled, dict(parts)
        self.context_parallel = context_parallel
        """With cp > 1: the region each step runs in (the last stage's loss is the mean over the rank's share of
        the tokens)."""
        num_stages = len(split.stages)
        stage_class = on_demand_receive_stage()
        if facts.split_backward:  # the weight pass completed (runtime/distributed/split_backward.py), receive buffers on demand
            from autoplan.runtime.distributed.split_backward import SplitBackwardStage

            stage_class = type("SplitBackwardStage", (SplitBackwardStage, stage_class), {})
        stages = []
        for index, module in sorted(parts.items()):
            # static shapes from the export: no shape-inference pass (whose extra backward upsets DDP)
            inputs, outputs = split.example_tensors(index, device)
            data_parallel = module  # the FSDP2 (or, but for the zero-bubble schedules, DDP) module, or the stage
            if dtype != torch.float32:
                module = CastOutputs(module, tuple(t.dtype for t in outputs), dtype, device)
            kwargs = dict(input_args=inputs, output_args=outputs, group=mesh["pp"].get_group())
            if facts.split_backward:  # no DDP (apply_plan): the stage all-reduces over the replicas itself
                stages.append(stage_class(own_outputs(module), index, num_stages, device, data_parallel=data_parallel,
                                          replicas=ddp_replicas(mesh), **kwargs))
            else:
                stages.append(stage_class(module, index, num_stages, device, **kwargs))
        self.stages, self.split_backward = stages, facts.split_backward
        self.loss_parallel = p.loss_parallel_enabled
        loss = split.loss(ParallelLoss(loss_fn) if self.loss_parallel else loss_fn)
        if most == 1:  # torch's single-stage schedules take the stage, the others a list
            self.schedule = schedule_class(stages[0], n_microbatches=p.microbatches, loss_fn=loss)
        else:
            self.schedule = schedule_class(stages, n_microbatches=p.microbatches, loss_fn=loss)

    def __call__(self, inputs: Any, targets: Any) -> torch.Tensor | None:
        args = self.split.flatten_inputs(inputs) if self.rank.is_first_stage else ()
        if self.rank.is_last_stage and not isinstance(targets, torch.Tensor):
            raise UserError(f"pipeline parallelism needs the targets as one tensor, got {type(targets).__name__}")
        with tensor_parallel_context(self.tensor_parallel), loss_parallel_context(self.loss_parallel), \
                stage_failures(self.parts), self._sequence_shares(targets) as targets:
            if not self.rank.is_last_stage:
                self.schedule.step(*args, return_outputs=False)
            else:
                losses: list[torch.Tensor] = []
                self.schedule.step(*args, target=targets, losses=losses, return_outputs=False)
        unreduced = [stage.stage_index for stage in self.stages if self.split_backward and not stage.reduced]
        if unreduced:
            raise RuntimeError(f"the {type(self.schedule).__name__} step ended without reducing the gradients of "
                               f"stage(s) {unreduced} (no REDUCE_GRAD action after their last backward pass)")
        if self.tensor_parallel:
            for module in self.parts.values():
                reduce_partial_gradients(module)
        if not self.rank.is_last_stage:
            return None
        return torch.stack([plain_tensor(loss.detach()).float() for loss in losses]).mean()

    def _sequence_shares(self, targets: Any):
        """The context-parallel region yielding the rank's share of the last stage's targets (None on the other
        stages); without cp, `targets` as they are."""
        if self.context_parallel is None:
            return nullcontext(targets)
        return self.context_parallel(targets if self.rank.is_last_stage else None)
