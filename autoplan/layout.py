"""A layout's vocabulary and the rules of a valid layout: the one place for both.

Vocabulary. Every concept has one long name, the plan.json field (torchtitan's parallelism config where
torchtitan has one), and one short name used everywhere else: --pin keys, CSV columns, the generated
train.py's constants (upper case), mesh dimension names and messages ("tp=8 does not divide ...").
VOCABULARY lists them; docs/layouts.md shows the table.

Rules. `problems(layout, scope)` lists every rule a layout breaks, each with its arithmetic. A layout
may be partial (None: not chosen yet, as in --pin before the search) and a scope may lack facts (the
model's modules before capture): a rule runs only when everything it reads is known. The pins, the
search, plan loading and codegen all call it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable



@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule the program runs with torch.distributed.pipelining: the one place for its facts."""

    name: str
    """Its name everywhere (plan.json, --pin schedule=..., CSV columns, train.py, messages)."""
    torch_class: str
    """The torch.distributed.pipelining class that runs it (runtime/distributed/steps.py resolves the name)."""
    torchtitan_name: str
    """torchtitan's parallelism.pipeline_parallel_schedule for it."""
    placement: str
    """Which pipeline rank runs stage s of pp x v: "loop", rank s % pp (torch's loop order); "v", rank s for
    s < pp and rank 2 pp - 1 - s after (the V: rank r holds stages r and 2 pp - 1 - r)."""
    virtual_stages: tuple[int, int | None]
    """Stages per rank it runs: (least, most), most None for any number."""
    split_backward: bool
    """Whether it runs each backward as an input-gradient pass (B) and a later weight-gradient pass (W)."""
    min_microbatches: str
    """Least micro-batches per step: "1", "pp" (at least one per rank), "pp_multiple" (a multiple of pp: torch's
    rounds of pp micro-batches), "stages" (at least pp x v)."""
    in_flight: str
    """How many micro-batches a stage keeps activations for at its rank's peak (cost/pipeline.py
    microbatches_in_flight): "all" (every forward runs before the first backward), "pp_minus_stage" (1F1B's
    warm-up: pp - s), "rounds" (torch's interleaved warm-up, in rounds of micro-batches per local stage),
    "simulated" (read off the rank's simulated operation order)."""
    searched_from: int
    """Least stages per rank the search tries (solve/layouts.py): interleaved from 2, as with 1 it runs as 1F1B."""
    display_name: str
    """What the report calls it."""


SCHEDULE_TABLE = (
    Schedule("gpipe", "ScheduleGPipe", "GPipe", "loop", (1, 1), False, "1", "all", 1, "GPipe"),
    Schedule("1f1b", "Schedule1F1B", "1F1B", "loop", (1, 1), False, "pp", "pp_minus_stage", 1, "1F1B"),
    Schedule("interleaved", "ScheduleInterleaved1F1B", "Interleaved1F1B", "loop", (1, None), False, "pp_multiple",
             "rounds", 2, "interleaved 1F1B"),
    Schedule("zb-interleaved", "ScheduleInterleavedZeroBubble", "InterleavedZeroBubble", "loop", (1, None), True,
             "pp_multiple", "simulated", 1, "zb-interleaved"),
    Schedule("zbv", "ScheduleZBVZeroBubble", "ZBVZeroBubble", "v", (2, 2), True, "1", "simulated", 2, "zbv"),
    Schedule("dualpipev", "ScheduleDualPipeV", "DualPipeV", "v", (2, 2), True, "stages", "simulated", 2, "dualpipev"),
)
"""Every pipeline schedule, as data: the plan vocabulary, the rules below, the search (solve/layouts.py), the program
(runtime/distributed/steps.py), the cost model (cost/pipeline.py: its operation order, ORDERS, is the one other place a schedule
is written) and the report read it."""
SCHEDULE_BY_NAME = {schedule.name: schedule for schedule in SCHEDULE_TABLE}
SCHEDULES = tuple(SCHEDULE_BY_NAME)
ZERO_BUBBLE_SCHEDULES = tuple(s.name for s in SCHEDULE_TABLE if s.split_backward)
DEFAULT_SCHEDULE = "1f1b"
"""The schedule of a plan, a pin or a program that names none (and of every pp=1 layout)."""


def placement_of(schedule: str) -> str:
    """The stage placement of `schedule` (Schedule.placement); "loop" for a name outside the table (callers that
    price or run only the table's schedules refuse those themselves)."""
    return SCHEDULE_BY_NAME[schedule].placement if schedule in SCHEDULE_BY_NAME else "loop"


def stage_rank(stage: int, pp: int, placement: str) -> int:
    """The pipeline rank that runs `stage` (see Schedule.placement): the one place for the rule."""
    if placement == "v":
        local, offset = divmod(stage, pp)
        return offset if local % 2 == 0 else pp - 1 - offset
    return stage % pp


def rank_stages(pp_rank: int, pp: int, virtual_stages: int, placement: str) -> list[int]:
    """The stages pipeline rank `pp_rank` runs, in its local order (stage_rank inverted)."""
    if placement == "loop":  # stage_rank's s % pp, without trying every stage (the solvers ask per rank and split)
        return list(range(pp_rank, pp * virtual_stages, pp))
    return [s for s in range(pp * virtual_stages) if stage_rank(s, pp, placement) == pp_rank]
RECOMPUTE = ("none", "selective", "full")
RESHARD = ("always", "never")
SEQUENCE_PARALLEL = ("on", "off")
"""sp: enable_sequence_parallel true ("on", the default whenever tp > 1) or false."""
"""fsdp_reshard_after_forward: FSDP2 frees gathered parameters after forward ("always", ZeRO-3) or keeps
them to backward ("never", the closest FSDP2 has to ZeRO-1/2). torchtitan's "default" is not used."""
OFFLOAD = ("none", "cpu")
"""enable_cpu_offload false or true: FSDP2's CPUOffloadPolicy keeps parameters, gradients and optimizer state
on the host and steps the optimizer there."""
LOSS_PARALLEL = ("on", "off")
"""loss_parallel: the cross-entropy on vocabulary-sharded logits ("on") or on gathered ones."""
COMPILE = ("off", "on")
"""compile.enable: torch.compile per chain module (torchtitan compiles each TransformerBlock)."""
TENSOR_PARALLEL_STYLES = ("colwise", "rowwise", "replicate", "sequence_local")
"""tensor_parallel_plan styles: a Linear split by output rows or by input columns, or a module run inside a split
region whose parameters stay whole (a per-head QK-norm: replicated on the tensor-parallel mesh, gradients summed;
what torchtitan's Qwen3 plan does for q_norm and k_norm), or ("sequence_local", with sequence parallelism only) a
module that computes token by token as a whole and runs on each rank's sequence shard as plain tensors (a mixture
of experts' routing; its parameters replicated, gradients summed)."""
ZERO_STAGES = (0, 1, 2, 3)

