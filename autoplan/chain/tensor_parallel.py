"""Megatron-style tensor parallelism found in the captured graph (pure Python, no torch).

A *region* is a set of ops whose outputs are split along the feature (head) dimension when tp > 1.
It opens at column-parallel Linears (weight split by output rows: every rank computes some heads or
some hidden features) and closes at row-parallel Linears (weight split by input columns; their
partial outputs are all-reduced back to the full tensor). Between the two only ops that never mix the
split dimension may run: elementwise ops, shape ops that keep heads whole (view, transpose, ...; not
a split of a fused projection: FUSED_SPLIT_OPS), and attention over heads (SDPA, activation x
activation matmuls, softmax over keys), and reductions and norms over the innermost dimension when it holds
one head's features (a per-head QK-norm: the op's input and output shapes say which dimension it reduces;
_check_per_head_reductions). Complex rotary embeddings (view_as_complex, a complex freqs_cis, view_as_real)
are views. A replicated tensor may join an elementwise op only when it is much smaller than the
split one or computed without any Linear (a broadcast: rotary tables, masks), never into an attention matmul
(both of its activations are split by heads); a full-width replicated
tensor (a residual) would need the missing features, so the region is dropped and its Linears stay
replicated. A parameter read inside a region (the norm's weight) stays whole: plan style "replicate".
Every Linear left whole is reported (TensorParallelFacts.left_whole) with the op that would have needed
every rank's features and why.

Examples: GPT attn.qkv -> attn.proj and mlp.fc -> mlp.proj; HF Llama q/k/v_proj -> o_proj and
gate/up_proj -> down_proj; HF Qwen3 q/k/v_proj -> q_norm, k_norm (replicate) -> o_proj; torchtitan's
Llama3 wq/wk/wv -> wo through complex RoPE.

With the vocabulary-parallel option (layout.SUPPORTED "tp_vocab_parallel") the output head (a
Linear whose output is a model output, or the input of a loss computed inside forward through the ops
torch's loss_parallel computes: LOSS_OPS, LOSS_PARALLEL_OPS) is also "colwise", its logits left sharded on the
vocabulary for the loss (loss_parallel; gathered when the plan disables it), and an input embedding tied to that
head or with as many rows as the head has outputs (the word embedding, not a position table) is
"rowwise" (RowwiseParallel on nn.Embedding: vocabulary rows split, outputs reduce-scattered onto the
sequence with sequence parallelism, else all-reduced). runtime/distributed/tensor_parallel.py runs both.

Sequence parallelism (Korthikanti et al. 2022): the outputs of rowwise Linears (and of the vocabulary-
parallel embedding) are reduce-scattered onto the sequence dimension, and the ops that read them up to the
next colwise Linear or head (which all-gather) run on sequence shards. Those ops must compute each token from
that token alone, which _token_rule decides from what each op computes, not from a list of models: the
dimensions its dim arguments name (OpProfile.dims) and its shapes say whether it works inside a token (a norm,
a Linear over the features, a softmax or top-k over the experts) or across tokens; a reshape keeps the elements'
order, so the (batch, sequence) dimensions merged into one token dimension (or the (tokens, k) routing slots
flattened into rows) stay tokens, while a dimension that then holds parts of several tokens (the sequence moved
into the features) mixes them when an op computes along it; gathers and scatters move whole token rows by
indices computed from these tokens' routing; a value computed from many tokens (a sort of every row's expert,
counts per expert) may only say where rows go, never enter a token's values. Ops DTensor runs on [b, s, ...]
shards as they are (SEQUENCE_LOCAL_OPS: elementwise, norms, casts, dropout, a Linear outside the pairs) get role
"sequence"; the others (a mixture of experts' routing: the (b s, h) view, router, gathers, grouped matmul,
combine) get role "sequence_local", and the innermost module around them whose inputs and outputs are [b, s,
...] shards (the MoE block: HF Mixtral's, Qwen3-MoE's, OLMoE's model.layers.N.mlp) joins the plan with style
"sequence_local": runtime/distributed/tensor_parallel.py runs it on each rank's tokens as plain tensors. Any op that mixes
tokens (attention left whole, expert-choice routing, the sequence reshaped into features) makes sequence
parallelism unavailable for the model: TensorParallelFacts.sequence_parallel_problem says which op and why.

Roles per op (TensorParallelFacts.role): "colwise", "rowwise", "interior" (inside a region),
"head", "embedding", "sequence", "sequence_local", or absent (replicated on every tensor-parallel rank).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import cached_property

from autoplan.chain.ops import OP_TRAITS, ops_with, packet
from autoplan.plan import LeftWhole
from autoplan.profile_data import ModelProfile, OpProfile

LINEAR_OPS = ops_with("linear")
EMBEDDING_OPS = ops_with("embedding")
SHAPE_OPS = ops_with("reshape")
"""Ops that move or copy elements without mixing a feature dimension split evenly into heads."""
ELEMENTWISE_OPS = ops_with("pointwise")
ATTENTION_OPS = ops_with("per_head")
"""Attention over heads: each head's scores and outputs depend on that head's features only."""
REDUCTION_OPS = ops_with("reduction")
SUMMED_OPS = ops_with("summed")
"""Reductions whose shards' results add up: over a projection's split features (OLMoE's and OLMo-2's q/k norms span
every head) each rank reduces its own features and the runtime's DTensor all-reduces the partial result."""
NORM_OPS = ops_with("norm")
LOSS_PARALLEL_OPS = ops_with("loss_parallel")
"""Ops torch's loss_parallel computes on logits sharded on the vocabulary (log-softmax, the NLL loss)."""
LOSS_OPS = ops_with("loss")
"""Losses computed inside the model (HF's labels=, nanoGPT's targets): a vocabulary-parallel head may feed one."""
"""Reductions and norms keep the heads split when they reduce over one head's features only (a per-head
QK-norm): _reduced_size reads which dimension from the op's shapes."""
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
GATHER_ROLES = ("colwise", "head", "interior")
"""Where a sequence shard leaves sequence parallelism: a colwise Linear or the head all-gathers its input, and an op
of a split region (a shared rotary key broadcast into every split head) reads it gathered by DTensor."""
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
    """Module FQN -> "colwise" | "rowwise" | "replicate" | "sequence_local" (Plan.tensor_parallel_plan; "replicate":
    a module whose parameters split ops read, a per-head norm's weight; "sequence_local": a module run on each rank's
    sequence shard as plain tensors under sequence parallelism, a mixture of experts' block)."""
    role: dict[str, str]
    """Op node -> "colwise", "rowwise", "interior", "head" or "embedding"; absent = replicated."""
    sharded_parameters: frozenset[str]
    """Parameters split over the tensor-parallel ranks (weights of split Linears and embeddings, biases
    of colwise Linears); the rest are replicated on every rank."""
    divisibility: tuple[DivisibilityFact, ...] = field(default=())
    """Sizes tp must divide: out_features of colwise, in_features of rowwise, heads, vocabulary."""
    sequence_parallel_problem: str = ""
    """Why the ops between the pairs cannot run on sequence shards (the first op that mixes tokens), or ""."""
    left_whole: tuple[LeftWhole, ...] = ()
    """Every Linear no split shards, in blocks, with the op and the reason (the head's too)."""
    rank_sums: frozenset[str] = frozenset()
    """Interior reductions over a whole projection's split features (a q/k norm spanning every head): each rank
    reduces its shard and one all-reduce of the result joins them (SUMMED_OPS; DTensor's Partial)."""

    @property
    def has_head(self) -> bool:
        """The output head is vocabulary-parallel (its logits leave sharded for the loss)."""
        return "head" in self.role.values()

    def problems(self, tp: int) -> list[str]:
        """Why `tp` cannot split this model (empty when it can); worked out once per tp (layout.problems asks for
        every layout a search checks)."""
        if tp not in self._problems:
            self._problems[tp] = tuple(self._tp_problems(tp))
        return list(self._problems[tp])

    @cached_property
    def _problems(self) -> dict[int, tuple[str, ...]]:
        return {}

    def _tp_problems(self, tp: int) -> list[str]:
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
    role, facts, whole = _regions(profile, ops, consumers, fused_split)
    sums = frozenset(n for n, r in role.items() if r == "interior" and _spans_split_features(ops[n], role, ops))
    if vocab_parallel:
        facts += _vocab_parallel(profile, ops, consumers, role, whole)
        _explain_in_model_losses(profile, ops, consumers, role, whole)
    else:
        _explain_heads(profile, ops, consumers, whole, "the vocabulary-parallel head is off for this search")
    _explain_functional_linears(profile, role, whole)
    left_whole = _left_whole_blocks(whole, role, ops)
    problem, local = _sequence_parallel(ops, consumers, role) if role else ("", [])
    plan, sharded = _module_plan(role, ops)
    plan.update(dict.fromkeys(local, "sequence_local"))
    unique = {(f.size, f.what): f for f in facts}
    return TensorParallelFacts(plan, role, frozenset(sharded), tuple(sorted(unique.values(), key=lambda f: f.what)),
                               problem, left_whole, sums)


