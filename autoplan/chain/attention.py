"""The model's attention calls in the captured graph (torch-free): what context parallelism splits.

torch's context parallelism (`context_parallel`, runtime/context_parallel.py) replaces each
`scaled_dot_product_attention` call by a ring over the ranks' sequence shards; every other op runs token by
token on the rank's shard. So a model can run with cp > 1 when every op that computes attention (chain/ops.py
kind "attention") is an SDPA kernel: attention written as activation x activation matmuls, a softmax between
them, would see only its shard's keys. A mask argument in the capture is the model's causal mask (transformers
builds it under tracing and passes is_causal at run time); the runtime refuses any other. Under the ring the
kernel keeps what a flash kernel keeps for backward, its queries, keys and values, output and logsumexp
(AttentionCall.ring_saved_bytes), never the (seq x seq) attention weights a masked call on the capture's math path
saves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoplan.chain.ops import cost_kind, packet
from autoplan.profile.types import ModelProfile

SDPA_PACKETS = frozenset({
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
})
"""aten ops of F.scaled_dot_product_attention (the call, or the kernel it dispatched to)."""
LOGSUMEXP_BYTES = 4
"""The flash kernels' logsumexp: fp32."""


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
    """Bytes per sample the captured call keeps for backward beyond what earlier ops keep (capture dtype)."""
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


def attention_facts(profile: ModelProfile) -> AttentionFacts:
    calls, other = [], None
    for op in profile.ops:
        if cost_kind(op) != "attention":
            continue
        shapes = op.input_shapes
        if packet(op) in SDPA_PACKETS and len(shapes) >= 3 and len(shapes[0]) == 4 and len(shapes[1]) == 4:
            batch, heads, seq = shapes[0][0], shapes[0][1], shapes[0][2]
            masked = len(shapes) > 3 and len(op.inputs) > 3 and len(shapes[3]) >= 2
            calls.append(AttentionCall(
                op.node, op.module, seq, shapes[1][1] * shapes[1][3], saved_bytes=op.saved_bytes / batch,
                ring_saved_bytes=ring_saved_bytes(op.saved_bytes, op.output_bytes, shapes[:3],
                                                  batch * heads * seq * LOGSUMEXP_BYTES) / batch,
                mask=op.inputs[3] if masked else ""))
        elif other is None:
            other = op
    if other is not None:
        problem = (f"its attention is computed by {other.op} in '{other.module}' (activation x activation "
                   f"matmuls), not scaled_dot_product_attention, which context parallelism's ring replaces")
    elif not calls:
        problem = "the model calls no scaled_dot_product_attention for a ring to split the sequence of"
    else:
        problem = profile.sequence_targets_problem
    return AttentionFacts(tuple(calls), problem)

