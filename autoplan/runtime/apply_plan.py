"""autoplan.parallelize: apply a plan to a model. The one place that does it: the generated train.py calls
it, and so does a user's own training loop (docs/own-loop.md).

The order is torchtitan's: the pipeline stages are cut first (each rank keeps only its own), then on each
stage tensor parallelism, activation recomputation, torch.compile, FSDP2/HSDP (all on the meta device:
no memory yet), then the values are filled in, then DDP (which needs real parameters). With context
parallelism the block where each rank starts computing on its share of the sequence is found first, by running
the meta-device model on fake tensors (runtime/distributed/attention_blocks.py), and each micro-batch then runs inside a
ContextParallelRegion (runtime/distributed/context_parallel.py); with a pipeline too, each rank exports the model with those
blocks handed its share of the sequence, so its stages compute and send the share, and each schedule step runs
inside a PipelineContextParallel region.

The model's values: a model built the ordinary way (on CPU, real tensors) starts from rank 0's values,
broadcast to every rank, so ranks that built it with different random numbers still train one model. A
model too large for one host's memory is built under torch.device("meta") and `initial_values` (a
function that rank 0 alone calls) builds it with values; the generated train.py does this, building the
model on rank 0 with the plan's seed. Either way each rank ends up holding only its own stages and shards.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils import _pytree as pytree

from autoplan.contract import LossFn
from autoplan.errors import UserError
from autoplan.layout import SCHEDULE_BY_NAME, SUPPORTED, Layout, Parallelism, Scope, problems
from autoplan.runtime.distributed.attention_blocks import find_attention_blocks
from autoplan.runtime.components.checkpoint import first_names
from autoplan.runtime.distributed.compile import compile_modules
from autoplan.runtime.distributed.config import ParallelConfig, as_config
from autoplan.runtime.distributed.context_parallel import ContextParallelRegion, PipelineContextParallel
from autoplan.runtime.distributed.batches import batch_size_of, shard, to_device
from autoplan.runtime.distributed.expert_parallel import ExpertParallel, parallelize_experts
from autoplan.runtime.distributed.gradients import clip_grad_norm_
from autoplan.runtime.distributed.materialize import ModelPart, catalog, materialize_from, named_tensors
from autoplan.runtime.distributed.mesh import (MESH_DIMS, RankLayout, RankSetup, device_mesh, global_mean_loss,
                                               local_device, mesh_shape, rank_layout)
from autoplan.runtime.components.optimizer import param_groups
from autoplan.runtime.distributed.parallel import TiedGradients, compute_dtype, replicate_data_parallel, shard_data_parallel
from autoplan.runtime.distributed.recompute import ROOT_MODULE, checkpoint_modules
from autoplan.runtime.distributed.split import PipelineSplit, split_model
from autoplan.runtime.distributed.steps import AccumulationStep, PipelineStep
from autoplan.runtime.distributed.tensor_parallel import tensor_parallel


@dataclass
class Parallelized:
    """What autoplan.parallelize returns: this rank's share of the model and how to train it."""

    parts: dict[int, nn.Module]
    """This rank's modules by pipeline stage index ({0: the whole model} without a pipeline), wrapped as
    planned (tensor parallel, recompute, compile, FSDP2 or DDP) and holding the initial values. Register
    them with your framework (e.g. an nn.ModuleDict) so it sees their parameters."""
    step: AccumulationStep | PipelineStep
    """Forward and backward of one optimizer step on this rank's batch: its micro-batches one after another
    (AccumulationStep), or through the pipeline (PipelineStep; `step.schedule` is torch.distributed.pipelining's
    schedule object). forward_backward calls it."""
    tied: TiedGradients
    """Sums the gradients of a weight used on several pipeline stages (e.g. a tied embedding and head) after
    backward; forward_backward calls it. Nothing to do without a pipeline."""
    split: PipelineSplit | None
    """The pipeline stages cut from the exported model (None without a pipeline)."""
    mesh: DeviceMesh
    """The device mesh, dims ("pp", "dp_replicate", "dp_shard", "cp", "tp")."""
    rank: RankLayout
    """Where this process sits: rank, pp_rank, dp_rank and dp (which slice of the global batch it
    trains on), cp_rank and cp (which share of each sequence), tp_rank; is_first_stage, is_last_stage."""
    experts: ExpertParallel
    """The experts split over expert-parallel groups cut from dp_shard x cp x tp and FSDP2-sharded over the ranks
    holding the same experts (no modules without expert parallelism); without FSDP2, forward_backward sums their
    gradients over those ranks."""
    device: torch.device
    """Where the parts compute."""
    dtype: torch.dtype
    """The compute dtype: bfloat16 on GPUs for a bf16 plan, else float32."""
    model_names: dict[str, str] = field(default_factory=dict)
    """Every name of each of the model's parameters and buffers -> its first name (named_parameters order): the
    name checkpoints store it under, whatever the split (runtime.Checkpointer)."""

    @property
    def model(self) -> nn.Module:
        """The one parallel module, without a pipeline (for evaluation or saving)."""
        if self.split is not None or len(self.parts) != 1:
            raise UserError(f"the plan splits the model into a {self.rank.pp}-rank pipeline: this rank "
                            f"holds stages {sorted(self.parts)}, use .parts")
        return self.parts[0]

    def parameters(self) -> list[nn.Parameter]:
        """The parameters this rank optimizes (give them to the optimizer)."""
        return [p for part in self.parts.values() for p in part.parameters()]

    def param_groups(self) -> list[dict[str, list[nn.Parameter]]]:
        """parameters() as optimizer parameter groups, one per tensor kind: torch's foreach and fused
        optimizers refuse a group that mixes DTensors (tensor-parallel or FSDP2 parameters) with plain
        tensors. torch.optim.AdamW(parallel.param_groups(), lr=...)."""
        return param_groups(self.parameters())

    def shard_batch(self, inputs: Any, targets: Any) -> tuple[Any, Any]:
        """This rank's slice of a global batch: contiguous slice dp_rank of dp along dim 0 (the ranks of
        one tensor-parallel group, one context-parallel group or one pipeline train on the same slice)."""
        inputs_slice, targets_slice = shard((inputs, targets), self.rank.dp_rank, self.rank.dp)
        return inputs_slice, targets_slice

    def forward_backward(self, inputs: Any, targets: Any) -> torch.Tensor | None:
        """Forward and backward of this rank's batch (`step`, then `tied` and `experts`), leaving in .grad the
        gradients of the global batch's mean loss. Returns this rank's mean loss over its micro-batches, or None on a
        pipeline rank that does not compute the loss (every stage but the last). Call it on every rank."""
        local_loss = self.step(inputs, targets)
        self.tied.sum_gradients()
        self.experts.reduce_gradients()  # without FSDP2: the expert gradients summed over the ranks holding them
        return local_loss

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the gradients forward_backward left to a global norm of at most `max_norm` (0: measure only), as
        torch.nn.utils.clip_grad_norm_ does on one device, whatever the layout; returns the norm before clipping
        (runtime/distributed/gradients.py). A collective: call it on every rank, after forward_backward."""
        pp_group = self.mesh["pp"].get_group() if self.rank.pp > 1 else None
        return clip_grad_norm_(self.parameters(), max_norm, pp_group, self.tied.copies_counted_elsewhere)

    def global_loss(self, local_loss: torch.Tensor | None) -> float:
        """The mean loss over the global batch, from every rank's forward_backward result (a collective:
        call it on every rank)."""
        return global_mean_loss(local_loss, self.rank, self.device)


def init_plan_mesh(plan: Any, device: torch.device | str | None = None, timeout_s: float | None = None) -> DeviceMesh:
    """Start the process group (NCCL on CUDA, gloo on CPU; its collectives time out after `timeout_s`, default
    mesh.PROCESS_GROUP_TIMEOUT_S) unless one is running, and build the plan's mesh (pp, dp_replicate, dp_shard,
    cp, tp). `plan`: a Plan, a plan.json or output folder path, or a ParallelConfig. A UserError if the number
    of processes is not the plan's."""
    return device_mesh(_device(device), as_config(plan).parallelism, timeout_s)