def _regions(profile: ModelProfile, ops, consumers,
             fused_split: bool) -> tuple[dict[str, str], list[DivisibilityFact], dict[str, LeftWhole]]:
    """Every region a weight Linear opens: the ops' roles, the sizes tp must divide, and per Linear left whole
    why (the first failed region that reached it; an output projection fed by a whole q, k, v says so)."""
    linears = frozenset(op.node for op in profile.ops if is_weight_linear(op))
    derived: set[str] = set()  # ops downstream of some Linear (not constants, masks or position tables)
    for op in profile.ops:
        if op.node in linears or any(src in derived for src in op.inputs):
            derived.add(op.node)
    graph = _Graph(ops, consumers, frozenset(derived), linears, fused_split)
    role: dict[str, str] = {}
    facts: list[DivisibilityFact] = []
    whole: dict[str, LeftWhole] = {}
    for op in profile.ops:  # attention first: its pairs split the heads (DeepSeek-V3's q_b_proj -> o_proj)
        if op.node in linears and op.node not in role:
            region = {}
            try:
                _grow_region(op.node, graph, role, region)
            except _Whole:
                continue
            if any(packet(ops[n]) in ATTENTION_OPS for n in region):
                role.update(region)
                facts += _region_facts(region, ops, consumers)
    for op in profile.ops:
        if op.node not in linears or op.node in role:
            continue
        region: dict[str, str] = {}
        try:
            _grow_region(op.node, graph, role, region)
        except _Whole as e:
            upstream = [n for n in _feeding_linears(op.node, ops) if n in whole]
            block = LeftWhole((), e.op.op, e.op.module, e.reason) if not upstream or op.node in whole else \
                LeftWhole((), ops[upstream[0]].op, ops[upstream[0]].module, (
                    f"its input is computed from the output of {ops[upstream[0]].module}, which stays whole, so "
                    "no split input reaches it to reduce as the row-parallel half of a pair"))
            for n in region:
                if n in linears:
                    whole.setdefault(n, block)
            continue
        role.update(region)
        facts += _region_facts(region, ops, consumers)
    return role, facts, whole


def _explain_functional_linears(profile: ModelProfile, role: dict[str, str], whole: dict[str, LeftWhole]) -> None:
    """A module computing a projection from its own parameters (nn.MultiheadAttention) stays whole: say why."""
    for op in profile.ops:
        if packet(op) in LINEAR_OPS and op.params and not is_weight_linear(op) and op.node not in role:
            whole.setdefault(op.node, LeftWhole((), op.op, op.module, (
                f"{op.module or 'the model'} multiplies by {', '.join(op.params)} in its own forward, not by calling "
                "an nn.Linear module: torch's tensor parallelism shards Linear modules through their forward")))


def _left_whole_blocks(whole: dict[str, LeftWhole], role: dict[str, str], ops) -> tuple[LeftWhole, ...]:
    """The reasons of the Linears left whole, each with every module it applies to."""
    blocks: dict[LeftWhole, list[str]] = {}
    for n, block in whole.items():
        if n not in role:
            blocks.setdefault(block, []).append(ops[n].module)
    return tuple(replace(b, modules=tuple(dict.fromkeys(modules))) for b, modules in blocks.items())


def _module_plan(role: dict[str, str], ops) -> tuple[dict[str, str], set[str]]:
    """Module FQN -> style, and the parameters split, from the ops' roles."""
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
    for node, r in role.items():  # a per-head norm's weight, read by split ops: replicated
        if r == "interior":
            for param in ops[node].params:
                owner = param.rpartition(".")[0]
                if param not in sharded and owner not in plan:
                    plan[owner] = "replicate"
    return plan, sharded


