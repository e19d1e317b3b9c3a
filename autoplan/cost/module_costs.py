"""What each op and each module of the chain costs, as static data the time and memory models scale.

Every op is classified once:
- kind (chain/ops.py): "gemm" (a matmul with a weight: Linear, conv), "attention" (SDPA or an
  activation x activation matmul), "view" (no kernel: view, transpose, split, ...), or "memory"
  (elementwise, norms, embedding lookups, softmax outside attention: its cost is the bytes it moves);
- tensor-parallel role (chain/tensor_parallel.py): split ops divide FLOPs, bytes and saved
  activations by tp; "rowwise" outputs and everything outside regions stay whole.

Per module and per sample (capture dtype), with tp = 1, the activations kept for backward by
recompute mode (parallelism.activation_checkpoint, chosen per module):
- none:      every saved tensor (OpProfile.saved_bytes; an SDPA call's as the program runs it,
             chain.attention.run_time_saved_bytes);
- selective: the module's input plus the outputs of its gemm and attention ops (torch selective
             activation checkpointing that saves matmul and attention outputs; Korthikanti et al.
             2022 keep matmul outputs and recompute the cheap ops the same way). Recompute costs
             the forward time of the "memory" ops. Grouped expert matmuls are not kept: the program's
             policy (runtime/distributed/recompute.py) saves the outputs of mm, addmm, bmm, attention and the
             expert-parallel route's all-to-alls, not of aten._grouped_mm (as torchtitan's default save list
             leaves it out), so under selective the experts' grouped GEMMs run again in backward
             (OpCost.kept_by_selective); the route's kept all-to-all outputs exist only at ep > 1 and are
             priced there (cost/expert_parallel.py selective_kept_bytes);
- full:      the module's input only (the checkpoint boundary); recompute costs the whole forward.
Each is capped by "none" (recomputing never keeps more).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.chain.attention import run_time_saved_bytes
from autoplan.chain.experts import is_grouped_matmul
from autoplan.chain.modules import ModuleChain
from autoplan.chain.ops import AUTOCAST_LOWER, autocast_fp32_nodes, cost_kind, has_trait, packet
from autoplan.chain.tensor_parallel import TensorParallelFacts
from autoplan.profile_data import ModelProfile, OpProfile

SPLIT_ROLES = frozenset({"colwise", "rowwise", "interior", "head"})
"""Tensor-parallel roles whose FLOPs and bytes divide by tp."""
SEQUENCE_ROLES = frozenset({"sequence", "sequence_local"})
"""Roles whose FLOPs, bytes and saved activations divide by tp with sequence parallelism (the ops between the
pairs run on sequence shards: on DTensors, or inside a module run on the rank's tokens as plain tensors, as a
mixture of experts' router, experts and all-to-all are)."""


def split_roles(sp: bool) -> frozenset[str]:
    """Roles whose FLOPs and bytes divide by tp: the tensor-parallel ones, and with sequence parallelism
    (`sp`) the ops between the pairs."""
    return SPLIT_ROLES | SEQUENCE_ROLES if sp else SPLIT_ROLES
MODES = ("none", "selective", "full")
@dataclass(frozen=True)
class OpCost:
    """One op's cost inputs. Activation quantities are per sample in the capture dtype."""

    kind: str
    """"gemm", "attention", "memory" or "view"."""
    tp_role: str
    """"colwise", "rowwise", "interior", "head", "embedding" or "" (replicated)."""
    flops_fwd: float
    flops_bwd: float
    activation_bytes: float
    """Bytes of activations read and written by the forward (inputs + outputs, parameters excluded)."""
    parameter_bytes: float
    """Bytes of parameters the op reads (not per sample)."""
    input_activation_bytes: float
    """Bytes of the activation inputs alone (what a colwise Linear's input gradient all-reduces)."""
    output_bytes: float
    saved_bytes: float
    saved_scales: bool
    """Whether saved bytes follow the training dtype (False for dropout's one-byte masks)."""
    has_backward: bool
    time_fwd_s: float
    """Measured forward time at the profile's batch (0 when the profile holds estimates)."""
    time_bwd_s: float
    measured: bool
    profile_batch: int
    """Samples the measured times are for."""
    rows: float = 0.0
    """Rows per sample of the op's first input (its leading dimensions: tokens for a [b, s, h] input)."""
    pointwise: bool = False
    """An elementwise op (chain/ops.py "pointwise" trait): what torch.compile fuses
    (calibration.COMPILE_TIME_FACTOR)."""
    shares_gather: bool = False
    """A colwise Linear (or the head) reading the same tensor as an earlier one of its module (k and v after
    q): with sequence parallelism it uses that one's all-gather (runtime/distributed/sequence_gather.py)."""
    autocast_fp32: bool = False
    """Under torch.autocast (bf16 without FSDP2) the op computes in and saves float32 (chain.ops.autocast_fp32_nodes:
    the residual stream, norms, losses), whatever the training dtype."""
    autocast_fp32_share: float = 1.0
    """Of an autocast_fp32 op's saved bytes, the share that stays float32: a pointwise op reading a bf16 value and a
    float32 one (the experts' output times the router's weights) computes in float32 by type promotion but saves
    each input in its own dtype (autocast_fp32_share)."""
    autocast_weight_numel: float = 0.0
    """Parameter elements autocast casts to bf16 for this op (an AUTOCAST_LOWER op's weights and bias, per
    tensor-parallel rank if it is split), which it saves for backward: one copy per micro-batch in flight."""
    grouped: bool = False
    """A grouped expert matmul (chain.experts.is_grouped_matmul): selective recompute runs it again."""
    sums_ranks: bool = False
    """A reduction over a projection's split features (TensorParallelFacts.rank_sums): its output is all-reduced
    over the tensor-parallel ranks in forward (its backward broadcasts the gradient locally)."""
    gathered_shard_bytes: float = 0.0
    """Per sample, the bytes of the sequence-sharded operands an op of a split region reads (DeepSeek-V3's shared
    rotary key, expanded over the heads, copied into the split keys): with sequence parallelism DTensor gathers
    them in forward and scatters their gradient back in backward."""

    @property
    def kept_by_selective(self) -> bool:
        """Whether selective recompute keeps the op's output (a dense matmul or attention); every other op
        (grouped expert matmuls included) is recomputed in backward."""
        return self.kind in ("gemm", "attention") and not self.grouped

    @property
    def compile_class(self) -> str:
        """The op class whose calibration.COMPILE_TIME_FACTOR applies: the kind, "pointwise" for elementwise
        memory ops."""
        return "pointwise" if self.kind == "memory" and self.pointwise else self.kind


@dataclass(frozen=True)
class ModuleCosts:
    """The ops of one module and what sits around them."""

    ops: tuple[OpCost, ...]
    input_bytes: float
    """Bytes per sample entering the module from earlier modules (what full recompute keeps)."""
    output_buffer_bytes: float
    """Bytes per sample of model outputs this module produces (logits the loss holds), else 0."""
    replicated_numel: int
    """Parameter elements only this module reads that every tensor-parallel rank keeps whole."""
    split_numel: int
    """Parameter elements only this module reads that tensor parallelism splits."""
    sequence_input: bool = False
    """With sequence parallelism its input arrives sequence-sharded (it runs ops between the pairs): what full
    and selective recompute keep of it divides by tp."""

    @property
    def weight_gradient_share(self) -> float:
        """Of the module's backward FLOPs, the weight gradients' matmuls' (the W pass a zero-bubble schedule runs
        apart): a matmul reading a parameter computes that weight's gradient with its forward's FLOPs
        (dW = X^T dY); the rest (input gradients, elementwise ops) is the input-gradient pass."""
        backward = sum(op.flops_bwd for op in self.ops)
        weight = sum(op.flops_fwd for op in self.ops if op.kind == "gemm" and op.parameter_bytes > 0)
        return min(1.0, weight / backward) if backward > 0 else 0.0


@dataclass(frozen=True)
class ChainCosts:
    """Static costs of every module of a chain, and which modules are identical (share a signature)."""

    modules: tuple[ModuleCosts, ...]
    signature: tuple[int, ...]
    """signature[u]: index of the first module with exactly the same costs (identical layers tie)."""
    tied_split: tuple[bool, ...]
    """Per ModuleChain.tied_groups entry: True when tensor parallelism splits that parameter."""
    measured: bool
    """Times come from measurements on this machine (`measured_on`)."""
    measured_on: str = ""
    """The device the ops were timed on (ModelProfile.device: "cpu" or "cuda"), "" when none was timed."""
    whole_model_times_s: tuple[tuple[int, float], ...] = ()
    """(batch size, forward+backward seconds) of the whole model measured here (ModelProfile)."""

    def runs(self) -> list[tuple[int, int]]:
        """Maximal runs [start, end) of consecutive modules with the same signature."""
        out, start = [], 0
        for u in range(1, len(self.modules) + 1):
            if u == len(self.modules) or self.signature[u] != self.signature[start]:
                out.append((start, u))
                start = u
        return out


@dataclass(frozen=True)
class OpMarks:
    """What the chain's analyses say of one op beyond its profile (op_cost reads them into its OpCost)."""

    role: str = ""
    """Its tensor-parallel role (TensorParallelFacts.role), "" outside the pairs."""
    shares_gather: bool = False
    """A colwise Linear reading the same input as an earlier one (OpCost.shares_gather)."""
    autocast_fp32: bool = False
    """torch.autocast runs it in float32 (chain.ops.autocast_fp32_nodes)."""
    sums_ranks: bool = False
    """Its output sums over the tensor-parallel ranks' features (OpCost.sums_ranks)."""
    gathered_shard_bytes: float = 0.0
    """Bytes of the sequence-sharded operands it reads in a split region, for the profiled batch."""
    saved_bytes: float | None = None
    """What the op keeps for backward when the program runs it, for the profiled batch, where it differs from the
    capture's (chain.attention.run_time_saved_bytes); None: the capture's."""
    viewed_weight_numel: float = 0.0
    """The parameter elements a grouped expert matmul reads through views of the stacked expert weights
    (grouped_weight_numel), which the program casts to the training dtype each forward."""
    fp32_share: float = 1.0
    """Of an autocast_fp32 op's saved bytes, the float32 share (autocast_fp32_share)."""


def op_cost(op: OpProfile, profile: ModelProfile, marks: OpMarks = OpMarks()) -> OpCost:
    """The cost of `op` per sample, with what the chain's analyses found of it (`marks`)."""
    role, saved_bytes, viewed_weight_numel = marks.role, marks.saved_bytes, marks.viewed_weight_numel
    batch = profile.batch_size
    param_bytes = sum(profile.parameters.get(p, 0) for p in op.params) * profile.parameter_bytes_per_element
    param_bytes = min(param_bytes, op.input_bytes)  # buffers read as params are not in `parameters`
    measured = op.source == "measured"
    cast = packet(op) in AUTOCAST_LOWER and op.dtype == "float32"
    grouped = is_grouped_matmul(op)
    cast_numel = (viewed_weight_numel if grouped else param_bytes / profile.parameter_bytes_per_element if cast
                  else 0.0) if op.dtype == "float32" else 0.0
    return OpCost(
        kind=cost_kind(op),
        tp_role=role,
        flops_fwd=op.flops_fwd / batch,
        flops_bwd=op.flops_bwd / batch,
        activation_bytes=(op.input_bytes - param_bytes + op.output_bytes) / batch,
        parameter_bytes=float(param_bytes),
        input_activation_bytes=(op.input_bytes - param_bytes) / batch,
        output_bytes=op.output_bytes / batch,
        saved_bytes=(op.saved_bytes if saved_bytes is None else saved_bytes) / batch,
        saved_scales=not has_trait(op, "mask"),
        pointwise=has_trait(op, "pointwise"),
        has_backward=op.flops_bwd > 0 or op.time_bwd_s > 0 or op.saved_bytes > 0,
        time_fwd_s=op.time_fwd_s if measured else 0.0,
        time_bwd_s=op.time_bwd_s if measured else 0.0,
        measured=measured,
        profile_batch=batch,
        rows=_rows(op) / batch,
        shares_gather=marks.shares_gather,
        autocast_fp32=marks.autocast_fp32,
        autocast_fp32_share=marks.fp32_share,
        autocast_weight_numel=cast_numel,
        grouped=grouped,
        sums_ranks=marks.sums_ranks,
        gathered_shard_bytes=marks.gathered_shard_bytes / batch,
    )


def _rows(op: OpProfile) -> float:
    """Product of the first input's dimensions but the last."""
    if not op.input_shapes or not op.input_shapes[0]:
        return 0.0
    rows = 1
    for d in op.input_shapes[0][:-1]:
        rows *= d
    return float(rows)


def _op_costs(nodes, by_node: dict[str, OpProfile], profile: ModelProfile, facts: TensorParallelFacts,
              fp32: frozenset[str] = frozenset()):
    """The OpCost of each of a module's ops, marking the colwise Linears that share an earlier one's input and
    the ops autocast keeps in float32 (`fp32`)."""
    gathered: set[str] = set()
    for node in nodes:
        op, role = by_node[node], facts.role.get(node, "")
        source = op.inputs[0] if role in ("colwise", "head") and op.inputs else None
        shards = sum(by_node[src].output_bytes for src in op.inputs
                     if src in by_node and facts.role.get(src, "") in SEQUENCE_ROLES) if role == "interior" else 0.0
        saved = (run_time_saved_bytes(op, by_node, profile.masks_left_to_is_causal) if cost_kind(op) == "attention"
                 else None)
        yield op_cost(op, profile, OpMarks(
            role, shares_gather=source in gathered, autocast_fp32=node in fp32, sums_ranks=node in facts.rank_sums,
            gathered_shard_bytes=shards, saved_bytes=saved,
            viewed_weight_numel=grouped_weight_numel(op, by_node, profile) if is_grouped_matmul(op) else 0.0,
            fp32_share=autocast_fp32_share(op, by_node, fp32) if node in fp32 else 1.0))
        if source is not None:
            gathered.add(source)


def autocast_fp32_share(op: OpProfile, by_node: dict[str, OpProfile], fp32: frozenset[str]) -> float:
    """The share of an op's saved bytes that stays float32 under torch.autocast, for an op autocast keeps in float32
    (chain.ops.autocast_fp32_nodes): a pointwise op that saves its activation inputs (its saved bytes are theirs)
    keeps each in the dtype it arrives in, float32 (an fp32 op's output) or bf16 (anything else); any other op
    saves float32 (1.0)."""
    if not has_trait(op, "pointwise"):
        return 1.0
    inputs = [by_node[src] for src in dict.fromkeys(op.inputs) if src in by_node and by_node[src].dtype == "float32"]
    total = sum(src.output_bytes for src in inputs)
    if not inputs or total <= 0 or abs(total - op.saved_bytes) > 0.01 * total:
        return 1.0
    return sum(src.output_bytes for src in inputs if src.node in fp32) / total


def grouped_weight_numel(op: OpProfile, by_node: dict[str, OpProfile], profile: ModelProfile) -> float:
    """Parameter elements a grouped expert matmul reads as weights: the stacked expert parameters reaching its
    inputs through views (transformers transposes gate_up_proj / down_proj before the grouped matmul). The
    program casts an experts module's parameters to the training dtype each forward (autocast does not cast
    torch._grouped_mm: runtime/distributed/expert_parallel.py `_compute_on_local_tensors`), and the grouped matmul saves the
    cast copies for backward, as autocast's copies of a Linear's weight are saved."""
    seen: set[str] = set()
    stack = [src for src in op.inputs if src in by_node]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        source = by_node[node]
        if cost_kind(source) == "view":
            stack.extend(src for src in source.inputs if src in by_node)
    params = {p for node in seen if cost_kind(by_node[node]) == "view" for p in by_node[node].params} | set(op.params)
    return float(sum(profile.parameters.get(p, 0) for p in params))


def chain_costs(profile: ModelProfile, chain: ModuleChain, facts: TensorParallelFacts) -> ChainCosts:
    by_node = {op.node: op for op in profile.ops}
    outputs = set(profile.output_nodes)
    tied = {g.parameter for g in chain.tied_groups}
    modules, signatures, seen = [], [], {}
    fp32 = autocast_fp32_nodes(profile.ops)
    for i, module in enumerate(chain.modules):
        ops = tuple(_op_costs(module.ops, by_node, profile, facts, fp32))
        own = [p for p in module.parameters if p not in tied]
        split = sum(profile.parameters[p] for p in own if p in facts.sharded_parameters)
        costs = ModuleCosts(
            ops=ops,
            input_bytes=chain.cut_bytes[i - 1] if i > 0 else 0.0,
            output_buffer_bytes=sum(by_node[n].output_bytes for n in module.ops if n in outputs) / profile.batch_size,
            replicated_numel=sum(profile.parameters[p] for p in own) - split,
            split_numel=split,
            sequence_input=any(op.tp_role in SEQUENCE_ROLES for op in ops),
        )
        modules.append(costs)
        signatures.append(seen.setdefault(costs, i))
    return ChainCosts(
        modules=tuple(modules),
        signature=tuple(signatures),
        tied_split=tuple(g.parameter in facts.sharded_parameters for g in chain.tied_groups),
        measured=any(op.source == "measured" for op in profile.ops),
        measured_on=profile.device if any(op.source == "measured" for op in profile.ops) else "",
        whole_model_times_s=tuple(sorted(profile.whole_model_times_s.items())),
    )


def saved_by_mode(module: ModuleCosts, tp: int, scale: float, sp: bool = False,
                  compiled: bool = False, autocast: bool = False) -> dict[str, float]:
    """Activation bytes per sample kept for backward under each recompute mode, in the training dtype
    (`scale` = its element size over the capture's). With sequence parallelism (`sp`) the ops between the
    pairs keep sequence shards (norm inputs, dropout masks: Korthikanti et al. 2022, Eq. 4), and so does the
    module's input when it arrives sequence-sharded. So does the input a colwise Linear (or the head) all-gathers:
    runtime/distributed/sequence_gather.py keeps the shard for backward and gathers it again there, as Megatron-LM does;
    in a `compiled` module torch.compile's graph keeps the gathered input whole (those hooks stay out of it),
    but the head's: runtime/distributed/compile.py leaves the chain modules of the tensor-parallel plan eager.
    Under torch.autocast (`autocast`: bf16 without FSDP2) the ops it keeps in float32 (OpCost.autocast_fp32) save
    float32 and the module's input (the residual stream) arrives in float32; the rest saves bf16 (`scale`)."""
    def share(nbytes: float, split: bool) -> float:
        return nbytes / tp if split else nbytes

    gathered = {"head"} if compiled else {"colwise", "head"}
    saved_split = {"rowwise", "interior"} | (SEQUENCE_ROLES | gathered if sp else set())

    def op_scale(op: OpCost) -> float:
        if not op.saved_scales:
            return 1.0
        if autocast and op.autocast_fp32:
            return op.autocast_fp32_share + (1.0 - op.autocast_fp32_share) * scale
        return scale

    none = sum(share(op.saved_bytes * op_scale(op), op.tp_role in saved_split) for op in module.ops)
    input_scale = 1.0 if autocast else scale
    module_input = share(module.input_bytes, sp and module.sequence_input)
    kept = input_scale * module_input + scale * sum(share(op.output_bytes, op.tp_role in ("colwise", "interior"))
                                                    for op in module.ops if op.kept_by_selective)
    return {"none": none, "selective": min(none, kept), "full": min(none, input_scale * module_input)}


AUTOCAST_SPLIT_ROLES = frozenset({"colwise", "rowwise", "head"})
"""Tensor-parallel roles whose weights a rank holds 1/tp of (its autocast copy too)."""


def autocast_weight_copy_bytes(module: ModuleCosts, tp: int, element: int) -> float:
    """Bytes of the `element`-byte (bf16: 2) copies torch.autocast makes of the weights its matmuls read. Without
    recompute they are saved for backward, one copy per micro-batch in flight (autocast's cache is cleared when
    each micro-batch's forward leaves its autocast region); selective recompute (which saves matmul outputs only)
    and full recompute remake them in backward: one module's copies at a time."""
    return element * sum(op.autocast_weight_numel / (tp if op.tp_role in AUTOCAST_SPLIT_ROLES else 1)
                         for op in module.ops)

