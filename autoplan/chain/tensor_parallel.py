"""Megatron-style tensor parallelism found in the captured graph (pure Python, no torch).

A *region* is a set of ops whose outputs are split along the feature (head) dimension when tp > 1.
It opens at column-parallel Linears (weight split by output rows: every rank computes some heads or
some hidden features) and closes at row-parallel Linears (weight split by input columns; their
partial outputs are all-reduced back to the full tensor). Between the two only ops that never mix the
split dimension may run: elementwise ops, shape ops that keep heads whole (view, transpose, ...; not
a split of a fused projection: FUSED_SPLIT_OPS), and attention over heads (SDPA, activation x
activation matmuls, softmax over keys). A replicated tensor may join an elementwise op only when it is much smaller than the
split one or computed without any Linear (a broadcast: rotary tables, masks), never into an attention matmul
(both of its activations are split by heads); a full-width replicated
tensor (a residual) would need the missing features, so the region is dropped and its Linears stay
replicated.

Examples: GPT attn.qkv -> attn.proj and mlp.fc -> mlp.proj; HF Llama q/k/v_proj -> o_proj and
gate/up_proj -> down_proj.

With the vocabulary-parallel option (layout.SUPPORTED "tp_vocab_parallel") the output head (a
Linear whose output is a model output) is also "colwise", its logits left sharded on the vocabulary for
the loss (loss_parallel; gathered when the plan disables it), and an input embedding tied to that
head or with as many rows as the head has outputs (the word embedding, not a position table) is
"rowwise" (RowwiseParallel on nn.Embedding: vocabulary rows split, outputs reduce-scattered onto the
sequence with sequence parallelism, else all-reduced). runtime/tensor_parallel.py runs both.

Sequence parallelism (Korthikanti et al. 2022): the outputs of rowwise Linears (and of the vocabulary-
parallel embedding) are reduce-scattered onto the sequence dimension, and the ops that read them up to the
next colwise Linear or head (which all-gather) run on sequence shards: role "sequence". Those ops must work
token by token (SEQUENCE_LOCAL_OPS: elementwise, norms, casts, dropout, a Linear outside the pairs); any
other op reading a sequence shard (attention left whole, a reshape of the sequence) makes sequence
parallelism unavailable for the model: TensorParallelFacts.sequence_parallel_problem says which op.

Roles per op (TensorParallelFacts.role): "colwise", "rowwise", "interior" (inside a region),
"head", "embedding", "sequence", or absent (replicated on every tensor-parallel rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autoplan.chain.ops import ops_with, packet
from autoplan.profile.types import ModelProfile, OpProfile

LINEAR_OPS = ops_with("linear")
EMBEDDING_OPS = ops_with("embedding")
SHAPE_OPS = ops_with("reshape")
"""Ops that move or copy elements without mixing a feature dimension split evenly into heads."""
ELEMENTWISE_OPS = ops_with("pointwise")
ATTENTION_OPS = ops_with("per_head")
"""Attention over heads: each head's scores and outputs depend on that head's features only."""
FUSED_SPLIT_OPS = ops_with("splits")
"""Ops that, applied straight to a column-parallel Linear's output, cut a fused projection (qkv) along
the features the Linear shards. Megatron-LM interleaves such weights so each rank holds whole q, k, v
heads; torch's ColwiseParallel shards the fused rows as they are, so DTensor all-gathers the output
before the split and the attention behind it runs replicated on every rank. No speed-up to plan for:
the region is dropped (its Linears stay replicated) unless the layout feature "tp_fused_split"
(Megatron-LM's interleaved weights, for pricing its runs) is on."""
VOCAB_MULTIPLE = 8
"""The head and embedding split by vocabulary only when it is a multiple of this (every tensor-parallel
degree inside an 8-GPU node divides it; torch TP cannot pad a vocabulary as Megatron-LM does)."""
SEQUENCE_LOCAL_OPS = ELEMENTWISE_OPS | LINEAR_OPS | frozenset({
    "native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm", "mean", "var_mean", "_to_copy", "to",
    "type_as", "clone", "contiguous", "detach", "alias", "lift_fresh_copy"})
"""Ops that compute each token from that token alone (the reductions are a norm's, over the features): a
sequence shard stays a sequence shard through them."""
BROADCAST_RATIO = 2
"""A replicated operand may join a split tensor's elementwise op only when it has at most
1/BROADCAST_RATIO of the split operand's bytes (a table broadcast over heads, not a full-width tensor)."""


def is_weight_linear(op: OpProfile) -> bool:
    """An nn.Linear module's own matmul: aten.linear with a 2-D weight that is a module's "weight" (its
    own, or a tied one), or transformers' Conv1D (GPT-2): aten.addmm(bias, x, weight [in, out]) of the
    module's own weight and bias. A weight used functionally by an enclosing module does not count, e.g.
    nn.MultiheadAttention's in_proj_weight or its child out_proj's weight: codegen shards Linear
    modules by name."""
    if _is_conv1d(op):
        return True
    if packet(op) not in LINEAR_OPS or not op.params or len(op.input_shapes) < 2 or len(op.input_shapes[1]) != 2:
        return False
    weight = _weight(op)
    owner, _, leaf = weight.rpartition(".")
    return leaf == "weight" and not (op.module and owner.startswith(op.module + "."))


def _is_conv1d(op: OpProfile) -> bool:
    """transformers' Conv1D: addmm of its own bias and [in, out] weight."""
    return packet(op) == "addmm" and len(op.input_shapes) == 3 and len(op.input_shapes[2]) == 2 and \
        set(op.params) == {f"{op.module}.weight", f"{op.module}.bias"}


def out_in_features(op: OpProfile) -> tuple[int, int]:
    """(out_features, in_features) of a weight Linear (nn.Linear's [out, in] weight, Conv1D's [in, out])."""
    if _is_conv1d(op):
        fan_in, fan_out = op.input_shapes[2]
        return fan_out, fan_in
    return op.input_shapes[1][0], op.input_shapes[1][1]


@dataclass(frozen=True)
class DivisibilityFact:
    """A size the tensor-parallel degree must divide, and where it comes from (for messages)."""

    size: int
    what: str
    """e.g. "4 attention heads (blocks.0.attn)" or "out_features 384 of blocks.0.attn.qkv"."""


@dataclass(frozen=True)
class TensorParallelFacts:
    """Everything the cost model and the search need to know about tensor parallelism of a profile."""

    plan: dict[str, str]
    """Module FQN -> "colwise" | "rowwise" (Plan.tensor_parallel_plan)."""
    role: dict[str, str]
    """Op node -> "colwise", "rowwise", "interior", "head" or "embedding"; absent = replicated."""
    sharded_parameters: frozenset[str]
    """Parameters split over the tensor-parallel ranks (weights of split Linears and embeddings, biases
    of colwise Linears); the rest are replicated on every rank."""
    divisibility: tuple[DivisibilityFact, ...] = field(default=())
    """Sizes tp must divide: out_features of colwise, in_features of rowwise, heads, vocabulary."""
    sequence_parallel_problem: str = ""
    """Why the ops between the pairs cannot run on sequence shards (the first op that mixes tokens), or ""."""

    @property
    def has_head(self) -> bool:
        """The output head is vocabulary-parallel (its logits leave sharded for the loss)."""
        return "head" in self.role.values()

    def problems(self, tp: int) -> list[str]:
        """Why `tp` cannot split this model (empty when it can)."""
        if tp == 1:
            return []
        if not self.plan:
            return [f"tp={tp}: no Megatron-style Linear pairs were found in the graph"]
        first: dict[int, str] = {}
        for f in self.divisibility:
            if f.size % tp:
                first.setdefault(f.size, f.what)
        return [f"tp={tp} does not divide {what}" for what in first.values()]


def find_tensor_parallel_plan(profile: ModelProfile, vocab_parallel: bool = True,
                              fused_split: bool = True) -> dict[str, str]:
    """Module FQN -> "colwise" | "rowwise" for every Megatron pair (and the vocabulary-parallel head
    and embedding when `vocab_parallel`)."""
    return tensor_parallel_facts(profile, vocab_parallel, fused_split).plan


def tensor_parallel_facts(profile: ModelProfile, vocab_parallel: bool = True,
                          fused_split: bool = True) -> TensorParallelFacts:
    ops = {op.node: op for op in profile.ops}
    consumers: dict[str, list[str]] = {op.node: [] for op in profile.ops}
    for op in profile.ops:
        for src in op.inputs:
            if src in consumers:
                consumers[src].append(op.node)
    derived: set[str] = set()  # ops downstream of some Linear (not constants, masks or position tables)
    for op in profile.ops:
        if is_weight_linear(op) or any(src in derived for src in op.inputs):
            derived.add(op.node)
    role: dict[str, str] = {}
    facts: list[DivisibilityFact] = []
    for op in profile.ops:
        if is_weight_linear(op) and op.node not in role:
            region = _grow_region(op.node, ops, consumers, role, derived, fused_split)
            if region is not None:
                role.update(region)
                facts += _region_facts(region, ops, consumers)
    if vocab_parallel:
        facts += _vocab_parallel(profile, ops, consumers, role)
    problem = _sequence_parallel(ops, consumers, role) if role else ""
    plan: dict[str, str] = {}
    sharded: set[str] = set()
    for node, r in role.items():
        op = ops[node]
        if r in ("colwise", "head"):
            plan[op.module] = "colwise"
            sharded.update(op.params)
        elif r in ("rowwise", "embedding"):
            plan[op.module] = "rowwise"
            sharded.add(_weight(op))
    unique = {(f.size, f.what): f for f in facts}
    return TensorParallelFacts(plan, role, frozenset(sharded), tuple(sorted(unique.values(), key=lambda f: f.what)),
                               problem)


def _sequence_parallel(ops, consumers, role: dict[str, str]) -> str:
    """Mark the ops that run on sequence shards ("sequence"); returns why they cannot ("" when they can)."""
    def sequence_output(op: OpProfile) -> bool:  # a [b, s, h] output: the input (rowwise) or indices (embedding)
        shapes = op.input_shapes
        return (len(shapes) > 0 and len(shapes[0]) >= 3) if role[op.node] == "rowwise" and not _is_conv1d(op) else \
            (len(shapes) > 1 and len(shapes[1]) >= 2)

    work = [n for n, r in role.items() if r in ("rowwise", "embedding") and sequence_output(ops[n])]
    seen = set(work)
    while work:
        node = work.pop()
        for c in consumers[node]:
            r = role.get(c, "")
            if r in ("colwise", "head") or c in seen:
                continue  # a colwise Linear all-gathers the sequence
            op = ops[c]
            if r in ("", "sequence") and packet(op) in SEQUENCE_LOCAL_OPS:
                role[c] = "sequence"
                seen.add(c)
                work.append(c)
                continue
            where = f" in {op.module}" if op.module else ""
            return f"{op.op}{where} would read a sequence shard, and it does not compute token by token"
    return ""


def _weight(op: OpProfile) -> str:
    """The weight parameter of a Linear or embedding (by name when it follows the module, else the first)."""
    own = f"{op.module}.weight"
    return own if own in op.params else op.params[0]


def _grow_region(start: str, ops, consumers, taken: dict[str, str], derived: set[str],
                 fused_split: bool = True) -> dict[str, str] | None:
    """The region opened by Linear `start`, or None when some split tensor would have to be gathered.

    Grows forward from every split tensor to its consumers and backward from every interior op to the
    operands it needs split (sibling projections such as k_proj reached through rotary embedding)."""
    region = {start: "colwise"}
    work = [("forward", start)]

    def claim(node: str, r: str) -> bool:
        if node in taken or region.get(node, r) != r:
            return False
        if node not in region:
            region[node] = r
            if r != "rowwise":
                work.append(("forward", node))
            if r == "interior":
                work.append(("backward", node))
        return True

    while work:
        direction, node = work.pop()
        if direction == "forward":
            for c in consumers[node]:
                op = ops[c]
                if not fused_split and _projection_output(node, region, ops) and packet(op) in FUSED_SPLIT_OPS:
                    return None  # a fused projection split along its sharded features (see FUSED_SPLIT_OPS)
                if not claim(c, "rowwise" if is_weight_linear(op) else "interior") or not (
                        is_weight_linear(op) or _keeps_heads(op)):
                    return None
            continue
        op = ops[node]
        # an attention matmul multiplies two activations head by head: both split, however small one is
        # (v against the scores); an elementwise op may broadcast a small replicated table (rotary)
        per_head = packet(op) in ATTENTION_OPS
        largest = max((ops[s].output_bytes for s in op.inputs if s in ops and s in derived), default=0)
        for src in op.inputs:
            if region.get(src) == "rowwise":
                return None  # a split op would read a rowwise Linear's full (all-reduced) output
            small = not per_head and ops[src].output_bytes * BROADCAST_RATIO <= largest
            if src in region or src not in derived or small:
                continue  # already split, a constant (mask, positions), or a small broadcast operand
            producer = ops[src]
            if is_weight_linear(producer):
                if not claim(src, "colwise"):
                    return None
            elif not _keeps_heads(producer) or not claim(src, "interior"):
                return None
    if "rowwise" not in region.values():
        return None
    for node, r in region.items():
        if r == "rowwise" and any(src not in region for src in ops[node].inputs):
            return None
    return region


def _projection_output(node: str, region: dict[str, str], ops) -> bool:
    """`node` is a colwise Linear's output, as it is or through views only (Conv1D views its addmm's
    output back to [b, s, features] before a fused qkv is split)."""
    while region.get(node) != "colwise":
        op = ops[node]
        if packet(op) not in ("view", "_unsafe_view", "reshape") or len(op.inputs) != 1:
            return False
        node = op.inputs[0]
    return True


def _keeps_heads(op: OpProfile) -> bool:
    name = packet(op)
    if name in SHAPE_OPS or name in ELEMENTWISE_OPS:
        return True
    return name in ATTENTION_OPS and not op.params


def _region_facts(region: dict[str, str], ops, consumers) -> list[DivisibilityFact]:
    facts = []
    for node, r in region.items():
        op = ops[node]
        if r == "colwise":
            out = out_in_features(op)[0]
            facts.append(DivisibilityFact(out, f"out_features {out} of {op.module}"))
        elif r == "rowwise":
            fan_in = out_in_features(op)[1]
            facts.append(DivisibilityFact(fan_in, f"in_features {fan_in} of {op.module}"))
        elif packet(op) in ("view", "reshape", "_unsafe_view") and op.input_shapes and len(op.input_shapes[0]) == 3:
            heads = _heads_after_view(op, ops, consumers)
            if heads:
                facts.append(DivisibilityFact(heads, f"{heads} attention heads ({op.module})"))
    return facts


def _heads_after_view(view: OpProfile, ops, consumers) -> int | None:
    """H when the view turns (b, s, F) into (b, s, H, F / H), read off a single-input consumer."""
    features = view.input_shapes[0][-1]
    for c in consumers[view.node]:
        shapes = ops[c].input_shapes
        if len(shapes) == 1 and len(shapes[0]) == 4 and shapes[0][-2] * shapes[0][-1] == features:
            return shapes[0][-2]
    return None


def _vocab_parallel(profile: ModelProfile, ops, consumers, role: dict[str, str]) -> list[DivisibilityFact]:
    """Mark the output head and the word embedding; returns their vocabulary sizes as facts."""
    facts = []
    outputs = set(profile.output_nodes)
    heads = [op for op in profile.ops if is_weight_linear(op) and op.node not in role
             and _reaches_only_outputs(op.node, ops, consumers, outputs)]
    head_weights = set()
    heads = [op for op in heads if op.input_shapes[1][0] % VOCAB_MULTIPLE == 0]
    for op in heads:
        role[op.node] = "head"
        head_weights.add(_weight(op))
        facts.append(DivisibilityFact(op.input_shapes[1][0], f"vocabulary {op.input_shapes[1][0]} of {op.module}"))
    vocabularies = {op.input_shapes[1][0] for op in heads}
    for op in profile.ops:
        if packet(op) not in EMBEDDING_OPS or not op.params or op.node in role or not op.input_shapes:
            continue
        rows = op.input_shapes[0][0]
        if _weight(op) in head_weights or rows in vocabularies:  # tied to the head, or a word embedding
            role[op.node] = "embedding"
            facts.append(DivisibilityFact(rows, f"vocabulary {rows} of {op.module}"))
    return facts


def _reaches_only_outputs(node: str, ops, consumers, outputs: set[str]) -> bool:
    """The Linear's output is a model output, possibly through shape ops only."""
    seen, frontier = set(), [node]
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        if not consumers[n]:
            if n not in outputs:
                return False
            continue
        for c in consumers[n]:
            if packet(ops[c]) not in SHAPE_OPS:
                return False
            frontier.append(c)
    return bool(outputs & seen)