ALL_FEATURES = frozenset({
    "tp", "sp", "tp_vocab_parallel", "zero2", "zero3", "hsdp", *SCHEDULES, "selective", "full",
    "pp_scatter_gather",  # Megatron-LM's pipeline sends split over tensor-parallel ranks (not in torch)
    "tp_fused_split",     # Megatron-LM's fused qkv with interleaved weights, split per rank (not in torch TP)
    "offload", "compile",
    "cp",                 # context parallelism (ring attention over SDPA) with FSDP/HSDP
    "cp_pp",              # context parallelism inside pipeline stages
    "cp_tp",              # context parallelism with tensor parallelism (each tp rank rings its heads)
    "ep",                 # expert parallelism (all-to-all dispatch) over FSDP2's data-parallel ranks
    "ep_pp",              # expert parallelism inside pipeline stages (ep over each stage's data-parallel ranks)
    "ep_tp",              # expert parallelism folded over tensor-parallel ranks (experts whole, ETP 1)
    "ep_cp",              # expert parallelism folded over context-parallel ranks; priced, not yet in train.py
    "ep_ddp",             # expert parallelism across replicas (ep not dividing dp_shard x cp x tp, or DDP); priced only
    "ep_offload",         # expert parallelism with FSDP2's CPU offload; priced, not yet in train.py
    "compile_pp_experts", # torch.compile of pipeline stages holding expert layers; priced, fails in inductor here
    "compile_tp_recompute",  # compile of recomputed tp modules (sp off, or in the ring); priced, fails here
    "compile_tp_experts", # torch.compile with tensor parallelism on a model with expert layers; priced, parity fails
})
"""Everything the cost model can price. Beyond SUPPORTED, two features of Megatron-LM that torch does not run,
expert parallelism together with context parallelism, DDP or CPU offload, and torch.compile of pipeline stages
holding expert layers, which the generated program does not run, priced only when a caller asks for them (tests
of the cost model; a search with features=ALL_FEATURES); the default search and autoplan.estimate, which
benchmarks/accuracy.py prices the published runs with, never use them."""

SUPPORTED = frozenset({
    "tp",                 # Megatron colwise/rowwise pairs (Plan.tensor_parallel_plan)
    "sp",                 # sequence parallel between the pairs (Parallelism.sp)
    "tp_vocab_parallel",  # the word embedding rowwise, the head colwise, the loss on its sharded logits
    "zero2",              # FSDP2 reshard_after_forward=False (zero=1 and zero=2)
    "zero3",              # FSDP2 fully_shard
    "hsdp",               # dp_replicate > 1 and dp_shard > 1 with zero 3
    "gpipe",
    "1f1b",
    "interleaved",        # virtual stages (ScheduleInterleaved1F1B)
    "zb-interleaved",     # zero-bubble schedules: backward split into input and weight gradients (SCHEDULE_TABLE)
    "zbv",
    "dualpipev",
    "selective",          # selective activation checkpointing per module
    "full",               # full activation checkpointing per module
    "offload",            # FSDP2 CPUOffloadPolicy (needs an accelerator: torch refuses it on CPU devices)
    "compile",            # torch.compile per chain module (inductor; its CPU backend too)
    "cp",                 # context parallelism: torch's context_parallel over SDPA, FSDP2 over dp_shard x cp
    "cp_pp",              # cp inside pipeline stages: each rank's stages exported on its share of the sequence
    "cp_tp",              # context parallelism with tensor parallelism: the ring over each tp rank's heads
    "ep",                 # expert parallelism: experts split over ep of the FSDP2 ranks, all-to-all dispatch
    "ep_tp",              # ep folded over the tp ranks: experts whole (ETP 1), each tp rank routes 1/tp of the tokens
    "ep_pp",              # ep inside pipeline stages: the stages call the experts modules (runtime/distributed/expert_calls.py)
    "ep_cp",              # ep folded over the context-parallel ranks, which route their own sequence shares
})
"""What codegen can run. Remove a name to stop the search from emitting (or accepting a pin of) it.
Not yet: pp_scatter_gather and tp_fused_split (not in torch), ep_cp, ep_ddp and ep_offload (train.py cuts expert
parallelism from dp_shard x tp of each pipeline stage and replica: not over context-parallel ranks, not across
replicas, no CPU offload), compile_pp_experts (inductor stops in the experts' backward),
compile_tp_recompute (AOTAutograd stops on a recomputed module over tensor-parallel shards that are not sequence
shards, or in the ring), compile_tp_experts (compiled, a mixture of experts at tp > 1 trains off the reference)."""

@dataclass(frozen=True)
class UnsupportedPair:
    """Two parts of a layout the program does not run together, unless the features hold `feature` (ALL_FEATURES:
    the cost model prices them, so a caller pricing other programs may allow it)."""

    first: str
    """A part of a layout, a key of PARTS ("cp": cp > 1, "offload": offload=cpu, ...)."""
    second: str
    feature: str
    """The ALL_FEATURES name that lifts the rule."""
    reason: str
    """Why, after "cp=2 with pp=2: "."""
    use: tuple[str, str] = ("", "")
    """The way out, in the order the message offers them; ("", ""): first off, then second off."""


PARTS: dict[str, tuple[Callable[["Layout"], bool], Callable[["Layout"], str], str]] = {
    "tp": (lambda x: _positive(x.tp) and x.tp > 1, lambda x: f"tp={x.tp}", "tp=1"),
    "cp": (lambda x: _positive(x.cp) and x.cp > 1, lambda x: f"cp={x.cp}", "cp=1"),
    "ep": (lambda x: _positive(x.ep) and x.ep > 1, lambda x: f"ep={x.ep}", "ep=1"),
    "pp": (lambda x: _positive(x.pp) and x.pp > 1, lambda x: f"pp={x.pp}", "pp=1"),
    "offload": (lambda x: x.offload == "cpu", lambda x: "offload=cpu", "offload=none"),
}
"""Each part a pair may name: (whether the layout uses it, how a message writes it, how to leave it out)."""

UNSUPPORTED_PAIRS = (
    UnsupportedPair("cp", "pp", "cp_pp", "the program cannot yet run context parallelism inside pipeline stages"),
    UnsupportedPair("cp", "tp", "cp_tp", "the program cannot yet run context parallelism together with tensor "
                    "parallelism"),
    UnsupportedPair("ep", "pp", "ep_pp", "expert parallelism inside pipeline stages is not supported here"),
    UnsupportedPair("ep", "tp", "ep_tp", "the program cannot yet run expert parallelism together with tensor "
                    "parallelism"),
    UnsupportedPair("ep", "cp", "ep_cp", "the program does not yet fold expert parallelism over the "
                    "context-parallel ranks"),
    UnsupportedPair("ep", "offload", "ep_offload", "the program does not yet run the experts' own FSDP2 units with "
                    "CPU offload", ("offload=none", "ep=1")),
)
"""Every "A with B is not supported (reason)" rule, as data (_unsupported_pairs reads it; rules that need arithmetic,
such as ep across replicas, stay functions). A new pair costs a row here and its feature name in ALL_FEATURES."""


def _unsupported_pairs(layout: "Layout", have: frozenset[str]) -> list[str]:
    out = []
    for pair in UNSUPPORTED_PAIRS:
        (uses_a, text_a, off_a), (uses_b, text_b, off_b) = PARTS[pair.first], PARTS[pair.second]
        if pair.feature not in have and uses_a(layout) and uses_b(layout):
            first, second = pair.use if pair.use[0] else (off_a, off_b)
            out.append(f"{text_a(layout)} with {text_b(layout)}: {pair.reason} (use {first} or {second})")
    return out


CONTEXT_PARALLEL_CHUNKS = 2
"""Chunks per context-parallel rank: torch's causal load balancing cuts each sequence into 2 x cp chunks and
gives rank r chunks r and 2cp-1-r, so every rank computes as much of the causal triangle."""


@dataclass(frozen=True)
class Term:
    short: str
    """Pin key, CSV column, train.py constant (upper case), mesh dimension, name in messages."""
    plan_field: str
    """plan.json field ("parallelism." unless it says otherwise), or "" when the term is derived."""
    meaning: str
    plan_values: tuple[tuple[object, object], ...] = ()
    """(plan.json value, Parallelism value) pairs where the two differ (plan.json keeps torchtitan's spelling);
    empty: the same value."""
    pin: bool = False
    """--pin may fix it (solve/pins.py PIN_KEYS, in this table's order)."""