def _sequence_parallel(ops, consumers, role: dict[str, str]) -> tuple[str, list[str]]:
    """Mark the ops that run on sequence shards: "sequence" (on DTensors sharded on the sequence, op by op) or
    "sequence_local" (inside a module that runs on this rank's tokens as plain tensors: a mixture of experts'
    routing, runtime/distributed/tensor_parallel.py); returns why they cannot ("" when they can) and the modules that run on
    this rank's tokens as plain tensors."""
    def sequence_output(op: OpProfile) -> bool:  # a [b, s, h] output: the input (rowwise) or indices (embedding)
        shapes = op.input_shapes
        return (len(shapes) > 0 and len(shapes[0]) >= 3) if role[op.node] == "rowwise" and not _is_conv1d(op) else \
            (len(shapes) > 1 and len(shapes[1]) >= 2)

    starts = [n for n, r in role.items() if r in ("rowwise", "embedding") and sequence_output(ops[n])]
    reached, frontier = set(starts), list(starts)
    while frontier:  # every op reading a sequence shard, up to the colwise Linears (which all-gather)
        for c in consumers[frontier.pop()]:
            if c not in reached and role.get(c, "") not in GATHER_ROLES:
                reached.add(c)
                frontier.append(c)
    tokens: dict[str, Tokens] = {}
    for n in starts:  # a rowwise Linear's [b, s, ..., in] input, an embedding's [b, s, ...] indices
        op = ops[n]
        shape = tuple(op.input_shapes[0]) if role[n] == "rowwise" and not _is_conv1d(op) else \
            tuple(op.input_shapes[1]) + (1,)
        tokens[n] = Tokens("tokens", shape[0] * shape[1], len(shape))
    for node, op in ops.items():  # topological order: every operand's tokens known before its consumers
        if node not in reached or node in tokens:
            continue
        r = role.get(node, "")
        if r not in ("", "sequence"):
            return _mixes_tokens(op, "it is split over the tensor-parallel ranks as well"), []
        found = _sequence_rule(op, tokens)
        if isinstance(found, str):
            before = next((tokens[src] for src in op.inputs if src in tokens and tokens[src].why), None)
            if before is not None:  # the op that left the token order (DTensor would have run it) says why
                return _mixes_tokens(ops[before.origin], before.why), []
            return _mixes_tokens(op, found), []
        if found.kind == "dtensor" and not found.why:
            found = replace(found, origin=node, why=next(
                (tokens[src].why for src in op.inputs if src in tokens and tokens[src].why), ""))
            if not found.why:
                found = replace(found, why=_dtensor_reason(op, tokens))
        tokens[node] = found
    for n in reached - set(starts):
        role[n] = "sequence" if _dtensor_sequence_op(ops[n], tokens, tokens[n]) else "sequence_local"
    for node in reached:  # what leaves the shards (to a colwise Linear's all-gather, into a split region's op, as an
        found = tokens[node]  # output) is a DTensor sharded on the sequence, which DTensor gathers there
        if any(role.get(c, "") in GATHER_ROLES for c in consumers[node]) and not (
                found.kind in ("dtensor", "sharded") or found.kind == "tokens" and found.dims >= 3) or \
                found.kind == "sharded" and role.get(node) == "sequence_local":
            return _mixes_tokens(ops[node], "a colwise Linear would all-gather a tensor that is no [batch, sequence, "
                                            "...] shard"), []
    return _local_modules(ops, consumers, role, tokens)


def _sequence_rule(op: OpProfile, tokens: dict[str, "Tokens"]) -> "Tokens | str":
    """_token_rule, and the ops DTensor runs on sequence shards as they are (SEQUENCE_LOCAL_OPS on [b, s, ...]
    shards: a norm, a residual add, a Linear outside the pairs, a mean over the sequence DTensor reduces)."""
    inputs = [tokens[src] for src in op.inputs if src in tokens]
    if any(t.kind == "sharded" for t in inputs) or packet(op) not in SEQUENCE_LOCAL_OPS and _batch_sequence(
            op, tokens) and _sharded_rule(op, tokens) is not None:
        found = _sharded_rule(op, tokens)
        return found if found is not None else "it cuts, merges or reduces the sequence dimension of a DTensor shard"
    dtensor = packet(op) in SEQUENCE_LOCAL_OPS and all(
        t.kind == "dtensor" or t.kind == "tokens" and t.dims >= 3 for t in inputs)
    if any(t.kind == "dtensor" for t in inputs) and not dtensor:
        return "no rule says it computes each token from that token alone"
    if not op.output_shapes and not dtensor:
        return "the capture does not record its output shapes (profile the model again)"
    found = _token_rule(op, tokens) if not any(t.kind == "dtensor" for t in inputs) else "a DTensor op"
    if isinstance(found, Tokens) and found.kind == "tokens":
        found = replace(found, dims=len(_shape(op)))
    if dtensor and isinstance(found, str) and "pointwise" in OP_TRAITS.get(packet(op), ()) and len(_shape(op)) >= 3:
        first = next((t for t in inputs if t.kind == "tokens"), None)  # DTensor shards a replicated table alike
        return Tokens("tokens", first.count, len(_shape(op))) if first else Tokens("dtensor")
    if dtensor and (isinstance(found, str) or found.kind != "tokens" or found.dims < 3):
        return Tokens("dtensor")
    return found


SEQUENCE_KEEPING = frozenset({"view", "_unsafe_view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze",
                              "contiguous", "clone", "_to_copy", "to", "type_as", "alias", "detach"})
"""Shape ops that keep the elements' order: a dimension survives them when the output has one of the same size
behind as many elements."""


def _sharded_rule(op: OpProfile, tokens: dict[str, "Tokens"]) -> "Tokens | None":
    """A DTensor op keeping the sequence dimension of its sharded inputs whole (DeepSeek-V3's shared rotary key
    viewed as [b, 1, s, d], rotated by the position table, concatenated along its features and expanded over the
    heads): Tokens("sharded") with the output's sequence dimension (`dim`), or None when the op cuts, merges or
    reduces that dimension. Which dimension survives follows from what the op computes: order-keeping views, a
    transpose's or permute's permutation, an expand's or elementwise op's broadcast (trailing dimensions aligned),
    cuts, concatenations, reductions and Linears along other dimensions."""
    name, traits = packet(op), OP_TRAITS.get(packet(op), frozenset())
    sources = [(tokens[src], tuple(shape)) for src, shape in zip(op.inputs, op.input_shapes) if src in tokens]
    if not sources or not op.output_shapes or "creates" in traits:
        return None
    out = tuple(op.output_shapes[0])
    dims = tuple(d % len(sources[0][1]) for d in op.dims or ()) if sources[0][1] else ()
    kept = set()
    for data, shape in sources:
        d = data.dim if data.kind == "sharded" else 1
        if not (data.kind == "sharded" or data.kind == "tokens" and len(shape) >= 3 and
                shape[0] * shape[1] == data.count) or d >= len(shape):
            return None
        kept.add(_kept_dimension(name, traits, shape, out, d, dims))
    if len(kept) != 1 or None in kept:
        return None
    (d,) = kept
    count = sources[0][0].count
    if d == 1 and len(out) >= 3 and out[0] * out[1] == count:  # [b, s, ...] again
        return Tokens("tokens", count, len(out))
    return Tokens("sharded", count, len(out), dim=d)


def _batch_sequence(op: OpProfile, tokens: dict[str, "Tokens"]) -> bool:
    """Every input computed from the shard is a [b, s, ...] tensor in token order (its first two dimensions hold
    the tokens)."""
    sources = [(tokens[src], tuple(shape)) for src, shape in zip(op.inputs, op.input_shapes) if src in tokens]
    return bool(sources) and all(t.kind == "tokens" and len(shape) >= 3 and shape[0] * shape[1] == t.count
                                 for t, shape in sources)


