"""Peak memory of one rank of a pipeline stage.

memory(stage) = model states (parameters + gradients + AdamW state, sharded by ZeRO over dp_shard)
              + unsharded copies FSDP holds (the prefetched modules under reshard=always; the whole stage under
                reshard=never, and under a pipeline from a backward no forward follows on: the late moment below)
              + activations (kept bytes per recompute mode x micro-batches in flight)
              + the stage's outputs kept for backward (pipeline boundary, same in-flight count; on the last
                stage the model's outputs, the logits: torch.distributed.pipelining keeps every stage's output
                in its fwd_cache until that micro-batch's backward, stage.py forward_one_chunk)
              + the gradient of its outputs a stage receives for the backward it runs (pipeline, one
                micro-batch: the program allocates a receive buffer when it posts the receive and lets it go
                once the backward has run, runtime/distributed/steps.py on_demand_receive_stage); the inputs a stage
                receives are its first module's input, priced among its activations
              + working set: the activations of the module running its backward (recomputed or not),
                plus the loss's copies of the logits on the output module.
Tensor parallelism divides the split parameters and activations by tp (cost/module_costs.py).
What runs (the codegen contract), in the ZeRO paper's stages: dp_shard 1 = DDP (ZeRO-0); dp_shard > 1
with reshard=never = FSDP2 with reshard_after_forward=False (all of the rank's parameters gathered at
peak, gradients and optimizer state sharded: ZeRO-2's 2 + 14/N bytes per parameter; a pinned zero=1
runs and is priced so); reshard=always = FSDP2 (ZeRO-3's 16/N, plus gathered modules). Under a
pipeline, torch.distributed.pipelining keeps FSDP parameters unsharded and gradients unreduced until
the last micro-batch (stage.py backward_maybe_with_nosync), so from a stage's first backward on its unsharded
gradients are held; its parameters stay gathered after each backward, but under reshard=always the next forward
reshards them module by module (FSDP2's post-forward hook), so the whole stage is gathered only in a run of
backwards with no forward between (1F1B's cooldown, GPipe): the stage's peak is the larger of its backward with
every micro-batch in flight (the prefetched units gathered) and the second of two consecutive backwards (one
micro-batch fewer, the whole stage gathered), or the last backward's reduce-scatters: FSDP2 copies each unit's
gradient flat into an fp32 reduce-scatter input and keeps it until the next unit's is issued (two units' at once),
and the sharded gradient it makes replaces the unsharded one (never both whole):
StageMemoryModel.end_of_backward_breakdown. Measured on CPU (tests/test_memory_parts.py, dp=2 x pp=2 1F1B,
4 micro-batches): a 2x64 GPT's first stage peaked in a steady-state backward holding its shards and one gathered
unit, not the whole stage; an 8x256 GPT on 32 tokens (parameters outweighing activations) peaked in the last
backward with the whole stage gathered, the unsharded gradients (no sharded ones) and 5.7 MiB beside them where
two units' reduce-scatter inputs are 6.0 MiB (priced before with sharded and unsharded gradients both whole and no
buffers: gradients +50%).
DDP is priced with gradient_as_bucket_view=True (its buckets are the gradients, no second copy).
When gradients exist (the program sets them to None before each step's forward, train.py): DDP's buckets
are allocated once and live through the loss's peak; otherwise a gradient is made during backward (FSDP2
reduce-scatters each unit's gradient into a new sharded one; plain autograd accumulates into .grad), so
without accumulation (one micro-batch per step, no pipeline) no gradient is alive at the start of backward:
the rank's peak is then the larger of the loss's peak (no gradients) and the end of backward (every
gradient, no activations): StageMemoryModel.late_per_module. Under accumulation (micro-batches > 1, or a
pipeline) FSDP2 keeps each unit's unsharded gradient across micro-batches, upcast to its reduce dtype (fp32:
FSDPParam.to_accumulated_grad_if_needed), so 4 bytes per parameter of the unsharded unit are alive at the
peak of every micro-batch after the first; plain autograd's .grad likewise.
FSDP2 keeps the sharded parameter in fp32 under bf16 mixed precision (MixedPrecisionPolicy casts only the
gathered copy) with fp32 gradients and AdamW's two moments: 4 + 4 + 8 bytes per parameter, divided by the
shard degree (FSDP2_STATE_BYTES_PER_PARAM), plus the gathered bf16 copy (2 bytes) where it is held.
CPU offload (FSDP2's CPUOffloadPolicy, reshard=always, pp = 1): the sharded parameters, gradients and optimizer
state live in host memory (host_state_bytes), so none of them count on the GPU; it holds the gathered
parameters of the units in flight, as without offload, and stages each unit's fp32 shard (copied in before
its all-gather) and its reduced gradient shard (copied out after its reduce-scatter).
Context parallelism (cp): activations, working set and boundary outputs divide by cp (a rank holds seq/cp
tokens, cost/compute.py sharded_table), the boundary outputs from the first module calling attention on (before
it every rank holds the whole sequence: cost/context.py rank_cut_bytes); the model states are sharded over
dp_shard x cp (`shard` here).
Expert parallelism (ep): a rank holds E/ep of each expert layer's experts (MemoryInputs.expert_numel, already
divided), their states sharded over `expert_shard` ranks (cost/context.py expert_shard_degree: FSDP2 shards them
over the dp_shard x cp x tp / ep ranks holding the same experts, as the program runs them, so under ZeRO a rank
keeps 1/(dp_shard x cp x tp) of the expert states) by the same ZeRO stage as the other parameters; every
other parameter as without ep.
Allocator fragmentation, the CUDA context and NCCL/cuBLAS workspaces are the hardware profile's
Gpu.memory_reserved_bytes (the "stated fragmentation allowance", ~5% of HBM plus ~1.5 GiB), already
taken out of Cluster.usable_memory_bytes.
Measured on CPU (verify --measure, tests/test_memory_parts.py, a 2-stage 1F1B GPT with 4 micro-batches): the last
stage's peak is its loss's backward, holding four logits-sized tensors (the kept output, cross_entropy's log-softmax
output, that output's gradient and the logits' gradient: the kept output plus calibration.LOSS_BUFFER_FACTOR's
three). torch.distributed.pipelining's own stage keeps a receive buffer per micro-batch of the step for each tensor
it receives, for good (pytorch/pytorch#136380): 1.0 of the last stage's 6.3 MiB there; priced so, the published
1T-parameter layout (512 micro-batches, two stages a rank) needed ~190 GiB more per GPU. The program's stage makes
them on demand instead (runtime/distributed/steps.py on_demand_receive_stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from autoplan.cost import calibration
from autoplan.cost.dtypes import bytes_per_element, training_dtype
from autoplan.layout import zero_of

MODEL_STATE_BYTES_PER_PARAM = {
    "fp32": {"parameters": 4, "gradients": 4, "optimizer": 8},
    "bf16": {"parameters": 2, "gradients": 2, "optimizer": 12},
}
"""Bytes per parameter, AdamW. fp32: weights, gradients, exp_avg + exp_avg_sq (4 + 4 + 8).
bf16 mixed precision: bf16 weights and gradients, fp32 master weights + exp_avg + exp_avg_sq
(2 + 2 + 12; Rajbhandari et al., ZeRO, K = 12). Both total 16 bytes per parameter."""

AUTOCAST_STATE_BYTES_PER_PARAM = {"parameters": 4, "gradients": 4, "optimizer": 8}
"""Bytes per parameter when bf16 trains as torch.autocast over fp32 weights (no FSDP2: layout.fsdp_wraps): the
fp32 weights, their fp32 gradients (autograd accumulates into the fp32 leaves) and AdamW's two fp32 moments, no
separate master copy. The same 16 bytes as mixed precision's 2 + 2 + 12, in other categories; the bf16 copies
autocast makes of the weights are activations (module_costs.autocast_weight_copy_bytes)."""

FSDP2_STATE_BYTES_PER_PARAM = {"parameters": 4, "gradients": 4, "optimizer": 8}
"""Bytes per parameter of FSDP2's sharded state (divided by the shard degree), any training dtype: the sharded
parameter stays in its fp32 (MixedPrecisionPolicy(param_dtype=bf16) casts only the all-gathered copy, which is
priced apart as gathered_parameters), its gradient is reduced into fp32 (reduce_dtype=float32, runtime/distributed/parallel.py),
and AdamW's exp_avg and exp_avg_sq are fp32 (torch.distributed.fsdp._fully_shard, FSDPParam)."""
ACCUMULATED_GRADIENT_BYTES_PER_PARAM = 4
"""Bytes per parameter of the unsharded gradient FSDP2 keeps across micro-batches without gradient sync: upcast
to its reduce dtype, fp32 (FSDPParam.to_accumulated_grad_if_needed; the program's reduce_dtype is float32)."""