VOCABULARY = (
    Term("dp", "", "data-parallel degree, dp_replicate x dp_shard (a pin fixes the total)", pin=True),
    Term("dp_replicate", "data_parallel_replicate_degree", "replicas that all-reduce gradients (DDP, HSDP's "
         "replicate dimension)"),
    Term("dp_shard", "data_parallel_shard_degree", "ranks that shard parameters, gradients and optimizer "
         "state (FSDP2)"),
    Term("reshard", "fsdp_reshard_after_forward", "always: FSDP2 frees gathered parameters after forward "
         "(ZeRO-3); never: keeps them to backward (ZeRO-1/2)", (("always", True), ("never", False))),
    Term("tp", "tensor_parallel_degree", "ranks that split each layer's matmuls (Megatron pairs)", pin=True),
    Term("sp", "enable_sequence_parallel", "sequence parallel (on or off; on by default whenever tp > 1): "
         "norms, dropout and residual adds between the tensor-parallel pairs run on sequence shards", pin=True),
    Term("loss_parallel", "disable_loss_parallel", "on: the cross-entropy runs on the logits sharded on the "
         "vocabulary by the tensor-parallel head (loss_parallel); off: they are gathered first (plan.json stores "
         "the negation, torchtitan's name)", ((False, True), (True, False))),
    Term("cp", "context_parallel_degree", "ranks that split each sequence (ring attention over SDPA); the "
         "model states are FSDP-sharded over dp_shard x cp, as torchtitan", pin=True),
    Term("ep", "expert_parallel_degree", "ranks that split each expert layer's experts (all-to-all dispatch), "
         "cut from the dp_shard x cp x tp ranks as torchtitan and Megatron-Core fold it: it does not multiply the "
         "GPU count; each tp rank routes its own 1/tp of the tokens", pin=True),
    Term("pp", "pipeline_parallel_degree", "pipeline ranks", pin=True),
    Term("zero", "", "pin shorthand: 0 = dp_shard 1 (DDP); 1 or 2 = dp_shard dp, reshard never; 3 = "
         "reshard always", pin=True),
    Term("schedule", "pipeline_parallel_schedule", "gpipe, 1f1b, interleaved, or a zero-bubble schedule (backward "
         "split into input and weight gradients): zb-interleaved, zbv or dualpipev", pin=True),
    Term("virtual_stages", "pipeline_parallel_virtual_stages", "stages per pipeline rank (interleaved, "
         "zb-interleaved; 2 for zbv and dualpipev, placed in a V)"),
    Term("microbatch", "pipeline_parallel_microbatch_size", "samples per micro-batch", pin=True),
    Term("microbatches", "pipeline_parallel_num_microbatches", "micro-batches per step per data-parallel "
         "rank (gradient accumulation when pp = 1)"),
    Term("recompute", "activation_checkpoint", "activation checkpointing mode: none, selective or full", pin=True),
    Term("recompute_modules", "activation_checkpoint_modules (top level)", "the modules recomputed in "
         "backward, listed in full"),
    Term("modules", "stages[].modules", "the modules of the model's chain a pipeline stage runs (nn.Module "
         "FQNs; stages are cut between them)"),
    Term("offload", "enable_cpu_offload", "none or cpu: FSDP2 keeps parameters, gradients and optimizer state in "
         "host memory and runs the optimizer step on the CPU (CPUOffloadPolicy)", pin=True),
    Term("compile", "compile.enable (top level)", "on or off: torch.compile per chain module (inductor fuses "
         "pointwise ops)", pin=True),
    Term("gradient_sync", "", "how data-parallel ranks combine gradients: collectives (all-reduce, "
         "reduce-scatter and all-gather among the ranks: what train.py runs) or parameter_server (pushed to and "
         "pulled from server shards: priced in candidates.csv and the report to show why not, never generated)"),
    Term("batch_norm_modules", "batch_norm_modules (top level)", "modules that normalize over the batch "
         "(BatchNorm): statistics synchronized over the data-parallel ranks (SyncBatchNorm), never split into "
         "micro-batches nor recomputed"),
)