def _kept_dimension(name: str, traits: frozenset[str], shape: tuple[int, ...], out: tuple[int, ...], d: int,
                    dims: tuple[int, ...]) -> int | None:
    """Where dimension `d` of an input of `shape` lies in the output `out`, when the op leaves it whole (None when it
    cuts, merges or computes along it)."""
    size, before = shape[d], _product(shape[:d])
    if name in SEQUENCE_KEEPING:
        return next((e for e in range(len(out)) if out[e] == size and _product(out[:e]) == before), None)
    if name in ("transpose", "permute", "t"):
        order = list(range(len(shape)))
        if name == "permute":
            order = list(dims)
        else:
            a, b = dims if dims else (0, 1)
            order[a], order[b] = order[b], order[a]
        return order.index(d)
    if name in ("slice", "narrow", "split", "split_with_sizes", "chunk", "cat", "select", "unbind") or \
            "pointwise" in traits or name == "expand" or "reduction" in traits or name in NORM_OPS or \
            name in LINEAR_OPS:
        if d in dims or (name in LINEAR_OPS or name in NORM_OPS) and d == len(shape) - 1:
            return None  # cut, concatenated, reduced or multiplied along the sequence
        e = d + len(out) - len(shape)  # broadcast: trailing dimensions aligned; select drops one dimension
        if name in ("select", "unbind") or ("reduction" in traits and len(out) < len(shape)):
            e = d - sum(1 for k in dims if k < d)
        return e if 0 <= e < len(out) and out[e] == size else None
    return None


def _product(sizes) -> int:
    total = 1
    for size in sizes:
        total *= size
    return total


def _dtensor_reason(op: OpProfile, tokens: dict[str, "Tokens"]) -> str:
    """Why `op`, run by DTensor on a shard, leaves the token order (_token_rule's reason)."""
    found = _token_rule(op, tokens)
    return found if isinstance(found, str) else "its result is not in token order"


def _mixes_tokens(op: OpProfile, why: str) -> str:
    where = f" in {op.module}" if op.module else ""
    return f"{op.op}{where} would read a sequence shard, and it does not compute token by token: {why}"


@dataclass(frozen=True)
class Tokens:
    """What a tensor computed from a sequence shard holds of its tokens (_token_rule):
    - "tokens": its elements in token order, numel / count of them per token (a [b, s, h] shard, its (b s, h)
      view, a router's (b s, k) top-k);
    - "rows": each row (dimension 0) a copy of one token's (or one token-slot's) row, in any order (tokens gathered
      for their experts);
    - "routes": computed from many tokens at once (a sort of every row's expert, counts per expert): usable only to
      say where rows go (a gather's or scatter's index, a grouped matmul's offsets), never as a value of a token;
    - "dtensor": a DTensor op's result on a shard that is not in token order (a mean over the sequence, which DTensor
      reduces over the ranks): only ops DTensor runs as they are (SEQUENCE_LOCAL_OPS) may read it."""

    kind: str
    count: int = 0
    """Tokens ("tokens")."""
    dims: int = 0
    """Dimensions of the tensor ("tokens": 3 or more for a [b, s, ...] shard DTensor runs ops on)."""
    picks: bool = False
    """("routes") Computed by choosing among tokens (a top-k, maximum or count over them, as expert-choice routing
    picks each expert's tokens), not only by ordering them (a sort of the rows by expert): a gather by it would pick
    some tokens by the others' values."""
    origin: str = ""
    """("dtensor") The op whose result left the token order."""
    why: str = ""
    """("dtensor") How it did (_token_rule's reason)."""
    dim: int = 1
    """("sharded") The dimension holding the sequence: a DTensor sharded there, not in [b, s, ...] order (DeepSeek-V3's
    rotary key viewed as [b, 1, s, d]); DTensor runs the ops that keep it whole and gathers it where a split region
    reads it (_sharded_rule)."""


def _shape(op: OpProfile) -> tuple[int, ...]:
    """The op's (first) output shape; its first input's in a profile without output shapes (what an op DTensor runs
    as it is keeps)."""
    if op.output_shapes:
        return tuple(op.output_shapes[0])
    return tuple(op.input_shapes[0]) if op.input_shapes else ()


def _dim_kind(shape: tuple[int, ...], count: int, d: int) -> str:
    """Dimension `d` of a tensor holding `count` tokens in token order: "feature" (it lies inside one token),
    "token" (each index along it one or more whole tokens, or one token's slot: it cuts no token's elements
    across indices), or "mixed" (one index holds parts of several tokens)."""
    numel = 1
    for size in shape:
        numel *= size
    per_token = numel // count if count and numel % count == 0 else 0
    inner = 1
    for size in shape[d + 1:]:
        inner *= size
    if per_token and per_token % (inner * shape[d]) == 0:
        return "feature"
    if per_token and (inner % per_token == 0 or per_token % inner == 0):
        return "token"
    return "mixed"


def _token_rule(op: OpProfile, tokens: dict[str, Tokens]) -> Tokens | str:
    """What `op`'s output holds of the tokens when it reads tensors computed from a sequence shard (`tokens`
    holds its inputs'), from what the op computes (chain/ops.py traits, OpProfile.dims, the shapes); or why it
    mixes tokens. Each token's output depends on that token alone when every op keeps tokens apart: elementwise
    ops and Linears over the features; reshapes that keep token order (the (b, s) dimensions merged into one
    token dimension, (tokens, k) routing slots flattened into rows); reductions, softmax, top-k along features
    (the experts' scores); gathers and scatters that move whole rows by an index computed from these tokens'
    routing; a grouped matmul over rows; the top-k slots summed back per token."""
    name = packet(op)
    shape = _shape(op)
    traits = OP_TRAITS.get(name, frozenset())
    inputs = [tokens.get(src) for src in op.inputs]
    shapes = list(op.input_shapes)
    first = next((t for t in inputs if t is not None), None)
    if first is None:
        return "it reads no tensor computed from the shard"
    if "gathers" in traits:
        return _gather_rule(op, inputs, tokens)
    if "scatters" in traits:
        return _scatter_rule(op, inputs, tokens, shape)
    if any(t is not None and t.kind == "routes" for t in inputs) and not all(
            t is None or t.kind == "routes" for t in inputs) and "grouped" not in traits:
        return "it combines a token's values with one computed from many tokens (a sum, sort or count over them)"
    if all(t is None or t.kind == "routes" for t in inputs):
        return Tokens("routes", picks=any(t is not None and t.picks for t in inputs))
    data = inputs[0] if inputs and inputs[0] is not None else first
    data_shape = tuple(shapes[0]) if shapes else ()
    if "grouped" in traits:
        if inputs[0] is None or inputs[0].kind == "routes" or any(t is not None and t.kind != "routes"
                                                                  for t in inputs[1:]):
            return "its rows, weights and group offsets are not (token rows, weights, routing offsets)"
        return Tokens("rows")
    if name in LINEAR_OPS or "gemm" in traits:
        if sum(t is not None for t in inputs) > 1:
            return "it multiplies two tensors computed from the tokens (it may mix them)"
        if inputs[0] is None or len(data_shape) < 2:
            return "it multiplies the tokens from the left (it may mix them)"
        return _along(data, data_shape, (len(data_shape) - 1,)) or \
            "it computes along a dimension that holds several tokens"
    if "along" in traits:
        if op.dims is None:
            return "the capture does not say which dimension it computes along"
        found = _along(data, data_shape, tuple(op.dims or ()))
        ordered = bool(op.dims) and tuple(op.output_shapes[0]) == data_shape  # a sort, a cumsum: no token dropped
        return found if isinstance(found, Tokens) else Tokens("routes", picks=not ordered)
    if "reduction" in traits or name in NORM_OPS:
        size = _reduced_size(op)
        return (_along(data, data_shape, (len(data_shape) - 1,)) or "it reduces over a dimension that holds tokens") \
            if size else "it reduces over dimensions the capture does not show"
    if "pointwise" in traits or name in NORM_OPS:
        return _pointwise_rule(op, inputs, data, shape)
    if "reshape" in traits or "view" in traits:
        return _reshape_rule(op, data, data_shape, shape, tokens)
    return "no rule says it computes each token from that token alone"