STATE_CATEGORIES = ("parameters", "gradients", "optimizer")
REPLACED_BY = {"unsharded_gradients": "gradients"}
"""category held at the loss's peak -> the late category made from it that replaces it
(StageMemoryModel.late_per_module): FSDP2's reduce-scatter turns each unit's accumulated unsharded gradient into its
sharded one and lets it go."""

HOST_STATE_BYTES_PER_PARAM = 16
"""Host bytes per parameter of a rank's shard under CPU offload, any training dtype: FSDP2 keeps the sharded
parameter in its original fp32 (MixedPrecisionPolicy casts only the gathered copy), its fp32 gradient (reduced
in fp32) and AdamW's two fp32 moments: 4 + 4 + 8."""
OFFLOAD_STAGING_BYTES_PER_PARAM = 8
"""Device bytes per parameter of a unit's shard that CPU offload stages on the GPU: the fp32 shard copied in
before the all-gather and the fp32 reduced gradient shard before it is copied out (4 + 4)."""


def host_state_bytes(numel_on_rank: float, shard: int, ranks_per_node: int) -> float:
    """Host memory of one node under CPU offload: each of its `ranks_per_node` ranks keeps its 1/shard of
    `numel_on_rank` parameters' states there (HOST_STATE_BYTES_PER_PARAM), bytes."""
    return HOST_STATE_BYTES_PER_PARAM * numel_on_rank / shard * ranks_per_node