@dataclass(frozen=True)
class Layout:
    """A layout, whole or in part: None means not chosen (yet). Field names are the short names."""

    dp: int | None = None
    dp_replicate: int | None = None
    dp_shard: int | None = None
    reshard: str | None = None
    zero: int | None = None
    """Only from --pin (the shorthand for dp_shard and reshard)."""
    tp: int | None = None
    sp: str | None = None
    """"on" or "off" (SEQUENCE_PARALLEL); only matters when tp > 1."""
    cp: int | None = None
    """Context-parallel degree: ranks sharing each sequence (they multiply the GPU count with dp, tp, pp)."""
    ep: int | None = None
    """Expert-parallel degree: ranks sharing each expert layer's experts, cut from the dp_shard x cp x tp ranks
    (expert_folded_ranks)."""
    pp: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    microbatch: int | None = None
    microbatches: int | None = None
    recompute: str | None = None
    offload: str | None = None
    """"none" or "cpu" (OFFLOAD)."""
    compile: str | None = None
    """"off" or "on" (COMPILE)."""
    loss_parallel: str | None = None
    """"on" or "off" (LOSS_PARALLEL); only matters when tp > 1 (not a pin: the search reads it off the loss_fn)."""

    def text(self) -> str:
        """"dp=2,tp=4,..." with the chosen fields, in this class's order."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) is not None)


@dataclass(frozen=True)
class Parallelism:
    """A whole layout: how the work is split (torchtitan's ParallelismConfig and ParallelDims in one frozen value).

    Field names are VOCABULARY's short names and the values real types (bools for sp, loss_parallel, reshard and
    offload); plan.json keeps torchtitan's long names through one codec (to_plan_fields, from_plan_fields, read off
    VOCABULARY's plan_field and plan_values). Degrees multiply to the number of GPUs (ep is folded, it does not).
    Fields in plan.json's order. Layout is its partial twin (pins, rules); problems() its validation."""

    dp_replicate: int = 1
    """Replicas that all-reduce gradients (DDP; the replicate dimension of HSDP)."""
    dp_shard: int = 1
    """Ranks that shard parameters, gradients and optimizer state (FSDP2); 1 = not sharded."""
    reshard: bool = False
    """FSDP2 frees gathered parameters after forward and gathers them again for backward (ZeRO-3; plan.json
    "always"); else keeps them to backward (optimizer state and gradients sharded: ZeRO-1/2; "never")."""
    tp: int = 1
    """Ranks that split each layer's matmuls (Megatron-style)."""
    pp: int = 1
    """Pipeline ranks."""
    schedule: str = DEFAULT_SCHEDULE
    """One of SCHEDULES."""
    microbatch: int = 1
    """Samples per micro-batch."""
    microbatches: int = 1
    """Micro-batches per step per data-parallel rank (gradient accumulation when pp = 1)."""
    recompute: str = "none"
    """"none", "selective" or "full" (Plan.activation_checkpoint_modules lists the modules)."""
    virtual_stages: int = 1
    """Stages per pipeline rank (> 1 for the interleaved and zero-bubble schedules): pp x virtual_stages stages, stage
    s on pipeline rank stage_rank(s)."""
    sp: bool = False
    """With tp > 1: the ops between the tensor-parallel pairs (norms, dropout, residual adds) run on sequence shards
    (Korthikanti et al. 2022). The search turns it on whenever tp > 1 and the model allows it; false when tp = 1 and
    in a plan.json written before the key existed (what it was priced as)."""
    loss_parallel: bool = True
    """With tp > 1 and the head column-sharded on the vocabulary: the cross-entropy runs on the sharded logits
    (torch's loss_parallel); false gathers the logits first (plan.json: disable_loss_parallel, the negation)."""
    offload: bool = False
    """FSDP2 keeps the sharded parameters, gradients and optimizer state in host memory and the optimizer steps on
    the CPU (CPUOffloadPolicy; GPU only)."""
    cp: int = 1
    """Ranks that split each sequence (ring attention over SDPA, causal load balancing); the model states are
    FSDP-sharded over dp_shard x cp (torchtitan's dp_shard_cp). Multiplies the world size."""
    ep: int = 1
    """Ranks that split each expert layer's experts (all-to-all dispatch), folded over the dp_shard x cp x tp ranks
    (expert_folded_ranks): it does not multiply the world size."""

    @property
    def dp(self) -> int:
        """Data-parallel ranks: dp_replicate x dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        """dp x cp x tp x pp (ep is folded over dp_shard x cp x tp: it does not multiply)."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP2 shards the model states over: dp_shard x cp (torchtitan's dp_shard_cp mesh)."""
        return self.dp_shard * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters, gradients and optimizer state are sharded (FSDP2, fsdp_shard > 1); else replicated (DDP)."""
        return self.fsdp_shard > 1

    @property
    def reshards_after_forward(self) -> bool:
        """FSDP2 shards the model states and frees the gathered parameters after forward (ZeRO-3)."""
        return self.fsdp_enabled and self.reshard

    @property
    def zero(self) -> int:
        """The ZeRO stage whose memory this layout's sharding has (zero_of over fsdp_shard): 0, 2 or 3."""
        return zero_of(self.fsdp_shard, self.reshard)

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def sp_enabled(self) -> bool:
        """Sequence parallelism runs (it only means something with tp > 1)."""
        return self.sp and self.tp > 1

    @property
    def loss_parallel_enabled(self) -> bool:
        """The loss runs on vocabulary-sharded logits (it only means something with tp > 1)."""
        return self.loss_parallel and self.tp > 1

    @property
    def placement(self) -> str:
        """How pipeline ranks hold the stages (Schedule.placement)."""
        return placement_of(self.schedule)

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank that runs `stage` of pp x virtual_stages (layout.stage_rank)."""
        return stage_rank(stage, self.pp, self.placement)

    def rank_stages(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank `pp_rank` runs, in its local order."""
        return rank_stages(pp_rank, self.pp, self.virtual_stages, self.placement)

    def world_size_arithmetic(self) -> str:
        """"pp 1 x dp_replicate 2 x dp_shard 1 x cp 1 x tp 1 = 2 processes" (for messages: every factor of
        world_size, in the device mesh's order)."""
        return (f"pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x cp {self.cp} x "
                f"tp {self.tp} = {self.world_size} process{'es' if self.world_size != 1 else ''}")

    def __getattr__(self, name: str) -> object:
        """A field read by its plan.json name (plan.parallelism.tensor_parallel_degree), with plan.json's value,
        through the codec: code written against plan.json's keys (a user's own loop) keeps reading a plan. Only
        reached for names that are not attributes."""
        if not name.startswith("_"):
            for short, plan_field, _, encode in PLAN_CODEC:
                if plan_field == name:
                    value = getattr(self, short)
                    return encode.get(value, value)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def layout(self, compile: bool | None = None) -> Layout:
        """Its partial twin, every field chosen, in the rules' words (with `compile` when known)."""
        return Layout(dp=self.dp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard,
                      reshard=RESHARD[0] if self.reshard else RESHARD[1], tp=self.tp, pp=self.pp,
                      schedule=self.schedule, virtual_stages=self.virtual_stages, microbatch=self.microbatch,
                      microbatches=self.microbatches, recompute=self.recompute,
                      sp=SEQUENCE_PARALLEL[0] if self.sp else SEQUENCE_PARALLEL[1],
                      loss_parallel=LOSS_PARALLEL[0] if self.loss_parallel else LOSS_PARALLEL[1],
                      offload=OFFLOAD[1] if self.offload else OFFLOAD[0], cp=self.cp, ep=self.ep,
                      compile=None if compile is None else COMPILE[1] if compile else COMPILE[0])

    @staticmethod
    def of(layout: Layout) -> "Parallelism":
        """The whole layout `layout` describes, its unchosen fields at their defaults (dp_replicate from dp and
        dp_shard, dp_shard and reshard from a zero pin)."""
        out = {}
        if layout.zero is not None:
            out["reshard"] = layout.zero == 3
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "schedule", "microbatch", "microbatches", "recompute",
                     "virtual_stages", "cp", "ep"):
            if getattr(layout, name) is not None:
                out[name] = getattr(layout, name)
        if layout.dp is not None and layout.dp_replicate is None:
            shard = layout.dp_shard if layout.dp_shard is not None else (1 if layout.zero in (None, 0) else layout.dp)
            out["dp_shard"], out["dp_replicate"] = shard, layout.dp // shard
        for name, on in (("reshard", RESHARD[0]), ("sp", SEQUENCE_PARALLEL[0]), ("offload", OFFLOAD[1])):
            if getattr(layout, name) is not None:
                out[name] = getattr(layout, name) == on
        if layout.loss_parallel is not None:
            out["loss_parallel"] = layout.loss_parallel == LOSS_PARALLEL[0]
        return Parallelism(**out)

    def problems(self, scope: "Scope | None" = None, compile: bool | None = None) -> list[str]:
        """Every rule this layout breaks in `scope` (layout.problems; nothing known of the model by default)."""
        return problems(self.layout(compile), scope or Scope())

    def text(self) -> str:
        """"dp=8 tp=2 sp=on pp=2 ..." in the short names, the fields that matter to this layout (describe it)."""
        text = f"dp={self.dp}"
        if self.dp_replicate > 1 and self.dp_shard > 1:
            text += f" ({self.dp_replicate}x{self.dp_shard} HSDP)"
        text += f" tp={self.tp}"
        if self.tp > 1:
            text += f" sp={'on' if self.sp else 'off'}"
        if self.cp > 1:
            text += f" cp={self.cp}"
        if self.ep > 1:
            text += f" ep={self.ep}"
        text += f" pp={self.pp}"
        if self.fsdp_enabled:
            text += f" dp_shard={self.dp_shard} reshard={RESHARD[0] if self.reshard else RESHARD[1]}"
        if self.offload:
            text += " offload=cpu"
        if self.pp > 1:
            text += f" schedule={self.schedule}"
            if self.virtual_stages > 1:
                text += f" virtual_stages={self.virtual_stages}"
        text += f" microbatch={self.microbatch} microbatches={self.microbatches}"
        if self.recompute != "none":
            text += f" recompute={self.recompute}"
        return text


def plan_codec() -> tuple[tuple[str, str, dict, dict], ...]:
    """(Parallelism field, plan.json field, plan.json value -> field value, field value -> plan.json value) for each
    field, in Parallelism's order: read off VOCABULARY (plan_field, plan_values), the one mapping of the two
    spellings."""
    terms = {term.short: term for term in VOCABULARY}
    return tuple((f.name, terms[f.name].plan_field, dict(terms[f.name].plan_values),
                  {mine: theirs for theirs, mine in terms[f.name].plan_values}) for f in fields(Parallelism))


def to_plan_fields(par: Parallelism) -> dict[str, object]:
    """plan.json's parallelism section of `par` (torchtitan's names and values), in plan.json's order."""
    return {plan_field: encode.get(getattr(par, name), getattr(par, name))
            for name, plan_field, _, encode in PLAN_CODEC}


PLAN_CODEC = plan_codec()


