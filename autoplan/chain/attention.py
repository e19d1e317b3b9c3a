"""The model's attention calls in the captured graph (torch-free): what context parallelism splits.

torch's context parallelism (`context_parallel`, runtime/distributed/context_parallel.py) replaces each
`scaled_dot_product_attention` call by a ring over the ranks' sequence shards; every other op runs token by
token on the rank's shard. So a model can run with cp > 1 when every op that computes attention (chain/ops.py
kind "attention") is an SDPA kernel: attention written as activation x activation matmuls, a softmax between
them, would see only its shard's keys. A mask argument in the capture is the model's causal mask (transformers
builds it under tracing and passes is_causal at run time); the runtime refuses any other. Under the ring the
kernel keeps what a flash kernel keeps for backward, its queries, keys and values, output and logsumexp
(AttentionCall.ring_saved_bytes), never the (seq x seq) attention weights a masked call on the capture's math path
saves.

Without context parallelism the same holds of the model's own call (run_time_saved_bytes) when every mask of the
capture is one transformers leaves to is_causal at run time (ModelProfile.masks_left_to_is_causal, recorded by
capture/masks.py; a sliding-window or padding mask stays): the kernel keeps its queries, keys, values, output and
logsumexp, not the mask the captured call kept, and a grouped-query model's keys and values arrive unrepeated:
transformers repeats them to the query heads only when a mask is given (integrations/sdpa_attention.py
use_gqa_in_sdpa: without a mask, and head dims of at most GQA_MAX_HEAD_DIM, it passes enable_gqa instead of
repeat_kv's expand + reshape). Measured on the
tiny Qwen3-MoE of tests/test_memory_parts.py (saved_tensors_hooks, 2 x 128 tokens, 4 query and 2 key-value heads
of 16): the call keeps 196 KiB (queries 64, keys 32, values 32, output 64, logsumexp 4) where the capture's kept
388 KiB (keys and values repeated, 64 each, and a 128 KiB float mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoplan.chain.ops import cost_kind, packet
from autoplan.profile_data import ModelProfile, OpProfile

SDPA_PACKETS = frozenset({
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
})
"""aten ops of F.scaled_dot_product_attention (the call, or the kernel it dispatched to)."""
LOGSUMEXP_BYTES = 4
"""The flash kernels' logsumexp: fp32."""
GQA_MAX_HEAD_DIM = 256
"""The largest head dim for which transformers passes grouped-query keys and values unrepeated to a maskless call
(integrations/sdpa_attention.py use_gqa_in_sdpa: larger ones fall back to repeat_kv)."""
REPEAT_PACKETS = frozenset({"expand", "reshape", "view", "_unsafe_view", "unsqueeze", "clone", "contiguous"})
"""Ops of a repeat of keys or values to the query heads (transformers' repeat_kv: unsqueeze, expand, reshape) that
run_time_saved_bytes walks back through to the unrepeated tensor."""


@dataclass(frozen=True)
class AttentionCall:
    """One SDPA call: (batch, heads, sequence, head_dim) queries, keys and values."""

    node: str
    module: str
    """FQN of the module that calls it."""
    sequence_length: int
    """Tokens per sequence (dimension 2 of the query)."""
    kv_features: int
    """Features per token of the keys (and of the values): heads x head_dim as SDPA sees them (grouped-query
    keys arrive repeated to the query heads when the model repeats them)."""
    saved_bytes: float = 0.0
    """Bytes per sample the call keeps for backward at run time beyond what earlier ops keep (capture dtype):
    run_time_saved_bytes, what the cost model prices without context parallelism."""
    ring_saved_bytes: float = 0.0
    """Bytes per sample the ring's flash kernel keeps instead: its queries, keys and values (ring_saved_bytes), the
    output and one fp32 logsumexp per query head and token (LOGSUMEXP_BYTES)."""
    mask: str = ""
    """The node of the captured call's mask argument ("" without one): the ring runs without it, so no module
    boundary carries it."""


@dataclass(frozen=True)
class AttentionFacts:
    calls: tuple[AttentionCall, ...]
    """Every SDPA call, in graph order."""
    context_parallel_problem: str
    """Why the model cannot run as a ring over sequence shards; "" when it can."""

    @property
    def sequence_length(self) -> int | None:
        """The longest sequence an SDPA call sees (None without one)."""
        return max((c.sequence_length for c in self.calls), default=None)


def ring_saved_bytes(saved: float, output: float, qkv_shapes, logsumexp: float) -> float:
    """What the ring's kernel keeps for backward, bytes (capture dtype): its output and logsumexp, and the queries,
    keys and values its backward reads again, as far as the captured call kept them itself (`saved` beyond its output
    and logsumexp; all of them when the capture's math path saved (seq x seq) weights in their place). `output`: the
    output's bytes, whose shape is the queries', which gives the element size."""
    numel = [1.0 * math.prod(shape) for shape in qkv_shapes]
    inputs = output / numel[0] * sum(numel) if numel[0] else 0.0
    return output + logsumexp + min(inputs, max(0.0, saved - output - logsumexp))