def model_state_bytes(numel: float, train_dtype: str, zero: int, shard: int) -> dict[str, float]:
    """Parameters, gradients and optimizer state of `numel` parameters on one rank (ZeRO paper), sharded over
    `shard` data-parallel ranks by ZeRO stage `zero` (Parallelism.zero): >= 1 shards the optimizer state, >= 2 also
    the gradients, 3 also the parameters: 16 Psi replicated, 4 Psi + 12 Psi / N, 2 Psi + 14 Psi / N, 16 Psi / N."""
    per_param = MODEL_STATE_BYTES_PER_PARAM[training_dtype(train_dtype)]
    sharded_from = {"optimizer": 1, "gradients": 2, "parameters": 3}
    return {
        c: numel * per_param[c] / (shard if zero >= sharded_from[c] else 1)
        for c in STATE_CATEGORIES
    }


@dataclass(frozen=True)
class StageMemoryModel:
    """Memory of a rank of stage `stage_index` as a function of the contiguous modules [a, b) it holds and
    the recompute mode r(u) of each:

        memory = sum_{u in [a,b)} (per_module[c][u] + f x activations_per_microbatch[r(u)][u])
               + sum_{g touching [a,b)} per_tied_group[c][g]
               + max_{u in [a,b)} largest_module[c][u]  +  (f + g) x cut_per_microbatch[b-1]  (when b < n)

    summed over categories c, with f = in_flight, the micro-batches the stage keeps, and g = received, those whose
    outputs' gradients it holds in receive buffers at its peak. The per-module
    vectors are shared by every stage of a layout; only f differs. The solvers (split.py, dp.py,
    ilp.py) use the flattened vectors."""

    stage_index: int
    per_module: dict[str, tuple[float, ...]]
    """category -> bytes each module adds whatever its recompute mode (model states)."""
    activations_per_microbatch: dict[str, tuple[float, ...]]
    """recompute mode -> bytes each module keeps for backward per micro-batch."""
    per_tied_group: dict[str, tuple[float, ...]]
    """category -> bytes of each tied group, counted once if the stage holds any of its modules."""
    tied_group_modules: tuple[tuple[int, ...], ...]
    """Modules of each tied group (ModuleChain.tied_groups order)."""
    largest_module: dict[str, tuple[float, ...]]
    """category -> per-module bytes of which the stage adds the maximum over its modules."""
    cut_per_microbatch: tuple[float, ...] = ()
    """Bytes per micro-batch the stage keeps when it ends after module i (its outputs; i < n - 1)."""
    in_flight: int = 1
    """Micro-batches whose activations and outputs this stage keeps (cost/pipeline.py)."""
    received: int = 0
    """Micro-batches whose outputs' gradients the stage holds in receive buffers at its peak: 1 under a pipeline (the
    one whose backward runs; runtime/distributed/steps.py on_demand_receive_stage), 0 without."""
    late_per_module: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """category -> bytes each module holds from its backward on, not at the loss's peak (gradients made during
    backward: FSDP2's sharded gradients, plain autograd's without accumulation). With any, the stage's memory is
    the larger of the loss's peak (the linear form) and the end of backward (states, these, no activations)."""
    late_per_tied_group: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """The same for each tied group."""
    late_largest: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """category -> per-module bytes of which the end of backward adds the maximum over the stage's modules, not
    the loss's peak: FSDP2's reduce-scatter buffers (layout_memory)."""

    @cached_property
    def state_bytes(self) -> tuple[float, ...]:
        return tuple(map(sum, zip(*self.per_module.values())))

    @property
    def states(self) -> dict[str, tuple[float, ...]]:
        """category -> bytes each module holds at some point of the step (per_module and late_per_module)."""
        return {**self.per_module, **self.late_per_module}

    @property
    def tied_states(self) -> dict[str, tuple[float, ...]]:
        """The same for each tied group."""
        return {**self.per_tied_group, **self.late_per_tied_group}

    @cached_property
    def activations(self) -> dict[str, tuple[float, ...]]:
        """recompute mode -> bytes each module keeps on this stage (x micro-batches in flight)."""
        f = self.in_flight
        return {m: tuple(a * f for a in act) for m, act in self.activations_per_microbatch.items()}

    def module_bytes(self, mode: str) -> tuple[float, ...]:
        """Linear bytes per module when every module uses `mode`."""
        return self._module_bytes[mode]

    @cached_property
    def _module_bytes(self) -> dict[str, tuple[float, ...]]:
        return {m: tuple(s + a for s, a in zip(self.state_bytes, act)) for m, act in self.activations.items()}

    @cached_property
    def group_bytes(self) -> tuple[float, ...]:
        return tuple(map(sum, zip(*self.per_tied_group.values()))) if self.tied_group_modules else ()

    @property
    def max_vectors(self) -> tuple[tuple[float, ...], ...]:
        return tuple(self.largest_module.values())

    @cached_property
    def largest_bytes(self) -> tuple[float, ...]:
        """Sum of the largest-module terms of each module (what a stage holding only that module adds)."""
        return tuple(map(sum, zip(*self.largest_module.values())))

    @cached_property
    def cut_bytes(self) -> tuple[float, ...]:
        """Bytes a stage ending after module i keeps at its end: its outputs for the micro-batches in flight and the
        received gradients of those whose backward runs."""
        return tuple(c * (self.in_flight + self.received) for c in self.cut_per_microbatch)

    def receive_buffer_bytes(self, end: int) -> float:
        """The received gradients of a stage ending before module `end` (none on the last stage)."""
        return self.received * self.cut_per_microbatch[end - 1] if end - 1 < len(self.cut_per_microbatch) else 0.0

    def breakdown(self, start: int, end: int, modes: tuple[str, ...] | str = "none") -> dict[str, float]:
        """Bytes per category for modules [start, end) at the stage's peak: the loss's (start of backward), or,
        when larger, the end of backward (late_per_module); `modes` is one mode or one per module of the chain."""
        at_loss = self.loss_peak_breakdown(start, end, modes)
        if not self.late_per_module and not self.late_largest:
            return at_loss
        late = self.end_of_backward_breakdown(start, end, modes)
        return late if sum(late.values()) > sum(at_loss.values()) else at_loss

    def end_of_backward_breakdown(self, start: int, end: int,
                                  modes: tuple[str, ...] | str = "none") -> dict[str, float]:
        """Bytes per category once a backward has run with no forward after it: the states, every gradient made
        during backward, the largest gathered unit (FSDP's last reduce-scatter), and the activations, kept outputs
        and working set of the in_flight - 1 micro-batches whose backward is still to run (a pipeline's
        consecutive backwards: its cooldown, GPipe), or when larger the buffers of the last backward's
        reduce-scatters (late_largest)."""
        out: dict[str, float] = {}
        later = self.in_flight - 1
        cooldown: dict[str, float] = {}
        if later > 0:
            acts = self.activations_per_microbatch
            cooldown["activations"] = later * sum(acts[modes if isinstance(modes, str) else modes[u]][u]
                                                  for u in range(start, end))
            if end - 1 < len(self.cut_per_microbatch):
                cooldown["activations"] += later * self.cut_per_microbatch[end - 1]
            cooldown["working"] = max(self.largest_module.get("working", (0.0,) * end)[start:end])
        last = {c: max(vec[start:end]) for c, vec in self.late_largest.items()}  # the last backward's buffers
        out.update(cooldown if sum(cooldown.values()) > sum(last.values()) else last)
        # each unit's sharded gradient is made from its unsharded one by the last micro-batch's reduce-scatter, which
        # FSDP2 then lets go (4 / shard bytes per parameter for 4): never both whole, the unsharded ones counted
        replaced = {REPLACED_BY[c] for c in self.per_module if c in REPLACED_BY}
        for terms in (self.per_module, self.late_per_module):
            for c, vec in terms.items():
                if terms is self.per_module or c not in replaced:
                    out[c] = out.get(c, 0.0) + sum(vec[start:end])
        for terms in (self.per_tied_group, self.late_per_tied_group):
            for c, vec in terms.items():
                if terms is self.per_tied_group or c not in replaced:
                    out[c] = out.get(c, 0.0) + sum(v for v, us in zip(vec, self.tied_group_modules)
                                                   if any(start <= u < end for u in us))
        for c, vec in self.largest_module.items():
            if c != "working" and c not in self.late_per_module and c not in self.per_module:  # not held whole
                out[c] = out.get(c, 0.0) + max(vec[start:end])
        return out

    def loss_peak_breakdown(self, start: int, end: int, modes: tuple[str, ...] | str = "none") -> dict[str, float]:
        """Bytes per category at the start of backward (the linear form the solvers use)."""
        out: dict[str, float] = {}
        for c, vec in self.per_module.items():
            out[c] = sum(vec[start:end])
        acts = self.activations_per_microbatch
        out["activations"] = self.in_flight * sum(acts[modes if isinstance(modes, str) else modes[u]][u]
                                                  for u in range(start, end))
        for c, vec in self.per_tied_group.items():
            out[c] = out.get(c, 0.0) + sum(v for v, us in zip(vec, self.tied_group_modules)
                                           if any(start <= u < end for u in us))
        for c, vec in self.largest_module.items():
            out[c] = out.get(c, 0.0) + max(vec[start:end])
        if end - 1 < len(self.cut_per_microbatch):
            out["activations"] += self.in_flight * self.cut_per_microbatch[end - 1]
        if self.received:
            out["receive_buffers"] = self.receive_buffer_bytes(end)
        return out

    def total(self, start: int, end: int, modes: tuple[str, ...] | str = "none") -> float:
        return sum(self.breakdown(start, end, modes).values())