def parallelize(model: nn.Module, plan: Any, mesh: DeviceMesh | None = None, *,
                device: torch.device | str | None = None, example_inputs: Any = None, loss_fn: LossFn | None = None,
                initial_values: Callable[[], nn.Module] | None = None) -> Parallelized:
    """Apply `plan` to `model` on this rank (call it on every rank, under torchrun). See the module docstring.

    model: the model the plan was made for, built the ordinary way (its rank-0 values are broadcast), or on
        the meta device together with `initial_values`. It is consumed: without a pipeline it is parallelized
        in place (`.model` is it, or its DDP wrapper); with one, its tensors move to the meta device and the
        stages are new modules. Train the returned parts.
    plan: an autoplan.Plan, the path of a plan.json or of an autoplan output folder, or a ParallelConfig.
    mesh: from autoplan.init_mesh(plan); None builds it (and starts the process group if needed).
    device: where to compute; default the mesh's device type (cuda if available, else cpu).
    example_inputs: the model's inputs for one micro-batch (a larger batch is cut to one); needed with a
        pipeline, whose stages are cut from the model exported on them, and with context parallelism, whose
        attention modules are found by running the model on them as fake tensors (runtime/distributed/attention_blocks.py).
    loss_fn: loss_fn(output, targets) -> scalar; default cross-entropy for integer targets, else MSE (an
        output with .logits uses them). forward_backward and the pipeline's last stage call it.
    initial_values: called on rank 0 only, returns a module with the model's names holding the values to
        start from (the model's own values when omitted).
    """
    config = as_config(plan)
    p = config.parallelism
    if not isinstance(model, nn.Module):
        raise UserError(f"parallelize takes the model as a torch.nn.Module, got {type(model).__name__}")
    if p.pp > 1 and example_inputs is None:
        raise UserError(f"the plan has a {p.pp}-rank pipeline: pass example_inputs= (the inputs of one "
                        f"micro-batch, {p.microbatch} samples), on which the stages are cut")
    if p.cp > 1 and example_inputs is None:
        raise UserError(f"the plan splits sequences over {p.cp} context-parallel ranks: pass example_inputs= "
                        f"(the inputs of one micro-batch, {p.microbatch} samples), on which the modules "
                        f"that call attention are found")
    _check_runnable(p)
    _check_module_names(model, config)
    if mesh is None:
        mesh = init_plan_mesh(config, device)
    _check_mesh(mesh, p)
    device = _device(device if device is not None else mesh.device_type)
    rank = rank_layout(mesh, p)
    dtype = compute_dtype(config.dtype, device)
    values = _initial_values(model, initial_values)
    _to_meta(model)  # the structure only: every rank holds just its own share later
    weights = catalog(model)  # every tensor's names and shape, for the initial broadcast
    model_names = first_names(model)  # the names checkpoints use, whatever the split
    attention = None
    if p.cp > 1:  # from the block of the first attention call on, the ranks compute on sequence shares
        attention = find_attention_blocks(model, config.chain_modules, _one_microbatch(example_inputs, p.microbatch),
                                          device)

    split = stage_cp = None
    if p.pp > 1:  # cut this rank's stages out of the exported graph of the model
        inputs = _one_microbatch(example_inputs, p.microbatch)
        if attention is not None:  # exported on this rank's share of the sequence from the first block on
            stage_cp = PipelineContextParallel(mesh["cp"], attention, device)
        with stage_cp.export(model, inputs) if stage_cp is not None else nullcontext():
            split = split_model(model, to_device(inputs, "meta"), config.stages, device,
                                experts_as_modules=p.ep > 1, module_calls=_local_token_modules(config))
        if stage_cp is not None:
            stage_cp.prepare(split.stages)
        stage_ids = p.rank_stages(rank.pp_rank)
        split.drop_other_stages(stage_ids)
        parts = {s: ModelPart(split.stages[s], split.state_fqns[s]) for s in stage_ids}
        chain_modules = {s: list(split.chain_modules[s]) for s in stage_ids}
    else:
        parts, chain_modules = {0: ModelPart(model)}, {0: list(config.chain_modules)}
    del model  # this rank keeps only its stages
    # expert parallelism: each rank keeps its experts (of its own stages), FSDP2 shards them over the ranks holding
    # the same ones (shard_data_parallel)
    experts = parallelize_experts(nn.ModuleList([part.module for part in parts.values()]) if split is not None
                                  else parts[0].module, p, device.type, dtype, tp_mesh=mesh["tp"])

    for s, part in parts.items():  # order as in torchtitan: tensor parallel, recompute, compile, FSDP
        part.module = tensor_parallel(part.module, mesh["tp"], config.tensor_parallel_plan, chain_modules[s],
                                      sp=p.sp)
        recomputed = [u for u in chain_modules[s] if u in config.recompute_modules]
        part.module = checkpoint_modules(part.module, recomputed, p.recompute)
        part.module = compile_modules(part.module, chain_modules[s], config.compile,
                                      config.tensor_parallel_plan if p.tp > 1 else None)
        # FSDP2 (SyncBatchNorm first if DP > 1)
        part.module = shard_data_parallel(part.module, mesh, config, chain_modules[s], dtype, experts)
    materialize_from(list(parts.values()), weights, values, device, offload=p.offload)
    facts = SCHEDULE_BY_NAME.get(p.schedule)
    if split is None or facts is None or not facts.split_backward:  # the zero-bubble schedules' stages all-reduce
        for part in parts.values():  # their gradients themselves (runtime/distributed/split_backward.py)
            part.module = replicate_data_parallel(part.module, mesh, device)  # DDP
    modules = {s: part.module for s, part in parts.items()}

    tied = TiedGradients(split, mesh, modules, rank)  # weights used on 2+ stages
    if split is not None:
        step = PipelineStep(modules, split, RankSetup(p, mesh, rank, device, dtype), loss_fn, stage_cp)
    else:
        region = ContextParallelRegion(mesh["cp"], modules[0], attention) if attention is not None else None
        step = AccumulationStep(modules[0], p, loss_fn, dtype, region)
    if device.type == "cuda":  # the steps' peak, not the model's materialization (rank 0's broadcast buffers)
        torch.cuda.reset_peak_memory_stats(device)
    return Parallelized(parts=modules, step=step, tied=tied, split=split, mesh=mesh, rank=rank, experts=experts,
                        device=device, dtype=dtype, model_names=model_names)


