"""Time and activation memory of every module for one micro-batch, model FLOPs and the optimizer step.

Per op (cost/module_costs.py), at micro-batch size b, tensor-parallel degree t (split ops only) and the
training dtype (bytes scaled by its element size over the capture's):

    forward  = max(F / (peak x eff_kind), bytes / (HBM x memory_efficiency)) + launches x overhead
    backward = max(F_bwd / (peak x eff_kind), 2 x bytes / (HBM x memory_efficiency)) + launches x overhead

(times calibration.COMPILE_TIME_FACTOR of the op's class under torch.compile: fused pointwise ops)
roofline on the cluster's accelerator, eff_kind = Gpu.matmul_efficiency for weight matmuls (times
calibration.GROUPED_GEMM_EFFICIENCY for grouped expert matmuls) and calibration.ATTENTION_EFFICIENCY for
attention; memory-bound ops cost their bytes. Views cost nothing.
When the profile was measured on this machine and the plan is for it (device "cpu"), measured times
are used instead: a fixed launch part plus a part proportional to the batch, the split ops' share
divided by t.

Ops of a tensor-parallel region (its Linears and everything between them) run on DTensors and also
pay their host cost (Gpu.dtensor_op_overhead_s per DTensor op).

Tensor-parallel collectives per module (alpha-beta, cost/comm.py), as runtime/distributed/tensor_parallel.py runs them:
- without sequence parallelism: an all-reduce of each rowwise Linear's output (and of a vocabulary-parallel
  embedding's output) in forward, of each colwise Linear's (and the head's) input gradient in backward;
- with it (Korthikanti et al. 2022): each all-reduce becomes a reduce-scatter onto the sequence; the colwise
  Linears (and the head) all-gather their sequence-sharded input in forward, once for those reading the same
  tensor (q, k, v), and in backward reduce-scatter its gradient and gather it again (the shard was kept:
  runtime/distributed/sequence_gather.py; not in compiled modules); the rowwise Linear's output gradient is all-gathered
  in backward; the ops between the pairs compute on sequence shards (1/tp);
- a reduction over a projection's split features (a q/k norm spanning every head: its sum of squares) is
  all-reduced in forward (DTensor's Partial result made whole); in backward its gradient is broadcast locally;
- with sequence parallelism, a sequence shard an op of a split region reads (DeepSeek-V3's expanded rotary key
  copied into the split keys: OpCost.gathered_shard_bytes) is all-gathered by DTensor in forward, its gradient
  reduce-scattered in backward;
- the vocabulary-parallel head's logits stay sharded for the loss (loss parallel): three all-reduces of one
  fp32 number per token (the max, the sum of exponentials, the target's logit); with loss parallel off they
  are all-gathered. The loss's copies of the logits divide by tp with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from autoplan.chain.modules import ModuleChain
from autoplan.cost import calibration, comm
from autoplan.cost import float8
from autoplan.cost.dtypes import activation_scale, bytes_per_element, peak_flops
from autoplan.cost.module_costs import (AUTOCAST_SPLIT_ROLES, MODES, ChainCosts, ModuleCosts, OpCost,
                                       autocast_weight_copy_bytes,
                                       saved_by_mode, split_roles)
from autoplan.hardware.types import Gpu, Host, Link

ADAMW_BYTES_PER_PARAM = {"fused": 28, "foreach": 80, "for-loop": 80}
"""Memory traffic of one step of torch.optim.AdamW per fp32 parameter, bytes, per implementation
(plan.OPTIMIZER_IMPLEMENTATIONS; train.py runs the plan's, runtime/components/optimizer.py). fused (torch's
_fused_adamw_, CPU and CUDA): one pass that reads the weight, gradient, exp_avg and exp_avg_sq and writes
the weight and both moments back, 7 x 4 = 28. foreach and for-loop make one pass over memory per
elementwise op: weight decay mul_ (read+write weight, 8), exp_avg.lerp_(grad) (12), exp_avg_sq.mul_ (8)
and .addcmul_(grad, grad) (12), denominator sqrt, div and add_ (8 each), weight.addcdiv_(exp_avg,
denominator) (16): 80. Measured on this machine (one CPU thread, torch 2.13, 8M parameters in 4 tensors):
2.8 ns per parameter fused, 13.4 foreach, 18.7 for-loop; 64 one-element tensors: 18 us per tensor fused,
142-158 us unfused."""


@dataclass(frozen=True)
class ModuleTable:
    """Costs of every module for one micro-batch at one (tensor-parallel degree, micro-batch size)."""

    forward_s: tuple[float, ...]
    """Forward compute, seconds."""
    backward_s: tuple[float, ...]
    tp_forward_s: tuple[float, ...]
    """Tensor-parallel collectives of the forward (exposed), seconds."""
    tp_backward_s: tuple[float, ...]
    cheap_forward_s: tuple[float, ...]
    """Forward of the ops selective recompute repeats (the memory-bound ops and the grouped expert matmuls:
    OpCost.kept_by_selective), seconds."""
    activation_bytes: dict[str, tuple[float, ...]]
    """Recompute mode -> bytes each module keeps for backward per micro-batch (training dtype)."""
    working_bytes: tuple[float, ...]
    """Transient bytes while the module runs its backward (its full activations, and the loss's logits
    copies on the output module)."""
    cp_forward_s: tuple[float, ...] = ()
    """Context parallelism's ring traffic the forward's attention does not hide (exposed), seconds; () at cp = 1."""
    cp_backward_s: tuple[float, ...] = ()
    ep_forward_s: tuple[float, ...] = ()
    """Expert parallelism's dispatch and combine all-to-alls of the forward and the route around them (exposed),
    seconds; () at ep = 1."""
    ep_backward_s: tuple[float, ...] = ()
    ep_recompute_s: tuple[float, ...] = ()
    """What selective recompute runs again of expert parallelism's route in the module's backward: its permutation
    passes and host syncs, not its all-to-alls (the program's save list keeps their outputs: runtime/distributed/recompute.py),
    seconds; () at ep = 1."""

    def selective_recompute_s(self, u: int) -> float:
        """What selective recompute runs again in module u's backward: its ops whose outputs it does not keep
        (cheap_forward_s) and its experts' route around the all-to-alls, whose outputs it keeps (ep_recompute_s),
        seconds."""
        return self.cheap_forward_s[u] + _at(self.ep_recompute_s, u)

    def parallel_forward_s(self, u: int) -> float:
        """Module u's exposed context- and expert-parallel communication of the forward, seconds."""
        return _at(self.cp_forward_s, u) + _at(self.ep_forward_s, u)

    def parallel_backward_s(self, u: int) -> float:
        return _at(self.cp_backward_s, u) + _at(self.ep_backward_s, u)

    def time_s(self, mode: str) -> tuple[float, ...]:
        """Forward + backward (+ recompute) + tensor-parallel collectives of each module, seconds."""
        return self._times[mode]

    @cached_property
    def _times(self) -> dict[str, tuple[float, ...]]:
        return {m: tuple(self._module_time(u, m) for u in range(len(self.forward_s))) for m in MODES}

    @cached_property
    def total_s(self) -> dict[str, float]:
        """Sum over modules of time_s(mode)."""
        return {m: sum(t) for m, t in self._times.items()}

    def _module_time(self, u: int, mode: str) -> float:
        base = (self.forward_s[u] + self.backward_s[u] + self.tp_forward_s[u] + self.tp_backward_s[u]
                + self.parallel_forward_s(u) + self.parallel_backward_s(u))
        if mode == "selective":
            return base + self.selective_recompute_s(u)
        if mode == "full":
            return base + self.forward_s[u] + self.tp_forward_s[u] + self.parallel_forward_s(u)
        return base


def _at(values: tuple[float, ...], u: int) -> float:
    return values[u] if values else 0.0


@dataclass(frozen=True)
class ShardedModules:
    """What context parallelism (cp) and expert parallelism change in each module's costs, per micro-batch:

        forward(u)     = forward_r(u) + (imbalance(u) / expert_split - 1) x expert_forward_1(u) / cp   (and backward)
        tp collectives, selective recompute: as on the rank's tokens (_r)
        kept bytes: (bytes_1(u) + saved_change(u)) / cp, what recompute keeps of the input less its masks,
                    and under selective the route's all-to-all outputs (route_kept(u), per rank)
        cp_forward(u)  = ring_forward(u),  ep_forward(u) = all_to_all(u) / 2                (and backward alike)

    where _1 is the module's cost on the whole sequence (ModuleTable at cp = 1) and _r its cost on a rank's tokens
    (the ModuleTable at micro-batch / cp: its FLOPs and activation traffic / cp, its kernel launches, weight reads and
    collective latencies whole): a rank holds seq/cp tokens of every sequence and the load-balanced ring gives it
    1/cp of the attention too; the experts' compute waits
    for the busiest expert-parallel rank (cost/expert_parallel.py router_imbalance), on its share of the tokens
    (1/tp of them with ep > 1, where each tensor-parallel rank routes its own share: under sequence parallelism
    through "sequence_local" MoE blocks the experts' ops have a sequence role, so forward_1 and expert_forward_1
    already price that share and expert_split is 1; else expert_split is tp)."""

    cp: int
    expert_forward_s: tuple[float, ...]
    """Forward compute of the module's expert ops on the whole sequence, seconds (0 without experts)."""
    expert_backward_s: tuple[float, ...]
    imbalance: tuple[float, ...]
    """The busiest expert-parallel rank's rows over the mean (1 without experts or at ep = 1)."""
    ring_forward_s: tuple[float, ...]
    """Exposed ring traffic of the module's attention calls, forward (cost/context_parallel.py), seconds."""
    ring_backward_s: tuple[float, ...]
    all_to_all_s: tuple[float, ...]
    """The module's expert layers' four all-to-alls (cost/expert_parallel.py), seconds: half in each pass."""
    saved_change_bytes: tuple[float, ...] = ()
    """What the ring's attention keeps for backward minus what the captured call keeps, per micro-batch on the
    whole sequence, bytes (chain/attention.py; 0 at cp = 1): added to the kept and working bytes before / cp."""
    input_change_bytes: tuple[float, ...] = ()
    """The attention masks in the module's input, negated, per micro-batch, bytes (the ring runs without them): added
    to what selective and full recompute keep of the input."""
    ring_working_bytes: tuple[float, ...] = ()
    """The ring's transient buffers while the module's attention runs on a rank, bytes (cost/context_parallel.py
    RingAttentionCost.working_bytes; already per rank): added to its working bytes."""
    route_forward_s: tuple[float, ...] = ()
    """Per module, its expert layers' route around the rows' all-to-alls in the forward (cost/expert_parallel.py
    route_s: counts and ids all-to-alls, host syncs, permutation passes), seconds; () without."""
    route_backward_s: tuple[float, ...] = ()
    """The same in the backward (permutation passes), seconds."""
    expert_split: int = 1
    """Tensor-parallel ranks sharing the expert layers' tokens beyond the base table's share: tp when ep > 1 (each
    routes its own 1/tp of them: runtime/distributed/expert_parallel.py TensorParallelTokens) unless the experts' ops already run
    on sequence shards ("sequence_local" MoE blocks, priced on 1/tp in the base table), else 1."""
    expert_cheap_forward_s: tuple[float, ...] = ()
    """Per module, the forward of its experts' ops that selective recompute repeats (all experts, whole rows),
    seconds; () without experts."""
    expert_saved_bytes: tuple[float, ...] = ()
    """Per module, what its experts' ops save for backward without recompute (all experts, whole rows), per
    micro-batch, bytes; () without experts."""
    route_recompute_s: tuple[float, ...] = ()
    """Per module, what selective recompute runs of its expert layers' route again (cost/expert_parallel.py
    route_recompute_s), seconds; () without."""
    route_kept_bytes: tuple[float, ...] = ()
    """Per module, what selective recompute keeps of its expert layers' route on a rank (the all-to-alls' outputs:
    cost/expert_parallel.py selective_kept_bytes), per micro-batch, bytes (already per rank); () without."""
    ring_kept_bytes: tuple[float, ...] = ()
    """Per module, the keys and values a traced ring's forward gathered, which its backward reads (cost/
    context_parallel.py RingAttentionCost.kept_bytes), per micro-batch on a rank, bytes: kept without recompute (full
    recompute gathers them again in the backward); () when the ring runs eager."""


def sharded_table(base: ModuleTable, sharded: ShardedModules, rank: ModuleTable | None = None) -> ModuleTable:
    """`base` (the modules on whole sequences, all experts local) under context and expert parallelism. `rank`: the
    modules priced on a rank's tokens (micro-batch / cp): its times replace base's / cp, since a rank still launches
    every kernel, reads every weight and pays every collective's latency on its 1/cp of the tokens (None: / cp)."""
    cp, n, split = sharded.cp, len(base.forward_s), sharded.expert_split

    def per_rank(values) -> tuple[float, ...]:
        return tuple(v / cp for v in values)

    def rank_times(name: str) -> tuple[float, ...]:
        return getattr(rank, name) if rank is not None else per_rank(getattr(base, name))

    change = sharded.saved_change_bytes or (0.0,) * n
    inputs = sharded.input_change_bytes or (0.0,) * n
    forward, backward = rank_times("forward_s"), rank_times("backward_s")
    ring = sharded.ring_working_bytes or (0.0,) * n
    busiest = busiest_rank_expert_bytes(sharded, n)
    kept = base.activation_bytes
    none = tuple(kept["none"][u] + change[u] + busiest[u] for u in range(n))
    activations = {m: none if m == "none" else tuple(max(0.0, min(v + i, whole)) for v, i, whole in
                                                      zip(kept[m], inputs, none)) for m in kept}
    return ModuleTable(
        forward_s=tuple(forward[u] + (sharded.imbalance[u] / split - 1) * sharded.expert_forward_s[u] / cp
                        for u in range(n)),
        backward_s=tuple(backward[u] + (sharded.imbalance[u] / split - 1) * sharded.expert_backward_s[u] / cp
                         for u in range(n)),
        tp_forward_s=rank_times("tp_forward_s"), tp_backward_s=rank_times("tp_backward_s"),
        cheap_forward_s=tuple(cheap + (sharded.imbalance[u] / split - 1) * _at(sharded.expert_cheap_forward_s, u) / cp
                              for u, cheap in enumerate(rank_times("cheap_forward_s"))),
        activation_bytes={m: tuple(v / cp + (_at(sharded.route_kept_bytes, u) if m == "selective" else 0.0)
                                   + (_at(sharded.ring_kept_bytes, u) if m == "none" else 0.0)
                                   for u, v in enumerate(values)) for m, values in activations.items()},
        working_bytes=tuple((base.working_bytes[u] + change[u] + busiest[u]) / cp + ring[u] for u in range(n)),
        cp_forward_s=sharded.ring_forward_s, cp_backward_s=sharded.ring_backward_s,
        ep_forward_s=tuple(t / 2 + _at(sharded.route_forward_s, u) for u, t in enumerate(sharded.all_to_all_s)),
        ep_backward_s=tuple(t / 2 + _at(sharded.route_backward_s, u) for u, t in enumerate(sharded.all_to_all_s)),
        ep_recompute_s=tuple(_at(sharded.route_recompute_s, u) for u in range(n)))


def busiest_rank_expert_bytes(sharded: ShardedModules, n: int) -> tuple[float, ...]:
    """Per module, what the busiest expert-parallel rank's experts save beyond the captured graph's (which routes
    the mean rows): the rows it receives are the mean's times the router imbalance, over the tensor-parallel
    ranks sharing the tokens (the same share its expert compute takes), and its experts' saved tensors scale with
    them, per micro-batch, bytes. Kept without recompute and in the working set of the module's backward; selective
    and full recompute keep none of the experts' rows (cost/module_costs.py)."""
    return tuple((sharded.imbalance[u] / sharded.expert_split - 1) * _at(sharded.expert_saved_bytes, u)
                 for u in range(n))


@dataclass(frozen=True)
class MeasuredScale:
    """Factors on the fixed and the per-sample parts of measured op times that make their sum over the
    model equal the whole model's measured forward+backward at two batch sizes b1 < b2:

        T(b) = a x sum(fixed) + c x b x sum(per sample)    through (b1, T1) and (b2, T2)

    Ops timed alone run colder than inside the model (profile/whole_model.py)."""

    fixed: float = 1.0
    per_sample: float = 1.0


def measured_scale(costs: ChainCosts, gpu: Gpu) -> MeasuredScale:
    if len(costs.whole_model_times_s) < 2:
        return MeasuredScale()
    (b1, t1), (b2, t2) = costs.whole_model_times_s[0], costs.whole_model_times_s[-1]
    fixed = per_sample = 0.0
    for module in costs.modules:
        for op in module.ops:
            if op.measured:
                for part in _measured_parts(op, gpu):
                    fixed, per_sample = fixed + part[0], per_sample + part[1]
    slope = (t2 - t1) / (b2 - b1)
    if per_sample <= 0 or slope <= 0:  # timings too noisy to resolve a slope: keep the op sums
        return MeasuredScale()
    intercept = max(0.0, t1 - slope * b1)
    return MeasuredScale(fixed=intercept / fixed if fixed > 0 else 1.0, per_sample=slope / per_sample)


@dataclass(frozen=True)
class TableSetting:
    """What a module table is priced for."""

    gpu: Gpu
    capture_dtype: str
    """ModelProfile.dtype: the dtype the profile's bytes are in."""
    train_dtype: str
    tp: int
    """Tensor-parallel degree."""
    microbatch: float
    """Samples per micro-batch."""
    tp_link: Link
    """The link the tensor-parallel group's collectives run over."""
    use_measured: bool
    """Price from the op times measured on this machine (the plan is for it) rather than the roofline."""
    sp: bool = False
    """Sequence parallelism between the tensor-parallel pairs (Parallelism.sp)."""
    loss_parallel: bool = True
    """The loss runs on the vocabulary-parallel head's sharded logits (Parallelism.loss_parallel)."""
    compiled: bool = False
    """The modules run under torch.compile (plan.json compile.enable): each op's time scales by its class's
    calibration.COMPILE_TIME_FACTOR."""
    autocast: bool = False
    """bf16 runs as torch.autocast over fp32 weights (no FSDP2, layout.fsdp_wraps): activations as autocast saves
    them (module_costs.saved_by_mode) and its bf16 weight copies (autocast_weight_copy_bytes)."""
    float8_linears: str | None = None
    """The float8 recipe (cost/float8.py FLOAT8_RECIPES) the Linears are priced with (GEMMs at the float8 peak, plus
    the recipe's casts), None for the training dtype: priced only, for published runs that trained so; the generated
    program runs the training dtype."""
    whole_modules: bool = True
    """The rows price whole modules; False for a table of some of their ops (a module's experts or attention,
    Context._ops_table), which holds none of the loss_fn (it belongs to the whole module's row)."""


@dataclass(frozen=True)
class _ModuleRow:
    """One module's costs for one micro-batch (a row of ModuleTable)."""

    forward_s: float
    backward_s: float
    tp_forward_s: float
    tp_backward_s: float
    cheap_forward_s: float
    activation_bytes: dict[str, float]
    working_bytes: float


def module_table(costs: ChainCosts, setting: TableSetting) -> ModuleTable:
    """Per-module costs; identical modules (ChainCosts.signature) are computed once."""
    timing = measured_scale(costs, setting.gpu) if setting.use_measured else MeasuredScale()
    done: dict[int, _ModuleRow] = {}
    rows = []
    for u, module in enumerate(costs.modules):
        key = costs.signature[u]
        if key not in done:
            done[key] = _module_row(module, setting, timing)
        rows.append(done[key])
    return ModuleTable(
        forward_s=tuple(r.forward_s for r in rows), backward_s=tuple(r.backward_s for r in rows),
        tp_forward_s=tuple(r.tp_forward_s for r in rows), tp_backward_s=tuple(r.tp_backward_s for r in rows),
        cheap_forward_s=tuple(r.cheap_forward_s for r in rows),
        activation_bytes={m: tuple(r.activation_bytes[m] for r in rows) for m in MODES},
        working_bytes=tuple(r.working_bytes for r in rows))


def _module_row(module: ModuleCosts, setting: TableSetting, timing: MeasuredScale) -> _ModuleRow:
    gpu, tp, b, link, sp = setting.gpu, setting.tp, setting.microbatch, setting.tp_link, setting.sp
    scale = activation_scale(setting.capture_dtype, setting.train_dtype)
    split = split_roles(sp)
    dtensor_roles = DTENSOR_ROLES | ({"sequence"} if sp else set())
    fwd = bwd = cheap = tp_fwd = tp_bwd = 0.0
    for op in module.ops:
        f, g = (_measured(op, gpu, tp, b, timing, split) if setting.use_measured and op.measured
                else _roofline(op, setting, setting.train_dtype, scale, split))
        if setting.float8_linears and not (setting.use_measured and op.measured) and float8.is_float8_linear(op):
            f, g = _float8_linear(op, setting, tp, b, split)
        if setting.compiled:  # fused pointwise chains: their traffic and launches go (calibration.py)
            factor = calibration.COMPILE_TIME_FACTOR[op.compile_class]
            f, g = f * factor, g * factor
        if setting.autocast and op.autocast_weight_numel and not (setting.use_measured and op.measured):
            # its weights' cast, and their gradient's, each step (measured times: MeasuredScale fits them in)
            cast = weight_cast_s(op, setting)
            f, g = f + cast, g + cast
        if tp > 1 and op.tp_role in dtensor_roles:  # the op runs on DTensors: their host cost on top
            forward_ops, backward_ops = _dtensor_ops(op)
            f += forward_ops * gpu.dtensor_op_overhead_s
            g += backward_ops * gpu.dtensor_op_overhead_s
        fwd, bwd = fwd + f, bwd + g
        if op.kind != "view" and not op.kept_by_selective:  # what selective recompute runs again
            cheap += f
        tp_fwd += _tp_forward(op, setting, scale)
        tp_bwd += _tp_backward(op, tp, b * scale, link, sp, setting.compiled)
    saved = saved_by_mode(module, tp, scale, sp, setting.compiled, setting.autocast)
    sharded_logits = tp > 1 and setting.loss_parallel and any(op.tp_role == "head" for op in module.ops)
    logits = module.output_buffer_bytes / (tp if sharded_logits else 1)
    loss_scale = 1.0 if setting.autocast else scale  # autocast's cross-entropy upcasts the logits to fp32
    working = saved["none"] * b + calibration.LOSS_BUFFER_FACTOR * logits * b * loss_scale
    # measured op times are fit to a whole step, loss included (MeasuredScale); a table of some of the ops (a module's
    # experts or attention, Context._ops_table) holds none of the loss, which belongs to the whole module's row
    if not setting.use_measured and setting.whole_modules:
        loss_forward, loss_backward = loss_s(logits * b, setting)
        fwd, bwd = fwd + loss_forward, bwd + loss_backward
    activations = {m: saved[m] * b for m in MODES}
    if setting.autocast:  # the weights' bf16 copies: saved without recompute, remade in backward with it
        copies = autocast_weight_copy_bytes(module, tp, bytes_per_element(setting.train_dtype))
        activations["none"] += copies
        working += copies
    return _ModuleRow(forward_s=fwd, backward_s=bwd, tp_forward_s=tp_fwd, tp_backward_s=tp_bwd, cheap_forward_s=cheap,
                    activation_bytes=activations, working_bytes=working)


LOSS_KERNELS = (2, 2)
"""Kernels of the loss_fn's cross-entropy, forward (log_softmax, nll_loss) and backward (nll_loss's, log_softmax's),
beyond autocast's casts of the logits (one each way)."""


def loss_s(logits_bytes: float, setting: TableSetting) -> tuple[float, float]:
    """Forward and backward seconds of the model's loss_fn (cross-entropy) over one micro-batch's logits
    (`logits_bytes` in the capture's dtype; 0 for a module that outputs no logits): it runs outside the captured
    graph, eagerly (calibration.LOSS_FORWARD_PASSES, LOSS_BACKWARD_PASSES). Under torch.autocast it computes in fp32
    (autocast's fp32 list) on an fp32 copy of the bf16 logits: that cast (read bf16, write fp32) in forward and its
    gradient's cast back in backward; otherwise in the training dtype."""
    if logits_bytes <= 0.0:
        return 0.0, 0.0
    gpu = setting.gpu
    bytes_per_s = gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency
    capture, train = bytes_per_element(setting.capture_dtype), bytes_per_element(setting.train_dtype)
    elements = logits_bytes / capture
    loss_element = capture if setting.autocast else train
    cast = elements * (capture + train) if setting.autocast else 0.0
    kernels = tuple(k + (1 if setting.autocast else 0) for k in LOSS_KERNELS)
    return ((calibration.LOSS_FORWARD_PASSES * elements * loss_element + cast) / bytes_per_s
            + kernels[0] * gpu.kernel_overhead_s,
            (calibration.LOSS_BACKWARD_PASSES * elements * loss_element + cast) / bytes_per_s
            + kernels[1] * gpu.kernel_overhead_s)


def weight_cast_s(op: OpCost, setting: TableSetting) -> float:
    """One cast of the fp32 weights an op reads under torch.autocast to the training dtype (forward: autocast's
    cast of a Linear's weight, the experts' cast of runtime/distributed/expert_parallel.py; module_costs.autocast_weight_copy_bytes
    holds the copies), or of their gradient back to fp32 (backward: the cast's own backward): a streaming kernel
    reading one dtype and writing the other, per tensor-parallel rank, plus its launch, seconds. The traced kernels
    of the GPU run (benchmarks/results/gpu_check_h200_20261127b, bfloat16_copy and direct_copy kernels) show them;
    the capture, in fp32, records no cast at all."""
    gpu = setting.gpu
    numel = op.autocast_weight_numel / (setting.tp if op.tp_role in AUTOCAST_SPLIT_ROLES else 1)
    moved = numel * (bytes_per_element(setting.capture_dtype) + bytes_per_element(setting.train_dtype))
    return moved / (gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency) + gpu.kernel_overhead_s


DTENSOR_ROLES = frozenset({"colwise", "rowwise", "interior"})
"""Tensor-parallel roles whose ops run on DTensors: the sharded Linears and every op between a
column-parallel Linear and its row-parallel partner (runtime/distributed/tensor_parallel.py keeps DTensors there,
views included)."""


def _dtensor_ops(op: OpCost) -> tuple[int, int]:
    """DTensor ops an op of a tensor-parallel region runs in forward and in backward."""
    if op.kind == "gemm" and op.tp_role in ("colwise", "rowwise"):
        return calibration.TP_DTENSOR_FORWARD_OPS, calibration.TP_DTENSOR_BACKWARD_OPS
    return 1, 1 if op.has_backward else 0


def _efficiency(op: OpCost, gpu: Gpu) -> float:
    if op.kind == "attention":
        return calibration.ATTENTION_EFFICIENCY
    if op.grouped:
        return gpu.matmul_efficiency * calibration.GROUPED_GEMM_EFFICIENCY
    return gpu.matmul_efficiency


def _roofline(op: OpCost, setting: TableSetting, dtype: str, scale: float,
              split_roles: frozenset[str] = split_roles(False)) -> tuple[float, float]:
    """Forward and backward seconds of `op` at setting's micro-batch on one of its tp ranks, at `dtype`'s peak
    (the training dtype, or float8's), from its FLOPs and its bytes (`scale`: training over capture bytes)."""
    gpu, tp, b = setting.gpu, setting.tp, setting.microbatch
    if op.kind == "view":
        return 0.0, 0.0
    split = tp if op.tp_role in split_roles else 1
    flops_per_s = peak_flops(gpu, dtype) * _efficiency(op, gpu)
    bytes_per_s = gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency
    traffic = (op.activation_bytes * b + op.parameter_bytes) * scale / split
    forward = max(op.flops_fwd * b / split / flops_per_s, traffic / bytes_per_s) + gpu.kernel_overhead_s
    if not op.has_backward:
        return forward, 0.0
    kernels = calibration.GEMM_BACKWARD_KERNELS if op.kind == "gemm" else 1
    backward = max(op.flops_bwd * b / split / flops_per_s,
                   calibration.BACKWARD_TRAFFIC_FACTOR * traffic / bytes_per_s) + kernels * gpu.kernel_overhead_s
    return forward, backward


def _float8_linear(op: OpCost, setting: TableSetting, tp: int, b: float,
                   split: frozenset[str]) -> tuple[float, float]:
    """A float8 linear (cost/float8.py), forward and backward: the roofline of its GEMMs at the float8 peak, plus its
    operands' casts (memory-bound, at the streaming bandwidth) and their kernels' launches."""
    gpu = setting.gpu
    forward, backward = _roofline(op, setting, float8.FLOAT8_PEAK_KEY, activation_scale(setting.capture_dtype,
                                  setting.train_dtype), split)
    elements = float8.cast_elements(op, bytes_per_element(setting.capture_dtype), b, tp, split)
    how = float8.recipe(setting.float8_linears)
    cast_forward, cast_backward = float8.cast_bytes(elements, setting.compiled, how)
    kernels_forward, kernels_backward = float8.cast_kernels(setting.compiled, how)
    bytes_per_s = gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency
    return (forward + cast_forward / bytes_per_s + kernels_forward * gpu.kernel_overhead_s,
            backward + cast_backward / bytes_per_s + kernels_backward * gpu.kernel_overhead_s)


def _measured_parts(op: OpCost, gpu: Gpu) -> tuple[tuple[float, float], tuple[float, float]]:
    """(fixed seconds, seconds per sample) of the op's measured forward and backward: a launch part
    that does not shrink with the batch, the rest proportional to it."""
    backward_kernels = calibration.GEMM_BACKWARD_KERNELS if op.kind == "gemm" else 1
    parts = []
    for measured, kernels in ((op.time_fwd_s, 1), (op.time_bwd_s, backward_kernels)):
        fixed = min(measured, kernels * gpu.kernel_overhead_s) if measured > 0.0 else 0.0
        parts.append((fixed, (measured - fixed) / op.profile_batch if measured > 0.0 else 0.0))
    return parts[0], parts[1]


def _measured(op: OpCost, gpu: Gpu, tp: int, b: int, timing: MeasuredScale = MeasuredScale(),
              split_roles: frozenset[str] = split_roles(False)) -> tuple[float, float]:
    """Measured time at micro-batch b: the fixed part, and the per-sample part times b (split ops' share
    divided by t), each rescaled to the whole model's measured time."""
    split = tp if op.tp_role in split_roles else 1
    (ff, fs), (bf, bs) = _measured_parts(op, gpu)
    slowdown = gpu.concurrent_slowdown  # measured alone; trained with every rank computing
    return (slowdown * (ff * timing.fixed + fs * timing.per_sample * b / split),
            slowdown * (bf * timing.fixed + bs * timing.per_sample * b / split))


LOSS_PARALLEL_REDUCTIONS = 3
"""All-reduces of one number per token that the cross-entropy on vocabulary-sharded logits runs (torch
loss_parallel: the max and the sum of exponentials for log-softmax, the target's logit for the loss)."""
LOSS_PARALLEL_BYTES_PER_TOKEN = 4
"""Each in fp32."""


def _tp_forward(op: OpCost, setting: TableSetting, scale: float) -> float:
    """Forward collectives of one op over setting's tp ranks for a micro-batch of b samples (`scale`: training over
    capture bytes)."""
    tp, b, link, sp, loss_parallel = setting.tp, setting.microbatch, setting.tp_link, setting.sp, setting.loss_parallel
    per_mb = b * scale
    if tp == 1:
        return 0.0
    if op.tp_role in ("rowwise", "embedding"):
        reduce = comm.reduce_scatter_s if sp else comm.all_reduce_s
        return reduce(op.output_bytes * per_mb, tp, link)
    if op.sums_ranks:  # each rank's sum over its features, joined (one number per token and head group)
        return comm.all_reduce_s(op.output_bytes * per_mb, tp, link)
    gathers = sp and op.kind == "gemm" and not op.shares_gather
    gathered = comm.all_gather_s(op.input_activation_bytes * per_mb, tp, link) if gathers else 0.0
    if op.tp_role == "colwise":
        return gathered
    if op.tp_role == "head" and loss_parallel:
        return gathered + LOSS_PARALLEL_REDUCTIONS * comm.all_reduce_s(
            op.rows * b * LOSS_PARALLEL_BYTES_PER_TOKEN, tp, link)
    if op.tp_role == "head":
        return gathered + comm.all_gather_s(op.output_bytes * per_mb, tp, link)
    if sp and op.gathered_shard_bytes:  # a sequence shard read by a split region's op, gathered by DTensor
        return comm.all_gather_s(op.gathered_shard_bytes * per_mb, tp, link)
    return 0.0


def _tp_backward(op: OpCost, tp: int, per_mb: float, link: Link, sp: bool = False, compiled: bool = False) -> float:
    """Backward collectives of one op; `per_mb`: samples x training-over-capture bytes. With sequence
    parallelism a shared gather (OpCost.shares_gather) reduce-scatters the summed input gradient once, and the
    input kept as a shard is gathered again (not in a compiled module, which keeps it whole; the head stays
    eager)."""
    if tp == 1:
        return 0.0
    if op.tp_role == "rowwise" and sp:  # the output gradient, sequence-sharded, gathered for the Linear
        return comm.all_gather_s(op.output_bytes * per_mb, tp, link)
    if sp and op.gathered_shard_bytes:  # the gathered shard's gradient, scattered back onto the sequence
        return comm.reduce_scatter_s(op.gathered_shard_bytes * per_mb, tp, link)
    if op.tp_role not in ("colwise", "head"):
        return 0.0
    if not sp:
        return comm.all_reduce_s(op.input_activation_bytes * per_mb, tp, link)
    if op.shares_gather:
        return 0.0
    nbytes = op.input_activation_bytes * per_mb
    regather = comm.all_gather_s(nbytes, tp, link) if not compiled or op.tp_role == "head" else 0.0
    return comm.reduce_scatter_s(nbytes, tp, link) + regather


def optimizer_step_time(parameters_on_rank: float, gpu: Gpu, tensors: int = 0, dtensors: int = 0,
                        implementation: str = "fused") -> float:
    """AdamW over the parameters a rank updates, as `implementation` runs it (ADAMW_BYTES_PER_PARAM):
    memory-bound streaming of its states, plus the host cost per parameter tensor: `tensors` in all,
    `dtensors` of them DTensors (FSDP2 shards, tensor-parallel weights), which cost more (Gpu's
    optimizer_*_overhead_s, measured by `autoplan calibrate` on the fused path train.py runs)."""
    plain = max(0, tensors - dtensors)
    streaming = parameters_on_rank * ADAMW_BYTES_PER_PARAM[implementation] / (
        gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency)
    return streaming + plain * gpu.optimizer_tensor_overhead_s + dtensors * gpu.optimizer_dtensor_overhead_s


def host_optimizer_step_time(parameters_on_rank: float, host: Host, ranks_per_node: int, tensors: int = 0,
                             implementation: str = "fused") -> float:
    """AdamW on the CPU over a rank's offloaded parameter shards (FSDP2 CPUOffloadPolicy): its states
    streamed through host memory (ADAMW_BYTES_PER_PARAM), which the node's `ranks_per_node` ranks share, as
    they step at once; plus calibration.HOST_ADAMW_TENSOR_OVERHEAD_S per parameter tensor."""
    bandwidth = host.memory_bandwidth_bytes_per_s * host.memory_efficiency / ranks_per_node
    streaming = parameters_on_rank * ADAMW_BYTES_PER_PARAM[implementation] / bandwidth
    return streaming + tensors * calibration.HOST_ADAMW_TENSOR_OVERHEAD_S


def model_flops_per_step(chain: ModuleChain, global_batch_size: int) -> float:
    """Forward + backward FLOPs of one optimizer step, without recomputation."""
    return chain.flops_per_sample * global_batch_size


def mfu(model_flops: float, step_time_s: float, num_gpus: int, gpu: Gpu, train_dtype: str) -> float:
    """Model FLOPs utilization: achieved model FLOP/s over the cluster's peak in the training dtype."""
    return model_flops / (step_time_s * num_gpus * peak_flops(gpu, train_dtype))