@dataclass(frozen=True)
class MemoryInputs:
    """What the memory model needs to know about a layout, per module (already tensor-parallel split)."""

    module_numel: tuple[float, ...]
    """Parameter elements each module alone holds on a tensor-parallel rank."""
    group_numel: tuple[float, ...]
    """Elements of each tied group on a tensor-parallel rank."""
    tied_group_modules: tuple[tuple[int, ...], ...]
    module_largest_numel: tuple[float, ...]
    """All parameter elements a module reads (tied included), per tensor-parallel rank (FSDP gathers)."""
    activations: dict[str, tuple[float, ...]]
    """mode -> bytes per micro-batch each module keeps (ModuleTable.activation_bytes)."""
    working_bytes: tuple[float, ...]
    cut_bytes: tuple[float, ...]
    """Bytes per micro-batch crossing a boundary after each module (training dtype)."""
    expert_numel: tuple[float, ...] = ()
    """Of module_numel, the expert parameter elements each module holds on a rank (E/ep experts); () for none."""
    output_bytes: float = 0.0
    """Bytes per micro-batch of the model's outputs (the last module's: the logits) on a rank, as the boundary
    bytes are counted (cut_bytes): a pipeline's last stage keeps them until the micro-batch's backward."""


@dataclass(frozen=True)
class LayoutMemory:
    """The per-module vectors every stage of one layout shares (build once, then stage() per stage)."""

    per_module: dict[str, tuple[float, ...]]
    activations_per_microbatch: dict[str, tuple[float, ...]]
    per_tied_group: dict[str, tuple[float, ...]]
    tied_group_modules: tuple[tuple[int, ...], ...]
    largest_module: dict[str, tuple[float, ...]]
    cut_per_microbatch: tuple[float, ...]

    late_per_module: dict[str, tuple[float, ...]] = field(default_factory=dict)
    late_per_tied_group: dict[str, tuple[float, ...]] = field(default_factory=dict)
    late_largest: dict[str, tuple[float, ...]] = field(default_factory=dict)

    @property
    def states(self) -> dict[str, tuple[float, ...]]:
        """category -> bytes each module holds at some point of the step (StageMemoryModel.states)."""
        return {**self.per_module, **self.late_per_module}

    @property
    def tied_states(self) -> dict[str, tuple[float, ...]]:
        return {**self.per_tied_group, **self.late_per_tied_group}

    def stage(self, stage_index: int, in_flight: int, received: int = 0) -> StageMemoryModel:
        """Stage `stage_index`'s model, keeping `in_flight` micro-batches and the received gradients of `received`
        (StageMemoryModel.received)."""
        return StageMemoryModel(stage_index, self.per_module, self.activations_per_microbatch, self.per_tied_group,
                                self.tied_group_modules, self.largest_module, self.cut_per_microbatch, in_flight,
                                received, self.late_per_module, self.late_per_tied_group, self.late_largest)