def _along(data: Tokens, shape: tuple[int, ...], dims: tuple[int, ...]) -> Tokens | str:
    """An op computing along `dims` of a tensor holding `data`: its tokens kept when every such dimension lies inside
    a token (a row's features); "" when one does not (the caller decides: routes, or a mixing op)."""
    if not dims:
        return ""
    if data.kind == "rows":
        return data if all(d > 0 for d in dims) else ""
    if data.kind == "tokens" and all(_dim_kind(shape, data.count, d) == "feature" for d in dims):
        return data
    return ""


def _pointwise_rule(op: OpProfile, inputs: list[Tokens | None], data: Tokens, out: tuple[int, ...]) -> Tokens | str:
    """Elementwise: operands computed from the tokens hold the same tokens alike, and the others (a weight, a
    constant) broadcast over the token dimensions (size 1 there): no more operands have a size above 1 at a token
    dimension than there are operands computed from the tokens."""
    kinds = {t.kind for t in inputs if t is not None}
    if len(kinds) > 1:
        return "it combines a tensor in token order with rows gathered in another order"
    per_token = 0
    for shape in op.input_shapes:
        aligned = (1,) * (len(out) - len(shape)) + tuple(shape)
        per_token += any(size > 1 and _token_dimension(data, out, d) for d, size in enumerate(aligned))
    if per_token > sum(t is not None for t in inputs):
        return "it combines the tokens with a tensor that has a value per token not computed from them"
    if data.kind == "rows":
        return data
    return Tokens("tokens", data.count)


def _token_dimension(data: Tokens, shape: tuple[int, ...], d: int) -> bool:
    return d == 0 if data.kind == "rows" else _dim_kind(shape, data.count, d) != "feature"


def _reshape_rule(op: OpProfile, data: Tokens, in_shape: tuple[int, ...], out: tuple[int, ...],
                  tokens: dict[str, Tokens]) -> Tokens | str:
    """Shape ops. Those keeping the elements' order (view, reshape, flatten, a copy or cast) keep the tokens in
    order; a split, slice or select keeps them when it cuts along features; a transpose or permute when it moves
    feature dimensions only. Rows gathered for the experts, viewed as (tokens, k, ...), are the k routing slots of
    each token in token order (the top-k combine)."""
    name = packet(op)
    dims = op.dims
    if name in ("split", "split_with_sizes", "chunk", "unbind", "narrow", "slice", "select", "transpose", "permute",
                "expand", "squeeze", "unsqueeze", "as_strided", "t"):
        if name in ("squeeze", "unsqueeze") and op.output_shapes:
            moved = ()  # sizes-1 dimensions come and go: the elements keep their order
        elif name == "t":
            moved = (0, 1)
        elif name == "expand":
            moved = tuple(d for d, (a, b) in enumerate(zip(in_shape[::-1], out[::-1])) if a != b)
            moved = tuple(len(out) - 1 - d for d in moved)
            in_shape = out
        elif dims is None:
            return "the capture does not say which dimension it cuts or moves"
        elif name == "permute":
            moved = tuple(d for d, p in enumerate(dims) if d != p)
        else:
            moved = dims
        if not moved:
            return data if data.kind != "tokens" else Tokens("tokens", data.count)
        found = _along(data, in_shape, tuple(moved))
        return found or "it cuts or moves a dimension that holds tokens"
    if data.kind == "tokens":
        return Tokens("tokens", data.count)
    if data.kind == "rows":
        if out and in_shape and out[0] == in_shape[0]:
            return data
        return _regrouped_slots(out, tokens)
    return data


def _regrouped_slots(out: tuple[int, ...], tokens: dict[str, Tokens]) -> Tokens | str:
    """Rows viewed as (tokens, k, ...): each token's k routed rows (the combine after the experts), in token order."""
    counts = {t.count for t in tokens.values() if t.kind == "tokens"}
    if len(out) >= 2 and out[0] in counts:
        return Tokens("tokens", out[0])
    return "it regroups gathered rows other than as (tokens, slots, ...)"


def _gather_rule(op: OpProfile, inputs: list[Tokens | None], tokens: dict[str, Tokens]) -> Tokens | str:
    """A gather moves whole rows of its source by an index computed from the tokens' routing: rows of tokens."""
    source, index = (inputs + [None, None])[:2]
    dims = op.dims if op.dims is not None else (0,)
    if source is None:
        return "it gathers from a tensor not computed from the tokens by indices computed from them"
    if index is None:
        return "it gathers tokens by an index not computed from their routing"
    if index.kind == "routes" and index.picks:
        return "it picks tokens by a choice made across them (a top-k or count over the tokens: expert-choice routing)"
    if source.kind == "routes":
        return Tokens("routes", picks=source.picks)
    if dims != (0,) and _within_rows(op, inputs):
        return _within_rows(op, inputs)
    if dims != (0,) or not op.input_shapes:
        return "it gathers along a dimension other than the tokens'"
    shape = tuple(op.input_shapes[0])
    if source.kind == "tokens" and _dim_kind(shape, source.count, 0) != "token":
        return "it gathers along a dimension that mixes tokens and features"
    return Tokens("rows")