def from_plan_fields(section: dict[str, object]) -> Parallelism:
    """The Parallelism of plan.json's parallelism section (absent fields at their defaults); ValueError naming the
    field for a value of the wrong type or outside its vocabulary, or a field plan.json does not have."""
    known = {plan_field for _, plan_field, _, _ in PLAN_CODEC}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(f"unknown field(s) in 'parallelism': {', '.join(unknown)}")
    kwargs: dict[str, object] = {}
    types = {f.name: f.type for f in fields(Parallelism)}
    for name, plan_field, decode, _ in PLAN_CODEC:
        if plan_field not in section:
            continue
        value = section[plan_field]
        if decode:
            if isinstance(value, bool) != isinstance(next(iter(decode)), bool) or value not in decode:
                raise ValueError(f"parallelism.{plan_field} must be one of "
                                 f"{', '.join(json_text(v) for v in decode)}, got {value!r}")
            kwargs[name] = decode[value]
            continue
        wanted = {"int": int, "bool": bool, "str": str}[types[name]]
        if not isinstance(value, wanted) or (wanted is int and isinstance(value, bool)):
            raise ValueError(f"parallelism.{plan_field} must be {types[name]}, got {value!r}")
        kwargs[name] = value
    return Parallelism(**kwargs)


def json_text(value: object) -> str:
    """`value` as JSON writes it (true, "always")."""
    return str(value).lower() if isinstance(value, bool) else f'"{value}"'


@dataclass(frozen=True)
class Scope:
    """What a layout must fit: the cluster, the batch and the model, each None when not known."""

    num_gpus: int | None = None
    gpus_per_node: int | None = None
    global_batch: int | None = None
    num_modules: int | None = None
    """Modules of the model's chain (pipeline stages are cut between them)."""
    whole_reason: str | None = None
    """Why the model's chain is a single module, naming the module (ModuleChain.whole_reason)."""
    features: frozenset[str] | None = None
    """What may be used (SUPPORTED for a program to run, ALL_FEATURES for a price); None: not checked."""
    tensor_parallel_problems: Callable[[int], list[str]] | None = None
    """The model's own reasons a tensor-parallel degree cannot split it (heads, features, vocabulary)."""
    sequence_parallel_problem: str | None = None
    """Why the model's ops between the tensor-parallel pairs cannot run on sequence shards ("" if they can)."""
    stage_modules: tuple[tuple[str, ...], ...] | None = None
    """A plan's stages, each its modules."""
    tensor_parallel_modules: int | None = None
    """Modules a plan's tensor_parallel_plan shards."""
    sequence_local_modules: tuple[str, ...] | None = None
    """Modules that run on each rank's sequence shard as a whole under sequence parallelism (tensor_parallel_plan
    style "sequence_local": a mixture of experts' routing)."""
    batch_norm_modules: tuple[str, ...] | None = None
    """Modules that normalize over the batch they see (BatchNorm in training mode; chain/batch_statistics.py)."""
    loss_parallel_problem: str | None = None
    """Why the loss cannot run on the vocabulary-parallel head's sharded logits ("" if it can or there is no
    such head): the plan then gathers them (disable_loss_parallel)."""
    host_link: bool | None = None
    """The accelerators have a host-device link to offload to (False for CPU processes: the device is the host)."""
    sequence_length: int | None = None
    """Tokens per sequence the attention sees (what context parallelism splits)."""
    context_parallel_problem: str | None = None
    """Why the model's attention cannot run as a ring over sequence shards ("" if it can; chain/attention.py)."""
    num_experts: tuple[int, ...] | None = None
    """Experts of each expert layer (chain/experts.py), in graph order; () for a model without expert layers."""


def problems(layout: Layout, scope: Scope) -> list[str]:
    """Every rule `layout` breaks in `scope`, each as one clause with its arithmetic (empty: valid as far
    as is known)."""
    found: list[str] = []
    for rule in RULES:
        found += rule(layout, scope)
    return found


def schedule_problems(layout: Layout, scope: Scope) -> list[str]:
    """The schedule's rules alone: all that a micro-batch variant (schedule, virtual stages, micro-batch
    size dividing the rank's samples) of a layout problems() accepted can break. The search's inner loop."""
    return _schedule(layout, scope) + _batch_norm_microbatches(layout, scope)


def compile_problems(layout: Layout, scope: Scope) -> list[str]:
    """The rules that read compile alone (COMPILE_RULES): all that compiling a layout problems() accepts uncompiled
    can break, in problems()'s order. The search's check of each variant compiled (solve/search.py runnable)."""
    found: list[str] = []
    for rule in COMPILE_RULES:
        found += rule(layout, scope)
    return found


def _values(layout: Layout, scope: Scope) -> list[str]:
    out = [f"{name}={value} must be at least 1" for name, value in
           (("dp", layout.dp), ("dp_replicate", layout.dp_replicate), ("dp_shard", layout.dp_shard),
            ("tp", layout.tp), ("cp", layout.cp), ("ep", layout.ep), ("pp", layout.pp),
            ("virtual_stages", layout.virtual_stages),
            ("microbatch", layout.microbatch), ("microbatches", layout.microbatches))
           if value is not None and value < 1]
    for name, value, allowed in (("schedule", layout.schedule, SCHEDULES), ("recompute", layout.recompute, RECOMPUTE),
                                 ("reshard", layout.reshard, RESHARD), ("zero", layout.zero, ZERO_STAGES),
                                 ("sp", layout.sp, SEQUENCE_PARALLEL),
                                 ("offload", layout.offload, OFFLOAD), ("compile", layout.compile, COMPILE),
                                 ("loss_parallel", layout.loss_parallel, LOSS_PARALLEL)):
        if value is not None and value not in allowed:
            out.append(f"{name}={value} is not one of {', '.join(map(str, allowed))}")
    return out


def _positive(*values: int | None) -> bool:
    return all(v is not None and v >= 1 for v in values)


def _features(layout: Layout, scope: Scope) -> list[str]:
    have = scope.features
    if have is None:
        return []
    out = []
    if _positive(layout.tp) and layout.tp > 1 and "tp" not in have:
        out.append(f"tensor parallelism is not supported yet (tp={layout.tp}; use tp=1)")
    if _positive(layout.tp) and layout.tp > 1 and layout.sp == "on" and "sp" not in have:
        out.append(f"sequence parallelism is not supported yet (tp={layout.tp}, sp=on; use sp=off)")
    sharded = _sharding(layout)
    if sharded is not None and sharded[0]:
        needed = "zero3" if sharded[1] == "always" else "zero2"
        if needed not in have:
            allowed = ["0 = DDP"] + (["1/2 = FSDP without resharding"] if "zero2" in have else []) + \
                (["3 = FSDP"] if "zero3" in have else [])
            out.append(f"{_sharding_text(layout)} is not supported yet (supported: zero {', '.join(allowed)})")
        if _positive(layout.dp_replicate) and layout.dp_replicate > 1 and "hsdp" not in have:
            out.append(f"HSDP (dp_replicate={layout.dp_replicate} x dp_shard={layout.dp_shard}) is not supported yet")
    if layout.schedule in SCHEDULES and layout.schedule not in have and (layout.pp is None or layout.pp > 1):
        out.append(f"schedule={layout.schedule} is not supported yet (supported: "
                   f"{', '.join(s for s in SCHEDULES if s in have)})")
    if layout.recompute in RECOMPUTE and layout.recompute != "none" and layout.recompute not in have:
        out.append(f"recompute={layout.recompute} is not supported yet")
    if layout.offload == "cpu" and "offload" not in have:
        out.append("offload=cpu is not supported here")
    if layout.compile == "on" and "compile" not in have:
        out.append("compile=on is not supported here")
    if _positive(layout.cp) and layout.cp > 1 and "cp" not in have:
        out.append(f"context parallelism is priced but the generated program cannot run it yet (cp={layout.cp}; "
                   f"use cp=1)")
    if _positive(layout.ep) and layout.ep > 1 and "ep" not in have:
        out.append(f"expert parallelism is priced but the generated program cannot run it yet (ep={layout.ep}; "
                   f"use ep=1)")
    return out + _unsupported_pairs(layout, have) + _expert_parallel_features(layout, have)