def gradients_at_loss_peak(ddp: bool, zero: int, accumulates: bool) -> bool:
    """Whether the rank's gradients (the "gradients" state category) are alive at the loss's peak: DDP's buckets
    always are; FSDP2's sharded gradients are made in the last micro-batch's backward (an accumulating FSDP2 keeps
    unsharded ones meanwhile: ACCUMULATED_GRADIENT_BYTES_PER_PARAM); plain autograd's .grad from the first
    micro-batch's backward on, so only under accumulation."""
    return ddp or (zero == 0 and accumulates)


@dataclass(frozen=True)
class MemoryLayout:
    """What a layout's memory vectors read of the layout (layout_memory; cost/context.py memory_layout makes it of a
    Parallelism, and Context.layout_memory caches by it)."""

    fsdp_shard: int = 1
    """The data-parallel sharding degree (Parallelism.fsdp_shard: dp_shard x cp; 1 for DDP)."""
    reshards_after_forward: bool = False
    """Parallelism.reshards_after_forward (ZeRO-3)."""
    pp_enabled: bool = False
    """More than one pipeline rank (Parallelism.pp_enabled)."""
    offload: bool = False
    """The model states are on the host (CPU offload)."""
    expert_shard: int = 1
    """The ranks the expert parameters' states are sharded over (the FSDP group over ep)."""
    autocast: bool = False
    """bf16 runs as torch.autocast over fp32 weights (AUTOCAST_STATE_BYTES_PER_PARAM; the MemoryInputs then hold
    autocast's activations, Context.memory_inputs)."""
    ddp: bool = False
    """The gradients live in DDP's buckets."""
    accumulates: bool = True
    """A step runs more than one micro-batch's backward per rank (micro-batches > 1; a pipeline always does)."""