def _within_rows(op: OpProfile, inputs: list[Tokens | None]) -> Tokens | None:
    """A gather or scatter along a feature dimension of token rows (torch.gather / scatter_ along dim 1 with every
    operand holding the same tokens as rows: DeepSeek-V3's group mask and top-k weights): each token's row reads or
    writes within itself, so the tokens are kept (None otherwise)."""
    shapes = [tuple(shape) for shape, t in zip(op.input_shapes, inputs) if t is not None]
    kept = [t for t in inputs if t is not None]
    if not op.dims or not kept or any(t.kind != "tokens" for t in kept) or len({t.count for t in kept}) != 1:
        return None
    count = kept[0].count
    if any(not shape or shape[0] != count for shape in shapes) or any(d % len(shapes[0]) == 0 for d in op.dims):
        return None
    return Tokens("tokens", count)


def _scatter_rule(op: OpProfile, inputs: list[Tokens | None], tokens: dict[str, Tokens],
                  out: tuple[int, ...]) -> Tokens | str:
    """A scatter writes (adds) whole rows at indices computed from the tokens' routing: into a tensor made from
    sizes alone (zeros) or one holding the same tokens."""
    dims = op.dims if op.dims is not None else (0,)
    target, rest = (inputs + [None])[0], [t for t in inputs[1:] if t is not None]
    if dims != (0,):
        return _within_rows(op, inputs) or "it scatters along a dimension other than the tokens'"
    if all(t.kind == "routes" for t in rest) and (target is None or target.kind == "routes"):
        return Tokens("routes", picks=any(t.picks for t in rest) or (target is not None and target.picks))
    if any(t.kind == "routes" and t.picks for t in rest):
        return "it writes tokens at places chosen across them (a top-k or count over the tokens)"
    counts = {t.count for t in tokens.values() if t.kind == "tokens"}
    if target is not None and target.kind == "tokens":
        return target
    if target is None and out and out[0] in counts:
        return Tokens("tokens", out[0])
    return Tokens("rows")


def _dtensor_sequence_op(op: OpProfile, tokens: dict[str, Tokens], found: Tokens) -> bool:
    """An op DTensor runs on sequence shards as it is: SEQUENCE_LOCAL_OPS reading [b, s, ...] shards (or DTensor
    results) only."""
    inputs = [tokens[src] for src in op.inputs if src in tokens]
    if found.kind == "sharded" or any(t.kind == "sharded" for t in inputs):
        return True
    if packet(op) not in SEQUENCE_LOCAL_OPS and found.kind == "tokens" and _batch_sequence(op, tokens) \
            and _sharded_rule(op, tokens) is not None:
        return True  # a view keeping the [b, s, ...] shard's sequence dimension whole
    return packet(op) in SEQUENCE_LOCAL_OPS and found.kind in ("tokens", "dtensor") and (
        found.kind == "dtensor" or found.dims >= 3) and all(t.kind == "dtensor" or t.dims >= 3 for t in inputs)


def _local_modules(ops, consumers, role: dict[str, str], tokens: dict[str, Tokens]) -> tuple[str, list[str]]:
    """Every "sequence_local" op must lie in a module whose inputs and outputs computed from the shard are [b, s, ...]
    tensors in token order and that holds no split Linear (runtime/distributed/tensor_parallel.py runs that module on this rank's
    tokens as plain tensors); returns why not ("" when they do) and those modules (outermost first)."""
    members: dict[str, list[str]] = {}
    for node, op in ops.items():
        for module in op.module_stack:
            members.setdefault(module, []).append(node)
    found: dict[str, str] = {}
    for node, r in role.items():
        if r == "sequence_local" and node not in found:
            module = _local_module(node, ops, consumers, role, tokens, members)
            if not module:
                return _mixes_tokens(ops[node], "no module around it takes and returns whole [batch, sequence, ...] "
                                                "tensors, holding no split Linear, to run on this rank's tokens"), []
            found.update(dict.fromkeys(members[module], module))
    return "", sorted(set(found.values()))


def _local_module(node: str, ops, consumers, role: dict[str, str], tokens: dict[str, Tokens],
                  members: dict[str, list[str]]) -> str:
    """The innermost module around op `node` whose every input and output computed from the sequence shard is a
    [b, s, ...] tensor in token order and that holds no split Linear ("" when none)."""
    for module in reversed(ops[node].module_stack):
        inside = members[module]
        own = set(inside)
        boundary = {src for n in inside for src in ops[n].inputs if src not in own} | \
            {n for n in inside if any(c not in own for c in consumers[n])}
        split = [n for n in inside if role.get(n, "") in ("colwise", "rowwise", "interior", "head", "embedding")]
        if split and not _split_islands(module, split, ops, consumers, tokens, members):
            return ""
        if all(src not in tokens or (tokens[src].kind == "tokens" and tokens[src].dims >= 3) for src in boundary):
            return module
    return ""


def _split_islands(module: str, split: list[str], ops, consumers, tokens: dict[str, Tokens],
                   members: dict[str, list[str]]) -> bool:
    """The split Linears inside a module run on this rank's tokens lie in submodules of it (DeepSeek-V3's and
    Qwen2-MoE's shared experts, a colwise/rowwise pair) that take and return [b, s, ...] tensors in token order and
    hold nothing else: runtime/distributed/tensor_parallel.py runs such a submodule on DTensors again (its input a sequence
    shard the colwise Linears all-gather, its rowwise output reduce-scattered back onto the sequence)."""
    islands = {ops[n].module.rpartition(".")[0] for n in split if is_weight_linear(ops[n])}
    if not islands or any(not island.startswith(module + ".") for island in islands):
        return False
    covered = set()
    for island in islands:
        inside = set(members.get(island, ()))
        boundary = {src for n in inside for src in ops[n].inputs if src not in inside} | \
            {n for n in inside if any(c not in inside for c in consumers[n])}
        if not all(src not in tokens or tokens[src].kind == "tokens" and len(_shape(ops[src])) >= 3
                   for src in boundary if src not in inside) or \
                any(len(_shape(ops[n])) < 3 for n in boundary if n in inside):
            return False
        covered |= inside
    return set(split) <= covered


def _weight(op: OpProfile) -> str:
    """The weight parameter of a Linear or embedding (by name when it follows the module, else the first)."""
    own = f"{op.module}.weight"
    return own if own in op.params else op.params[0]


def _feeding_linears(node: str, ops) -> list[str]:
    """The weight Linears whose outputs reach `node`'s inputs through shape ops and attention only, nearest first:
    the colwise halves (q, k, v) that a row-parallel `node` (an attention's output projection) would pair with."""
    found, seen, frontier = [], set(), list(ops[node].inputs)
    while frontier:
        n = frontier.pop(0)
        if n in seen or n not in ops:
            continue
        seen.add(n)
        name = packet(ops[n])
        if is_weight_linear(ops[n]):
            found.append(n)
        elif name in SHAPE_OPS or name in ATTENTION_OPS:
            frontier.extend(ops[n].inputs)
    return found