def _expert_parallel_features(layout: Layout, have: frozenset[str]) -> list[str]:
    """The placements of expert parallelism the program does not run yet (runtime/distributed/expert_parallel.py) that take
    arithmetic: across replicas (ep_ddp) and beside DDP. The pairs are UNSUPPORTED_PAIRS."""
    ep = layout.ep
    if not _positive(ep) or ep == 1:
        return []
    out = []
    cp, tp = _or_one(layout.cp), _or_one(layout.tp)
    dp = _dp_of(layout)
    whole = not _positive(dp) or expert_folded_ranks(dp, cp, tp) % ep == 0  # else _expert_parallel says why
    if _positive(layout.dp_shard) and expert_folded_ranks(layout.dp_shard, cp, tp) % ep and whole and \
            "ep_ddp" not in have:
        ranks = expert_folded_ranks(layout.dp_shard, cp, tp)
        out.append(f"ep={ep} does not divide dp_shard={layout.dp_shard} x cp={cp} x tp={tp} = {ranks} ({ranks} % {ep} "
                   f"= {ranks % ep}): the program cuts expert parallelism from the ranks of one data-parallel replica, "
                   f"not across replicas (use a larger dp_shard, or an ep dividing {ranks})")
    elif layout.zero == 0 and "ep_ddp" not in have:
        out.append(f"ep={ep} with zero=0 (DDP): the program shards the experts' states with FSDP2 over the ranks "
                   f"holding the same experts, not beside DDP (use zero=3 or ep=1)")
    return out


def _context_parallel(layout: Layout, scope: Scope) -> list[str]:
    """cp > 1 needs SDPA attention (torch's ring replaces it) and a sequence that splits into 2 x cp equal chunks
    (causal load balancing, CONTEXT_PARALLEL_CHUNKS)."""
    cp = layout.cp
    if not _positive(cp) or cp == 1:
        return []
    out = []
    if scope.context_parallel_problem:
        out.append(f"cp={cp}: {scope.context_parallel_problem} (use cp=1)")
    seq = scope.sequence_length
    chunks = CONTEXT_PARALLEL_CHUNKS * cp
    if seq is not None and seq % chunks:
        out.append(f"cp={cp}: the sequence of {seq} tokens does not split into {CONTEXT_PARALLEL_CHUNKS} x cp = "
                   f"{chunks} load-balanced chunks ({seq} % {chunks} = {seq % chunks})")
    if scope.num_gpus is not None and scope.num_gpus % cp:
        out.append(f"cp={cp} does not divide {scope.num_gpus} GPUs")
    return out


def expert_folded_ranks(dp_shard: int, cp: int, tp: int) -> int:
    """The ranks expert parallelism is cut from: dp_shard x cp x tp, those of one pipeline rank and data-parallel
    replica ("MoE parallel folding", as torchtitan and Megatron-Core with expert-tensor-parallel 1). ep of them split
    the experts (tp innermost, so ep spans the tp ranks first), and the dp_shard x cp x tp / ep ranks holding the same
    experts shard their states (FSDP2; runtime/distributed/expert_parallel.py EXPERT_MESH_DIMS). ep must divide it."""
    return dp_shard * cp * tp


def _expert_parallel(layout: Layout, scope: Scope) -> list[str]:
    """ep > 1 needs expert layers whose expert count it divides, and is cut from the dp x cp x tp ranks (replicas
    included only with the "ep_ddp" feature, _expert_parallel_features: the program folds it over dp_shard x cp x
    tp, expert_folded_ranks)."""
    ep = layout.ep
    if not _positive(ep) or ep == 1:
        return []
    out = []
    if scope.num_experts is not None and not scope.num_experts:
        out.append(f"ep={ep}, but the model has no expert layers (a router's top-k over stacked expert weights) "
                   f"to shard (use ep=1)")
    for experts in sorted(set(scope.num_experts or ())):
        if experts % ep:
            out.append(f"ep={ep} does not divide the {experts} experts of an expert layer "
                       f"({experts} % {ep} = {experts % ep})")
    dp, cp, tp = _dp_of(layout), _or_one(layout.cp), _or_one(layout.tp)
    if _positive(dp) and expert_folded_ranks(dp, cp, tp) % ep:
        ranks = expert_folded_ranks(dp, cp, tp)
        out.append(f"ep={ep} does not divide dp={dp} x cp={cp} x tp={tp} = {ranks} ({ranks} % {ep} = {ranks % ep}; "
                   f"expert parallelism is cut from the data-, context- and tensor-parallel ranks of a pipeline rank)")
    return out


def _or_one(value: int | None) -> int:
    """A degree, 1 when not known (yet)."""
    return value if _positive(value) else 1


def _compiled_experts_in_stages(layout: Layout, scope: Scope) -> list[str]:
    """torch.compile of pipeline stages that hold expert layers fails on CPU/gloo with torch 2.13: inductor stops
    tracing the backward of the experts' data-dependent token counts ("NYI SymInt equality", seen on
    examples/mixtral.py and HF Mixtral at pp=2 x dp=2, ep 1 and 2); without a pipeline it compiles."""
    if (layout.compile == "on" and _positive(layout.pp) and layout.pp > 1 and scope.num_experts
            and scope.features is not None and "compile_pp_experts" not in scope.features):
        return [f"compile=on with pp={layout.pp} on a model with expert layers: torch.compile of its pipeline stages "
                f"fails in the experts' backward (inductor: NYI SymInt equality; use compile=off or pp=1)"]
    return []


def _compiled_experts_over_tensor_parallel(layout: Layout, scope: Scope) -> list[str]:
    """torch.compile of a model with expert layers at tp > 1 trains off the single-device model on CPU/gloo with
    torch 2.13: HF Mixtral at tp=2 (sp=off, the only sequence-parallel value a mixture of experts is planned with)
    under compile lost loss parity at step 2 (4.1652 against 4.1594) in tests/test_pairs_matrix.py, alike with
    HSDP x ep=2, with cp=2 and with CPU offload; eager it matches, and compiled without tp too."""
    if (layout.compile == "on" and _positive(layout.tp) and layout.tp > 1 and scope.num_experts
            and scope.features is not None and "compile_tp_experts" not in scope.features):
        return [f"compile=on with tp={layout.tp} on a model with expert layers: the compiled program loses loss parity "
                f"with the single-device model (use compile=off or tp=1)"]
    return []


def _compiled_recompute_over_tensor_parallel(layout: Layout, scope: Scope) -> list[str]:
    """torch.compile of a recomputed module over tensor-parallel DTensors that are not sequence-sharded (sp=off),
    or inside the context-parallel ring, fails on CPU/gloo with torch 2.13: AOTAutograd saves a DeviceMesh among the
    checkpoint's tensors ("expected all tensors_saved_with_vc_check to be Tensors"; seen on a GPT with full recompute
    at dp=2 x tp=2 and at cp=2 x tp=2, both sp=off, tests/test_pairs_matrix.py); with sequence parallelism and no
    ring (HF Llama at tp=2 with selective and full recompute) it compiles."""
    if (layout.compile != "on" or layout.recompute not in ("selective", "full") or not _positive(layout.tp)
            or layout.tp == 1 or scope.features is None or "compile_tp_recompute" in scope.features):
        return []
    cp = layout.cp if _positive(layout.cp) else 1
    if layout.sp == "off" or cp > 1:
        where = f"sp={layout.sp}" if layout.sp == "off" else f"cp={cp}"
        return [f"compile=on with recompute={layout.recompute} at tp={layout.tp} with {where}: torch.compile of a "
                f"recomputed module over tensor-parallel shards fails in AOTAutograd here unless they are sequence "
                f"shards outside the ring (use compile=off, recompute=none, tp=1, or sp=on with cp=1)"]
    return []