def layout_memory(inputs: MemoryInputs, train_dtype: str, setting: MemoryLayout) -> LayoutMemory:
    """The memory vectors of a layout (`setting`: what they read of it) with the modules of `inputs`."""
    shard, reshards_after_forward, offload = setting.fsdp_shard, setting.reshards_after_forward, setting.offload
    expert_shard, autocast, pipelined = setting.expert_shard, setting.autocast, setting.pp_enabled
    dtype = training_dtype(train_dtype)
    zero = zero_of(shard, reshards_after_forward)
    accumulates = setting.accumulates or pipelined
    element = bytes_per_element(dtype)
    if autocast:
        per_param = AUTOCAST_STATE_BYTES_PER_PARAM
    elif zero >= 2:
        per_param = FSDP2_STATE_BYTES_PER_PARAM
    else:
        per_param = MODEL_STATE_BYTES_PER_PARAM[dtype]
    firsts = (("optimizer", 1), ("gradients", 2), ("parameters", 2))
    divisor = {c: shard if zero >= first else 1 for c, first in firsts}
    expert_divisor = {c: expert_shard if zero >= first else 1 for c, first in firsts}
    held_gradients = gradients_at_loss_peak(setting.ddp, zero, accumulates)

    def states(numels, experts=()) -> tuple[dict[str, tuple[float, ...]], dict[str, tuple[float, ...]]]:
        """(held at the loss's peak, made during backward) per category."""
        experts = experts or tuple(0.0 for _ in numels)
        out = {c: tuple(0.0 if offload else (n - e) * per_param[c] / divisor[c] + e * per_param[c] / expert_divisor[c]
                        for n, e in zip(numels, experts)) for c in STATE_CATEGORIES}  # offload: on the host
        late = {} if held_gradients or offload else {"gradients": out.pop("gradients")}
        if zero == 2:  # FSDP2's gathered copies kept to backward: reshard_after_forward=False
            out["gathered_parameters"] = tuple(n * element for n in numels)
        elif zero == 3 and pipelined:
            # a pipeline's backwards keep them gathered (stage.py backward_maybe_with_nosync: reshard_after_backward
            # False until the step's end), but each forward reshards them again after it: held whole only from a
            # backward that no forward follows on (the late moment), the units in flight before
            late["gathered_parameters"] = tuple(n * element for n in numels)
        if zero >= 2 and accumulates:  # unsharded gradients kept across micro-batches, in fp32
            out["unsharded_gradients"] = tuple(n * ACCUMULATED_GRADIENT_BYTES_PER_PARAM for n in numels)
        return out, late

    largest = {"working": inputs.working_bytes}
    if zero == 3:
        largest["gathered_parameters"] = tuple(calibration.FSDP_PREFETCH_UNITS * n * element
                                               for n in inputs.module_largest_numel)
    if offload:
        largest["offload_staging"] = tuple(calibration.FSDP_PREFETCH_UNITS * n * OFFLOAD_STAGING_BYTES_PER_PARAM / shard
                                           for n in inputs.module_largest_numel)
    late_largest = {}
    if zero >= 2 and not offload:
        # FSDP2's reduce-scatter input, a unit's gradient copied flat in the reduce dtype (fp32), is kept until the
        # next unit's reduce-scatter is issued (FSDPCommContext.reduce_scatter_state): two units' at once
        late_largest["reduce_scatter_buffers"] = tuple(calibration.FSDP_PREFETCH_UNITS * n
                                                       * calibration.GRADIENT_REDUCE_BYTES
                                                       for n in inputs.module_largest_numel)
    modules, late_modules = states(inputs.module_numel, inputs.expert_numel)
    groups, late_groups = states(inputs.group_numel)
    activations = inputs.activations
    if pipelined and inputs.output_bytes:  # the last stage's outputs, kept in fwd_cache like every stage's
        activations = {mode: (*vec[:-1], vec[-1] + inputs.output_bytes) for mode, vec in activations.items()}
    return LayoutMemory(modules, activations, groups, inputs.tied_group_modules, largest, inputs.cut_bytes,
                        late_modules, late_groups, late_largest)
