"""What context parallelism's ring attention costs one rank, per attention layer and micro-batch
(torch-free), as torch's ring (runtime/context_parallel.py) runs it on cp sequence shards:

- Forward: cp steps; each attends the rank's queries to one rank's keys and values while the next
  block (K and V: 2 x batch x seq/cp x kv features x bytes) travels to it, one point-to-point send per
  step after the first. A step's transfer hides behind that step's attention, so a send exposes only
  what it takes beyond the step: (cp-1) x max(0, send - step), a step being 1/cp of the rank's attention
  (causal attention is load-balanced: every rank computes as much in every step).
- Backward: the keys and values go round again, with the gradients of the keys and values (kept in
  fp32, torch's default accumulation) travelling with them, each step's two sends hidden behind that
  step's attention backward; the last gradient block comes home after the loop, exposed.
- Everything else in the model runs on seq/cp tokens per rank (time and activations divided by cp),
  and gradients are averaged over the cp ranks with the data-parallel ones (the evaluation's part).
  With a pipeline, the activations the stages send each other are the rank's seq/cp share from the first
  module calling attention on, and the whole sequence before it (cost/context.py rank_cut_bytes).
- With tensor parallelism each tp rank rings its own heads (kv features / tp when the attention is split), over
  the cp ranks of its tp index. With sequence parallelism too, the block where the shares start takes its input
  split over the tp ranks: it is all-gathered over them once per micro-batch to cut the cp share (the whole
  sequence, forward) and the share's gradient once (seq/cp, backward): Context._sharded_modules adds both to
  that block's ring time.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cost.comm import Group, p2p_s

GRADIENT_BYTES = 4
"""Bytes per element of the key/value gradients the backward ring carries (fp32 accumulation)."""


@dataclass(frozen=True)
class RingAttentionCost:
    """One attention layer on one rank, per micro-batch."""

    block_bytes: float
    """Bytes of one K and V block (one rank's share of the sequence)."""
    forward_exposed_s: float
    """Forward time the ring adds beyond the attention compute, seconds."""
    backward_exposed_s: float
    """Backward time the ring adds beyond the attention compute, seconds."""
    traffic_bytes: float
    """Bytes this rank sends in the forward and backward (for reports)."""


def ring_attention_cost(batch: int, seq_len: int, kv_features: int, bytes_per_element: float,
                        attention_forward_s: float, attention_backward_s: float, group: Group) -> RingAttentionCost:
    """The ring's cost for `batch` sequences of `seq_len` tokens (whole) split over `group` (cp ranks), keys
    and values of `kv_features` features (kv heads x head dim); attention_*_s: this rank's attention
    compute of the layer under context parallelism (1/cp of the whole, load-balanced)."""
    cp = group.size
    block = 2 * batch * seq_len / cp * kv_features * bytes_per_element
    if cp <= 1:
        return RingAttentionCost(block, 0.0, 0.0, 0.0)
    gradient_block = block / bytes_per_element * GRADIENT_BYTES
    send, send_gradient = p2p_s(block, group.link), p2p_s(gradient_block, group.link)
    forward_step, backward_step = attention_forward_s / cp, attention_backward_s / cp
    forward = (cp - 1) * max(0.0, send - forward_step)
    backward = (cp - 1) * max(0.0, send + send_gradient - backward_step) + send_gradient
    traffic = (cp - 1) * block * 2 + cp * gradient_block
    return RingAttentionCost(block, forward, backward, traffic)