def run_time_saved_bytes(op: OpProfile, by_node: dict[str, OpProfile], maskless: bool) -> float:
    """Bytes the SDPA call `op` keeps for backward when the program runs it, for the whole profiled batch (the module
    docstring). `maskless`: every mask in the capture is one transformers leaves to is_causal at run time
    (ModelProfile.masks_left_to_is_causal); a masked call then runs without it and keeps its output, logsumexp,
    queries and, unrepeated where transformers repeated them for the mask, keys and values, as far as the captured
    call kept them itself. Otherwise (or for any other attention op) it keeps what the capture kept."""
    shapes = op.input_shapes
    masked = len(shapes) > 3 and len(op.inputs) > 3 and len(shapes[3]) >= 2
    if not (maskless and masked and packet(op) in SDPA_PACKETS and len(shapes[0]) == 4 and len(shapes[1]) == 4):
        return float(op.saved_bytes)
    batch, heads, seq, head_dim = shapes[0]
    element = op.output_bytes / math.prod(shapes[0]) if math.prod(shapes[0]) else 0.0
    numel = [float(math.prod(shapes[0]))]
    for i in (1, 2):
        whole = float(math.prod(shapes[i]))
        same_dims = shapes[1][-1] == shapes[2][-1] <= GQA_MAX_HEAD_DIM
        numel.append(_unrepeated_numel(op.inputs[i], by_node, whole) if same_dims and i < len(op.inputs) else whole)
    logsumexp = batch * heads * seq * LOGSUMEXP_BYTES
    inputs = element * sum(numel)
    return op.output_bytes + logsumexp + min(inputs, max(0.0, op.saved_bytes - op.output_bytes - logsumexp))


def _unrepeated_numel(node: str, by_node: dict[str, OpProfile], numel: float) -> float:
    """Elements of the tensor an attention input was repeated from (REPEAT_PACKETS back from `node`; `numel` when
    it was not repeated)."""
    op = by_node.get(node)
    while op is not None and packet(op) in REPEAT_PACKETS and op.input_shapes:
        numel = min(numel, float(math.prod(op.input_shapes[0])))
        op = by_node.get(op.inputs[0]) if op.inputs else None
    return numel


NO_SDPA_PROBLEM = ("the model calls no scaled_dot_product_attention, the only attention whose sequence context "
                   "parallelism's ring splits")
"""Why a model without attention (or without SDPA calls) cannot run context parallelism (layout.py adds the way
out, "(use cp=1)")."""


def attention_facts(profile: ModelProfile) -> AttentionFacts:
    calls, other = [], None
    by_node = {op.node: op for op in profile.ops}
    for op in profile.ops:
        if cost_kind(op) != "attention":
            continue
        shapes = op.input_shapes
        if packet(op) in SDPA_PACKETS and len(shapes) >= 3 and len(shapes[0]) == 4 and len(shapes[1]) == 4:
            batch, heads, seq = shapes[0][0], shapes[0][1], shapes[0][2]
            masked = len(shapes) > 3 and len(op.inputs) > 3 and len(shapes[3]) >= 2
            calls.append(AttentionCall(
                op.node, op.module, seq, shapes[1][1] * shapes[1][3],
                saved_bytes=run_time_saved_bytes(op, by_node, profile.masks_left_to_is_causal) / batch,
                ring_saved_bytes=ring_saved_bytes(op.saved_bytes, op.output_bytes, shapes[:3],
                                                  batch * heads * seq * LOGSUMEXP_BYTES) / batch,
                mask=op.inputs[3] if masked else ""))
        elif other is None:
            other = op
    dropped = next((op for op in profile.ops if packet(op) in SDPA_PACKETS and op.dropout_p > 0), None)
    masked = next((c for c in calls if c.mask), None) if not profile.masks_left_to_is_causal else None
    if other is not None:
        problem = (f"its attention is computed by {other.op} in '{other.module}' (activation x activation "
                   f"matmuls), not scaled_dot_product_attention, which context parallelism's ring replaces")
    elif dropped is not None:
        problem = (f"its attention in '{dropped.module}' applies dropout to the attention weights (dropout_p "
                   f"{dropped.dropout_p:g}), which context parallelism's ring attention does not run")
    elif masked is not None:
        problem = (f"its attention in '{masked.module}' takes a mask tensor that is not a causal mask the model leaves "
                   f"to is_causal at run time (a padding, sliding-window or custom mask), and context parallelism's "
                   f"ring attention takes is_causal or no mask")
    elif not calls:
        problem = NO_SDPA_PROBLEM
    else:
        problem = profile.sequence_targets_problem
    return AttentionFacts(tuple(calls), problem)