class _Whole(Exception):
    """A region cannot stay split: the op that would need the missing features, and why."""

    def __init__(self, op: OpProfile, reason: str) -> None:
        super().__init__(reason)
        self.op, self.reason = op, reason


@dataclass(frozen=True)
class _Graph:
    """The captured ops as the region search reads them (what it asks of every op, worked out once)."""

    ops: dict[str, OpProfile]
    consumers: dict[str, list[str]]
    derived: frozenset[str]
    """Ops downstream of some weight Linear (not constants, masks or position tables)."""
    linears: frozenset[str]
    """The weight Linears' ops (is_weight_linear)."""
    fused_split: bool
    """A fused projection (q, k and v in one Linear) may be split (Megatron-LM's interleaved weights)."""


def _grow_region(start: str, graph: _Graph, taken: dict[str, str], region: dict[str, str]) -> None:
    """Fill `region` with the region opened by Linear `start`; raises _Whole when some split tensor would have
    to be gathered (`region` then holds what it had reached).

    Grows forward from every split tensor to its consumers and backward from every interior op to the
    operands it needs split (sibling projections such as k_proj reached through rotary embedding)."""
    ops, consumers, derived, linears = graph.ops, graph.consumers, graph.derived, graph.linears
    region[start] = "colwise"
    work = [("forward", start)]

    def claim(node: str, r: str) -> None:
        if node in taken:
            raise _Whole(ops[node], f"it would join the split region of {ops[node].module or 'the model'} "
                                    "already found")
        if region.get(node, r) != r:
            raise _Whole(ops[node], f"it would be both {region[node]} and {r} in one region")
        if node not in region:
            region[node] = r
            if r != "rowwise":
                work.append(("forward", node))
            if r == "interior":
                work.append(("backward", node))

    while work:
        direction, node = work.pop()
        if direction == "forward":
            for c in consumers[node]:
                op = ops[c]
                if not graph.fused_split and _projection_output(node, region, ops) and packet(op) in FUSED_SPLIT_OPS:
                    raise _Whole(op, "it cuts a fused projection (q, k and v in one Linear) along the features the "
                                     "Linear would shard: torch's ColwiseParallel shards the fused rows as they are, "
                                     "so a rank would hold some heads' q but other heads' k and v")
                if c in linears:
                    claim(c, "rowwise")
                    continue
                why = _mixes_heads(op)
                if why:
                    raise _Whole(op, why)
                claim(c, "interior")
                _check_per_head_reduction(op, region, ops)
            continue
        op = ops[node]
        # an attention matmul multiplies two activations head by head: both split, however small one is
        # (v against the scores); an elementwise op may broadcast a small replicated table (rotary)
        per_head = packet(op) in ATTENTION_OPS
        largest = max((_broadcast_bytes(s, ops) for s in op.inputs if s in ops and s in derived), default=0)
        for src in op.inputs:
            if region.get(src) == "rowwise":
                raise _Whole(op, f"it reads the split features together with the full output of row-parallel "
                                 f"{ops[src].module}")
            small = not per_head and _broadcast_bytes(src, ops) * BROADCAST_RATIO <= largest
            if src in region or src not in derived or small:
                continue  # already split, a constant (mask, positions), or a small broadcast operand
            producer = ops[src]
            if src in linears:
                claim(src, "colwise")
                continue
            why = _mixes_heads(producer)
            if why:
                raise _Whole(op, f"it joins the split features with the output of {_describe(producer)}, which "
                                 f"cannot be split: {why}")
            claim(src, "interior")
            _check_per_head_reduction(producer, region, ops)
    if "rowwise" not in region.values():
        raise _Whole(ops[start], "no row-parallel Linear reads its split output")
    for node, r in region.items():
        for src in ops[node].inputs:
            if r == "rowwise" and src not in region:
                raise _Whole(ops[node], f"it also reads the output of {_describe(ops[src])}, which is not split")
    _check_per_head_reductions(region, ops)


def _broadcast_bytes(node: str, ops) -> int:
    """The bytes a tensor holds before broadcasting: an expand's are its input's (DeepSeek-V3's shared rotary key,
    one head expanded over every head, is a small replicated operand, not a full-width one)."""
    op = ops[node]
    while packet(op) == "expand" and op.inputs and op.inputs[0] in ops:
        op = ops[op.inputs[0]]
    return op.output_bytes


def _describe(op: OpProfile) -> str:
    return f"{op.op} in {op.module or 'the model'}"


def _mixes_heads(op: OpProfile) -> str:
    """"" when `op` keeps a tensor split by heads split (each output head depends on that head only); else why."""
    name = packet(op)
    if name in SHAPE_OPS or name in ELEMENTWISE_OPS or "creates" in OP_TRAITS.get(name, ()):
        return ""  # a tensor made from sizes alone (new_empty) reads no input's values
    if name in ATTENTION_OPS:
        return "" if not op.params else "it multiplies by a weight, not head by head"
    if name in REDUCTION_OPS or name in NORM_OPS:
        return "" if _reduced_size(op) else "it reduces over more than the innermost dimension (or the capture " \
                                            "does not show which)"
    return "no rule says it keeps each rank's features apart (it may mix features of every rank)"


def _reduced_size(op: OpProfile) -> int | None:
    """The size of the innermost dimension when `op` reduces (normalizes) over it alone, else None."""
    if not op.input_shapes or not op.input_shapes[0]:
        return None
    shape = tuple(op.input_shapes[0])
    if packet(op) in NORM_OPS:  # normalized_shape is the weight's
        weight = op.input_shapes[1] if len(op.input_shapes) > 1 and op.params else None
        return shape[-1] if weight is not None and tuple(weight) == shape[-1:] else None
    out = tuple(op.output_shapes[0]) if op.output_shapes else None
    if out == shape[:-1] + (1,) or (out == shape[:-1] and (len(shape) < 2 or shape[-2] != shape[-1])):
        return shape[-1]
    return None


def _check_per_head_reductions(region: dict[str, str], ops) -> None:
    """A reduction (a norm) inside the region reduces over a head's features only: its innermost dimension is
    a proper divisor of every colwise Linear's features (queries and keys viewed as heads x head_dim, as
    Qwen3's and Gemma-3's QK-norms are), so with tp dividing the heads each rank holds whole heads."""
    for node, r in region.items():
        if r == "interior":
            _check_per_head_reduction(ops[node], region, ops)


def _check_per_head_reduction(op: OpProfile, region: dict[str, str], ops) -> None:
    """_check_per_head_reductions for one op, against the colwise Linears the region holds so far."""
    if packet(op) not in REDUCTION_OPS and packet(op) not in NORM_OPS:
        return
    if _spans_split_features(op, region, ops):
        return  # over a whole projection's split features: each rank sums its shard, one all-reduce joins them
    features = sorted({out_in_features(ops[n])[0] for n, r in region.items() if r == "colwise"})
    size = _reduced_size(op)
    if size is None or any(f % size or f == size for f in features):
        raise _Whole(op, f"it reduces over {size} features at once, not over one head's: every feature of a "
                         f"{'/'.join(map(str, features))}-feature projection")