def _offload(layout: Layout, scope: Scope) -> list[str]:
    """CPU offload is FSDP2's (CPUOffloadPolicy of fully_shard): the model states must be sharded, and no
    pipeline (it would hold the stage's unsharded parameters and gradients on the GPU to the last micro-batch,
    torch.distributed.pipelining's rule, so nothing would stay offloaded)."""
    if layout.offload != "cpu":
        return []
    out = []
    if scope.host_link is False:
        out.append("offload=cpu needs an accelerator with a host-device link, but these processes run on the host "
                   "itself (the hardware profile's host.link_bandwidth_gb_per_s is 0)")
    sharded = _sharding(layout)
    if sharded is not None and not sharded[0]:
        out.append(f"offload=cpu needs FSDP (zero=3, dp_shard > 1), but {_sharding_text(layout)} replicates")
    if _positive(layout.pp) and layout.pp > 1:
        out.append(f"offload=cpu with pp={layout.pp}: a pipeline stage keeps its parameters and gradients unsharded "
                   f"on the GPU to the last micro-batch (use pp=1)")
    return out


def _sequence_parallel(layout: Layout, scope: Scope) -> list[str]:
    """sp=on needs every op between the model's tensor-parallel pairs to compute token by token. A module that does
    so only as a whole (a mixture of experts' routing: runtime/distributed/tensor_parallel.py run_on_local_tokens) is wrapped
    as a module, also inside a pipeline stage, which calls the model's own module there (runtime/distributed/expert_calls.py
    modules_as_calls)."""
    if not (_positive(layout.tp) and layout.tp > 1 and layout.sp == "on"):
        return []
    if scope.sequence_parallel_problem:
        return [f"sp=on with tp={layout.tp}: {scope.sequence_parallel_problem} (use sp=off)"]
    return []


def fsdp_wraps(dp_replicate: int, dp_shard: int, cp: int, tp: int) -> bool:
    """FSDP2 wraps the model (runtime/distributed/parallel.py shard_data_parallel): with data parallelism whose states are
    sharded (dp_shard x cp > 1), or replicated beside tensor parallelism (DDP cannot bucket DTensors). Else DDP
    or no data parallelism, and a bf16 plan trains as torch.autocast over fp32 weights (cost/memory.py prices
    it so); under FSDP2 its MixedPrecisionPolicy computes in bf16."""
    shard = dp_shard * cp
    return dp_replicate * shard > 1 and (shard > 1 or tp > 1)


def _dp_of(layout: Layout) -> int | None:
    """layout.dp, or dp_replicate x dp_shard when both are known (None when neither is)."""
    if layout.dp is not None:
        return layout.dp
    if layout.dp_replicate is not None and layout.dp_shard is not None:
        return layout.dp_replicate * layout.dp_shard
    return None


def zero_of(shard: int, reshard: bool) -> int:
    """The ZeRO stage (the paper's notation, the zero pin's values) whose memory a data-parallel sharding over `shard`
    ranks has: 0 unsharded (DDP), 2 FSDP2 keeping gathered parameters to backward (gradients and optimizer state
    sharded), 3 FSDP2 resharding after forward (Parallelism.zero)."""
    if shard <= 1:
        return 0
    return 3 if reshard else 2


def _sharding(layout: Layout) -> tuple[bool, str] | None:
    """(sharded, reshard) from zero or from dp_shard and reshard; None when not known. With cp > 1 the model
    states are sharded over dp_shard x cp (FSDP over the context-parallel ranks too, as torchtitan)."""
    if layout.zero in ZERO_STAGES:
        return layout.zero > 0, "always" if layout.zero == 3 else "never"
    if _positive(layout.dp_shard):
        cp = layout.cp if _positive(layout.cp) else 1
        return layout.dp_shard * cp > 1, layout.reshard or "never"
    return None


def _sharding_text(layout: Layout) -> str:
    return f"zero={layout.zero}" if layout.zero is not None else f"dp_shard={layout.dp_shard} reshard={layout.reshard}"


def _degrees(layout: Layout, scope: Scope) -> list[str]:
    out, gpus = [], scope.num_gpus
    if gpus is None:
        return out
    tp, pp, dp = layout.tp, layout.pp, _dp_of(layout)
    if _positive(tp):
        if gpus % tp:
            out.append(f"tp={tp} does not divide {gpus} GPUs")
        if scope.gpus_per_node is not None and scope.gpus_per_node % tp:
            out.append(f"tp={tp} does not divide the {scope.gpus_per_node} GPUs of a node (tensor parallelism "
                       f"stays inside a node)")
        if tp > 1 and scope.tensor_parallel_problems is not None:
            out += scope.tensor_parallel_problems(tp)
        if tp > 1 and scope.tensor_parallel_modules == 0:
            out.append(f"tp={tp}, but the plan's tensor_parallel_plan names no module to shard")
    if _positive(pp):
        if gpus % pp:
            out.append(f"pp={pp} does not divide {gpus} GPUs")
        if scope.num_modules is not None and pp > scope.num_modules:
            why = f" ({scope.whole_reason})" if scope.whole_reason and scope.num_modules == 1 else ""
            out.append(f"pp={pp} exceeds the {scope.num_modules} modules the model splits into{why}")
    if _positive(dp):
        if gpus % dp:
            out.append(f"dp={dp} does not divide {gpus} GPUs")
        if scope.global_batch is not None and scope.global_batch % dp:
            out.append(f"dp={dp} does not divide the global batch of {scope.global_batch}")
    if _positive(layout.dp, layout.dp_replicate, layout.dp_shard) and \
            layout.dp != layout.dp_replicate * layout.dp_shard:
        out.append(f"dp={layout.dp} is not dp_replicate={layout.dp_replicate} x dp_shard={layout.dp_shard}")
    cp = layout.cp if _positive(layout.cp) else 1
    known = {k: v for k, v in (("dp", dp), ("cp", cp), ("tp", tp), ("pp", pp)) if _positive(v) and (k != "cp" or v > 1)}
    product = 1
    for value in known.values():
        product *= value
    shown = " x ".join(f"{k}={v}" for k, v in known.items())
    if len(known) == 3 + (cp > 1) and product != gpus:
        out.append(f"{shown} = {product}, not {gpus} GPUs")
    elif 2 <= len(known) < 3 + (cp > 1) and gpus % product and all(gpus % v == 0 for v in known.values()):
        out.append(f"{shown} = {product} does not divide {gpus} GPUs")
    return out


def _sharding_rules(layout: Layout, scope: Scope) -> list[str]:
    out = []
    if layout.zero == 0 and _positive(layout.dp_shard) and layout.dp_shard > 1:
        out.append(f"zero=0 (DDP) replicates, but dp_shard={layout.dp_shard}")
    cp = layout.cp if _positive(layout.cp) else 1
    if layout.reshard == "always" and _positive(layout.dp_shard) and layout.dp_shard * cp == 1:
        out.append("reshard=always needs dp_shard > 1 (nothing is sharded to free after forward)")
    if layout.zero == 0 and cp > 1:
        out.append(f"zero=0 (DDP) with cp={cp}: context parallelism shards the model states over dp_shard x cp "
                   f"(FSDP, as torchtitan; use zero=1, 2 or 3)")
    return out