def _device(device: torch.device | str | None) -> torch.device:
    """The device to compute on: `device` (default cuda if available, else cpu), with this process's GPU index."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return local_device(device)


def _check_runnable(parallelism: Parallelism) -> None:
    """The rules of the degrees a ParallelConfig built by hand can break that this runtime cannot run (layout.py:
    e.g. expert parallelism across replicas)."""
    p = parallelism
    layout = Layout(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, ep=p.ep, pp=p.pp, tp=p.tp)
    found = problems(layout, Scope(features=SUPPORTED))
    if found:
        raise UserError("parallel config: " + "; ".join(found))


def _check_mesh(mesh: DeviceMesh, parallelism: Parallelism) -> None:
    """The mesh must be the plan's: dims (pp, dp_replicate, dp_shard, cp, tp) of the plan's sizes."""
    want = mesh_shape(parallelism)
    names, shape = tuple(mesh.mesh_dim_names or ()), tuple(mesh.shape)
    if names != MESH_DIMS or shape != want:
        got = " x ".join(f"{n} {s}" for n, s in zip(names or ("?",) * len(shape), shape))
        raise UserError(f"the mesh is {got or 'empty'}, the plan needs {parallelism.world_size_arithmetic()} "
                        f"in dims {MESH_DIMS}: build it with autoplan.init_mesh(plan)")


def _check_module_names(model: nn.Module, config: ParallelConfig) -> None:
    """Every module the plan names must be in the model (the plan is for this model)."""
    have = {name for name, _ in model.named_modules(remove_duplicate=False)}  # a module reused under two names
    named = [*config.chain_modules, *config.tensor_parallel_plan, *config.recompute_modules,
             *config.batch_norm_modules]
    missing = sorted({u for u in named if u != ROOT_MODULE and u not in have})
    if missing:
        raise UserError(f"the plan names {len(missing)} module(s) this {type(model).__name__} does not have "
                        f"(e.g. {missing[0]!r}): plan the model you train (autoplan MODEL.py ...)")


def _initial_values(model: nn.Module, initial_values: Callable[[], nn.Module] | None
                    ) -> Callable[[], Mapping[str, torch.Tensor]]:
    """The function rank 0 calls for the values to start from: initial_values' module, or the model's own."""
    if initial_values is not None:
        return lambda: named_tensors(initial_values())
    tensors = [*model.parameters(), *model.buffers()]
    on_meta = sum(t.is_meta for t in tensors)
    if on_meta:
        raise UserError(f"{on_meta} of the model's {len(tensors)} tensors are on the meta device (no values): "
                        "build it with values, or pass initial_values= (a function that builds it, called on rank 0)")
    values = named_tensors(model) if dist.get_rank() == 0 else {}  # aliases: they survive model.to("meta")
    return lambda: values


def _to_meta(model: nn.Module) -> None:
    """Move every parameter and buffer of `model` to the meta device in place, a tensor shared by several
    modules (tied weights) staying shared (Module.to("meta") gives each owner its own copy)."""
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the tensor, kept alive; its meta twin)
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is None or tensor.is_meta:
                    continue
                if id(tensor) not in moved:
                    empty = torch.empty_like(tensor, device="meta")
                    twin = nn.Parameter(empty, requires_grad=tensor.requires_grad) if isinstance(
                        tensor, nn.Parameter) else empty
                    moved[id(tensor)] = (tensor, twin)
                store[name] = moved[id(tensor)][1]


def _one_microbatch(inputs: Any, microbatch: int) -> Any:
    """The first micro-batch of `inputs`: as they are if every tensor holds `microbatch` samples along dim 0, else
    the first `microbatch` of an equal number of samples in each."""
    sizes = {t.shape[0] for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim() > 0}
    if sizes <= {microbatch}:
        return inputs
    size = batch_size_of(inputs)
    if size % microbatch:
        raise UserError(f"example_inputs holds {size} samples, not a multiple of the plan's micro-batch of "
                        f"{microbatch}")
    return pytree.tree_map(lambda t: t.narrow(0, 0, microbatch)
                           if isinstance(t, torch.Tensor) and t.dim() > 0 else t, inputs)


def _local_token_modules(config: ParallelConfig) -> tuple[str, ...]:
    """The modules a pipeline stage keeps as calls: under sequence parallelism, those run on each tensor-parallel
    rank's tokens (tensor-parallel style "sequence_local": a mixture of experts' block), which the runtime wraps."""
    if not config.parallelism.sp_enabled:
        return ()
    return tuple(fqn for fqn, style in config.tensor_parallel_plan.items() if style == "sequence_local")