def _spans_split_features(op: OpProfile, region: dict[str, str], ops) -> bool:
    """`op` sums (or averages) over all the features of a colwise projection in `region` (OLMoE's and OLMo-2's
    RMS q/k norms over every head): the shards' results add up (SUMMED_OPS)."""
    size = _reduced_size(op)
    return size is not None and packet(op) in SUMMED_OPS and \
        size in {out_in_features(ops[n])[0] for n, r in region.items() if r == "colwise"}


def _projection_output(node: str, region: dict[str, str], ops) -> bool:
    """`node` is a colwise Linear's output, as it is or through views only (Conv1D views its addmm's
    output back to [b, s, features] before a fused qkv is split)."""
    while region.get(node) != "colwise":
        op = ops[node]
        if packet(op) not in ("view", "_unsafe_view", "reshape") or len(op.inputs) != 1:
            return False
        node = op.inputs[0]
    return True


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


def _output_heads(profile: ModelProfile, ops, consumers, role: dict[str, str]) -> list[OpProfile]:
    """Unsplit Linears whose output is a model output or a loss computed inside the model, through shape ops and
    the ops torch's loss_parallel computes on vocabulary-sharded logits only: output heads."""
    outputs = set(profile.output_nodes)
    return [op for op in profile.ops if is_weight_linear(op) and op.node not in role
            and _logits_path(op.node, ops, consumers, outputs)[:2] == (True, None)]


def _explain_heads(profile: ModelProfile, ops, consumers, whole: dict[str, LeftWhole], reason: str) -> None:
    """The output heads stay whole for `reason`."""
    for op in _output_heads(profile, ops, consumers, {}):
        whole[op.node] = LeftWhole((op.module,), op.op, op.module, reason + _head_cost(op, profile.batch_size))


def _head_cost(op: OpProfile, batch: int) -> str:
    """What a head left whole costs each tensor-parallel rank, as a clause."""
    vocabulary, hidden = out_in_features(op)
    flops = (op.flops_fwd + op.flops_bwd) / max(batch, 1)
    return (f"; each tensor-parallel rank then holds all {vocabulary} x {hidden} head weights and computes all "
            f"{vocabulary} logits ({flops / 1e6:.3g} MFLOP per sample forward and backward), where a vocabulary-"
            f"parallel head computes 1/tp of them")


def _explain_in_model_losses(profile: ModelProfile, ops, consumers, role: dict[str, str],
                             whole: dict[str, LeftWhole]) -> None:
    """A Linear whose logits reach a model output or a loss only through an op loss_parallel cannot compute on
    vocabulary-sharded logits (a loss inside forward with a z-loss, say): why it is no vocabulary-parallel head."""
    outputs = set(profile.output_nodes)
    for op in profile.ops:
        if not is_weight_linear(op) or op.node in role:
            continue
        reaches, blocker, loss = _logits_path(op.node, ops, consumers, outputs)
        if reaches and blocker is not None:
            goal = "the loss it computes inside forward" if loss else "the model's output"
            whole[op.node] = LeftWhole((op.module,), blocker.op, blocker.module, (
                f"its logits pass through {blocker.op} on the way to {goal}, which torch's loss_parallel cannot "
                "compute on logits sharded on the vocabulary, so the head is not vocabulary-parallel"
                + _head_cost(op, profile.batch_size)))


def _vocab_parallel(profile: ModelProfile, ops, consumers, role: dict[str, str],
                    whole: dict[str, LeftWhole]) -> list[DivisibilityFact]:
    """Mark the output head and the word embedding; returns their vocabulary sizes as facts. A head whose
    vocabulary is no multiple of VOCAB_MULTIPLE is left whole (`whole` says so)."""
    facts = []
    heads = _output_heads(profile, ops, consumers, role)
    head_weights = set()
    for op in heads:
        vocabulary = op.input_shapes[1][0]
        if vocabulary % VOCAB_MULTIPLE:
            whole[op.node] = LeftWhole((op.module,), op.op, op.module, (
                f"its vocabulary of {vocabulary} is no multiple of {VOCAB_MULTIPLE}: torch's tensor parallelism "
                "cannot pad it as Megatron-LM does, so the head is not vocabulary-parallel"
                + _head_cost(op, profile.batch_size)))
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


def _logits_path(node: str, ops, consumers, outputs: set[str]) -> tuple[bool, OpProfile | None, bool]:
    """Whether the Linear's output reaches a model output or a loss (LOSS_OPS) before any other weight Linear; the
    first op on the way that is neither a shape op nor one torch's loss_parallel computes on vocabulary-sharded
    logits (None when there is none); and whether it reaches a loss computed inside the model."""
    seen, frontier, blocker, reaches, loss = set(), [node], None, False, False
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        reaches |= n in outputs
        for c in consumers[n]:
            op = ops[c]
            if is_weight_linear(op):
                return False, None, False
            name = packet(op)
            if name in LOSS_OPS:
                reaches = loss = True
                continue  # the loss: what follows it (a mean, a scale) no longer has the vocabulary
            if name not in SHAPE_OPS and name not in LOSS_PARALLEL_OPS and blocker is None:
                blocker = op
            frontier.append(c)
    return reaches, blocker, loss


_LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


def _pattern(text: str) -> str:
    """A name with its layer indices as "*" ("model.layers.3.mlp" -> "model.layers.*.mlp"): one line per kind of
    block, not per layer."""
    return _LAYER_INDEX.sub("*", text)


def split_lines(plan: dict[str, str]) -> list[str]:
    """The tensor-parallel plan as lines, one per style and kind of module: "colwise: model.layers.*.mlp.up_proj
    (32), lm_head"."""
    lines = []
    for style in ("colwise", "rowwise", "replicate"):
        counts: dict[str, int] = {}
        for fqn, s in plan.items():
            if s == style:
                counts[_pattern(fqn)] = counts.get(_pattern(fqn), 0) + 1
        if counts:
            lines.append(f"{style}: " + ", ".join(f"{p} ({n})" if n > 1 else p for p, n in counts.items()))
    return lines


def left_whole_lines(blocks: tuple[LeftWhole, ...]) -> list[str]:
    """The Linears left whole as lines, one per kind of block with how many: "model.layers.*.attn.c_attn (12x)
    left whole: aten.split.Tensor in model.layers.*.attn: it cuts a fused projection ..."."""
    counts: dict[str, int] = {}
    for b in blocks:
        line = _pattern(b.line())
        counts[line] = counts.get(line, 0) + 1
    return [line if n == 1 else line.replace(" left whole:", f" ({n}x) left whole:", 1) for line, n in counts.items()]