def _batch(layout: Layout, scope: Scope) -> list[str]:
    out, batch, dp, microbatch = [], scope.global_batch, _dp_of(layout), layout.microbatch
    if batch is None or not _positive(microbatch):
        return out
    if _positive(dp) and batch % dp == 0:
        per_rank = batch // dp
        if per_rank % microbatch:
            out.append(f"microbatch={microbatch} does not divide the {per_rank} samples per data-parallel rank "
                       f"(global batch {batch} / dp={dp})")
        elif _positive(layout.microbatches) and layout.microbatches != per_rank // microbatch:
            out.append(f"microbatches={layout.microbatches}, but global batch {batch} / dp={dp} / "
                       f"microbatch={microbatch} = {per_rank // microbatch}")
    elif microbatch > batch:
        out.append(f"microbatch={microbatch} exceeds the global batch of {batch}")
    return out


def _microbatches(layout: Layout, scope: Scope) -> int | None:
    if _positive(layout.microbatches):
        return layout.microbatches
    batch, dp, microbatch = scope.global_batch, _dp_of(layout), layout.microbatch
    if batch is not None and _positive(dp, microbatch) and batch % (dp * microbatch) == 0:
        return batch // (dp * microbatch)
    return None


def _schedule(layout: Layout, scope: Scope) -> list[str]:
    out, pp, v, schedule = [], layout.pp, layout.virtual_stages, SCHEDULE_BY_NAME.get(layout.schedule)
    if schedule is None:
        if _positive(v) and v > 1 and layout.schedule is None and _positive(pp) and pp == 1:
            out.append(f"virtual_stages={v} needs pp > 1 (pp={pp})")
        return out
    least, most = schedule.virtual_stages
    if _positive(v) and (v < least or (most is not None and v > most)) and (not _positive(pp) or pp > 1):
        runs = f"{least}" if least == most else f"{least} to {most}" if most else f"at least {least}"
        out.append(f"schedule={schedule.name} runs {runs} stage{'s' if most != 1 else ''} per pipeline rank, "
                   f"but virtual_stages={v}" + (" (virtual stages need schedule=interleaved, zb-interleaved, zbv or "
                                               "dualpipev)" if most == 1 else ""))
    if _positive(v) and v > 1 and _positive(pp) and pp == 1:
        out.append(f"virtual_stages={v} needs pp > 1 (schedule={schedule.name}, pp={pp})")
    if not _positive(pp) or pp == 1:
        return out
    m = _microbatches(layout, scope)
    stages = pp * (v if _positive(v) else max(least, 1))
    need = {"pp": (pp, "at least", m is not None and m < pp),
            "pp_multiple": (pp, "a multiple of", m is not None and (m < pp or m % pp)),
            "stages": (stages, "at least pp x virtual_stages =", m is not None and m < stages)}.get(
        schedule.min_microbatches)
    if need is not None and need[2]:
        out.append(f"schedule={schedule.name} needs {need[1]} {'pp=' if need[0] == pp else ''}{need[0]} micro-batches, "
                   f"but {_microbatches_text(layout, scope)} = {m}")
    if (v is None or v > 1 or least > 1) and most != 1 and scope.num_modules is not None:
        per_rank = max(v or 2, least, 2)
        if pp * per_rank > scope.num_modules:
            out.append(f"schedule={schedule.name} needs at least {per_rank} x pp={pp} = {pp * per_rank} modules, the "
                       f"model splits into {scope.num_modules}")
    if schedule.split_backward and layout.recompute == "selective":
        out.append(f"schedule={schedule.name} with recompute=selective: the weight-gradient pass replays the "
                   f"checkpointed modules a second time, and the selective policy's contexts cannot be entered twice "
                   f"(tried: torch.utils.checkpoint fails in the W pass; use recompute=full or none)")
    if schedule.split_backward and layout.compile == "on":
        out.append(f"schedule={schedule.name} splits backward into input and weight gradients, which torch "
                   f"(ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV) refuses for compiled "
                   f"stages (use compile=off or schedule=1f1b or interleaved)")
    return out


def _microbatches_text(layout: Layout, scope: Scope) -> str:
    if _positive(layout.microbatches):
        return "microbatches"
    return f"global batch {scope.global_batch} / dp={_dp_of(layout)} / microbatch={layout.microbatch}"


def _stages(layout: Layout, scope: Scope) -> list[str]:
    stages = scope.stage_modules
    if stages is None or not _positive(layout.pp):
        return []
    out, v = [], layout.virtual_stages if _positive(layout.virtual_stages) else 1
    if layout.pp > 1 and len(stages) != layout.pp * v:
        out.append(f"pp={layout.pp} x virtual_stages={v} = {layout.pp * v} stages, but the plan lists {len(stages)}")
    if any(not modules for modules in stages):
        out.append("every pipeline stage must list at least one module")
    return out


def _batch_norm_microbatches(layout: Layout, scope: Scope) -> list[str]:
    """The single-device model normalizes over the whole global batch: SyncBatchNorm's statistics over all
    data-parallel ranks equal it only when each rank's share runs as one micro-batch."""
    m = _microbatches(layout, scope)
    if not scope.batch_norm_modules or m is None or m == 1:
        return []
    split = f"microbatches={m}" if _positive(layout.microbatches) else f"{_microbatches_text(layout, scope)} = {m}"
    return [f"{split} micro-batches per data-parallel rank, but "
            f"{_batch_norm_text(scope.batch_norm_modules)} normalizes over the batch it sees (the single-device "
            f"model: the whole global batch), so it cannot be split into micro-batches (use microbatches=1)"]


def _batch_norm_pipeline(layout: Layout, scope: Scope) -> list[str]:
    """SyncBatchNorm replaces nn.Module BatchNorms; a pipeline's stages are exported graphs without them."""
    pp, dp = layout.pp, _dp_of(layout)
    if not scope.batch_norm_modules or not _positive(pp, dp) or pp == 1 or dp == 1:
        return []
    return [f"pp={pp} with dp={dp}: {_batch_norm_text(scope.batch_norm_modules)} needs SyncBatchNorm over the "
            f"data-parallel ranks, which a pipeline stage's exported graph cannot run (use pp=1 or dp=1)"]


def _batch_norm_recompute(layout: Layout, scope: Scope) -> list[str]:
    """Recomputation re-runs a module's forward in backward: a BatchNorm's running statistics would take the
    batch in twice (torch.utils.checkpoint does not restore buffers)."""
    if not scope.batch_norm_modules or layout.recompute not in ("selective", "full"):
        return []
    return [f"recompute={layout.recompute} re-runs forwards in backward, and {_batch_norm_text(scope.batch_norm_modules)}"
            f" would update its running statistics twice per step (use recompute=none)"]


def _batch_norm_text(modules: tuple[str, ...]) -> str:
    more = f" (and {len(modules) - 1} more)" if len(modules) > 1 else ""
    return f"BatchNorm module '{modules[0]}'{more}"


RULES = (_values, _features, _sequence_parallel, _context_parallel, _expert_parallel, _compiled_experts_in_stages,
         _compiled_experts_over_tensor_parallel, _compiled_recompute_over_tensor_parallel,
         _degrees, _sharding_rules, _offload, _batch, _schedule, _batch_norm_microbatches, _batch_norm_pipeline,
         _batch_norm_recompute, _stages)
"""Every rule, in the order their messages read best."""
COMPILE_RULES = (_features, _compiled_experts_in_stages, _compiled_experts_over_tensor_parallel,
                 _compiled_recompute_over_tensor_parallel, _schedule)
"""The rules that read layout.compile (compile=on among the values is always valid): a layout the other rules accept
uncompiled, they accept compiled too (tests/test_layout_rules.py checks that no other rule reads it)."""
