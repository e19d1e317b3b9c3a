"""What context parallelism's ring attention costs one rank, per attention layer and micro-batch
(torch-free), as torch's ring (torch.distributed.tensor.experimental._context_parallel, which
runtime/distributed/context_parallel.py runs with its defaults: rotate_method all-gather, convert_to_f32, causal load
balancing) runs it on cp sequence shards:

- Forward: cp steps. The keys and values of the whole sequence are all-gathered once (2 x batch x seq x kv
  features x bytes), issued before step 0 and waited for at step 1, so the gather hides only behind step 0's
  attention: it exposes max(0, gather - step). Every step is one attention kernel on the rank's queries and one
  rank's block of keys and values; with causal load balancing (the head-tail order) each step does 1/cp of the
  rank's attention. Each step after the first merges its partial output into the running one in fp32
  (FORWARD_MERGE_PASSES passes over the rank's output, FORWARD_STEP_KERNELS kernels, the concatenation of its
  K and V for the next exchange): memory-bound work on the compute stream that nothing hides, and kernel launches
  a short chunk cannot amortize.
- Backward: the keys and values are all-gathered again (exposed beyond step 0's attention backward); each step's
  key and value gradients (fp32, convert_to_f32) go to the next rank (a point-to-point permute), waited for after
  the next step's attention backward, so each hides behind one step; the last comes home after the loop, exposed.
  Each step accumulates the gradients in fp32 (BACKWARD_STEP_PASSES passes over a gradient block,
  BACKWARD_QUERY_PASSES over the rank's fp32 query gradient, BACKWARD_STEP_KERNELS kernels).
- Memory beyond the captured attention, while a layer's attention runs (the module's working set): the gathered
  keys and values of the whole sequence; in backward also the fp32 query, key and value gradient accumulators and
  the fp32 gradient blocks in flight (sent and received).
- Everything else in the model runs on seq/cp tokens per rank (cost/compute.py sharded_table, priced at the rank's
  tokens: its kernels launch whole), and gradients are averaged over the cp ranks with the data-parallel ones (the
  evaluation's part). With a pipeline, the activations the stages send each other are the rank's seq/cp share from
  the first module calling attention on, and the whole sequence before it (cost/context.py rank_cut_bytes).
- With tensor parallelism each tp rank rings its own heads (kv features / tp when the attention is split), over
  the cp ranks of its tp index. With sequence parallelism too, the block where the shares start takes its input
  split over the tp ranks: it is all-gathered over them once per micro-batch to cut the cp share (the whole
  sequence, forward) and the share's gradient once (seq/cp, backward): Context._sharded_modules adds both to
  that block's ring time.
A ring traced into a torch.compile graph (`traced`: the attention runs in a compiled module) hides nothing: under
tracing a functional collective is waited where it is issued (torch.distributed._functional_collectives.
_maybe_wrap_tensor returns wait_tensor(...) when _are_we_tracing(), instead of the AsyncCollectiveTensor eager waits on
at first use), and Inductor moves a wait away from its collective only with reorder_for_compute_comm_overlap, off by
default (the Dec 2024 nightly and 2.13). Inductor's code for a compiled module running torch's ring (torch 2.13, CPU,
2 ranks) issues all_gather_into_tensor, waits on it, then runs step 0's attention; in the backward each step's
all_to_all_single and its wait run back to back, and no all-gather runs: the joint graph's CSE merged the backward's
gather of the keys and values with the forward's, whose result the backward reads (recomputed with the forward under
full recompute). So the forward's gather and every step's gradient send are exposed whole, the backward gathers
nothing, and without recompute the gathered keys and values are kept from the forward to the backward (the output
code returns the gather's buffer among the saved tensors: RingAttentionCost.kept_bytes). torchtitan 9dec370 (Dec 2024)
ran torch's ring so: each TransformerBlock torch.compile'd (fullgraph) with the patched scaled_dot_product_attention
inside it. Context prices the ring traced where the modules are compiled (compile=on) and where a published run
compiled them on a layout autoplan prices eager (autoplan.estimate ring_traced, priced only: benchmarks/accuracy.py);
docs/parallelism.md.
The queries are taken to have the keys' features (kv_features: grouped-query keys arrive repeated to the query
heads in the models captured so far).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cost.comm import Group, all_gather_s, p2p_s

GRADIENT_BYTES = 4
"""Bytes per element of the key/value/query gradients the backward ring accumulates and carries
(_cp_options.convert_to_f32: fp32)."""
OUTPUT_BYTES = 4
"""Bytes per element of the running output the forward merges into (fp32, convert_to_f32)."""
FORWARD_MERGE_PASSES = 9
"""fp32 passes over the rank's output per merging step (_SDPAMerger._merge_one): the block's output cast to fp32
(1 write), out - block_out (2 reads, 1 write), the sigmoid-weighted product (1 read, 1 write) and its subtraction
from out (2 reads, 1 write)."""
FORWARD_STEP_KERNELS = 8
"""Kernels per forward step beyond the attention: the cast, the merge's elementwise ops (sigmoid, logsigmoid, two
subtractions, a product) and the K,V concatenation for the exchange."""
BACKWARD_STEP_PASSES = 5
"""fp32 passes over a key+value gradient block per backward step: the accumulation (read the fp32 sum and the
step's gradient, write the sum: 2.5) and the concatenation of dK,dV for the send (read, write: 2), and the received
block's reshape views (0.5 for its partial update's read of one half)."""
BACKWARD_QUERY_PASSES = 2.5
"""fp32 passes over the rank's query gradient per backward step (grad_query += the step's, in fp32)."""
BACKWARD_STEP_KERNELS = 6
"""Kernels per backward step beyond the attention backward: two accumulations, two concatenations, the query
gradient's accumulation and the K,V concatenation for the exchange."""


@dataclass(frozen=True)
class StepCosts:
    """What a ring step's own work runs at: one kernel launch, seconds; streaming bytes per second."""

    kernel_overhead_s: float
    bytes_per_s: float


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
    """Bytes this rank receives in the forward and backward (for reports)."""
    working_bytes: float = 0.0
    """The ring's buffers beyond the captured attention while the layer's attention runs (the larger of forward and
    backward), bytes."""
    kept_bytes: float = 0.0
    """What the forward keeps for the backward beyond the captured attention, bytes: a traced ring's gathered keys and
    values (the backward reads them: 0 eager, whose backward gathers again)."""


@dataclass(frozen=True)
class KeyValues:
    """The keys and values one attention layer's ring exchanges: `batch` sequences of `seq_len` tokens (whole), of
    `kv_features` features (kv heads x head dim) at `bytes_per_element`."""

    batch: float
    seq_len: int
    kv_features: float
    bytes_per_element: float


def ring_step_work_s(kv: KeyValues, cp: int, step: StepCosts) -> tuple[float, float]:
    """(forward, backward) seconds of the ring's own per-step work on the compute stream over all cp steps: the
    merges and accumulations in fp32 and their kernel launches (steps after the first merge; every step
    accumulates)."""
    tokens = kv.batch * kv.seq_len / cp
    block_fp32 = 2 * tokens * kv.kv_features * GRADIENT_BYTES
    out_fp32 = tokens * kv.kv_features * OUTPUT_BYTES
    block = 2 * tokens * kv.kv_features * kv.bytes_per_element
    forward_step = (FORWARD_MERGE_PASSES * out_fp32 + 2 * block) / step.bytes_per_s \
        + FORWARD_STEP_KERNELS * step.kernel_overhead_s
    backward_step = (BACKWARD_STEP_PASSES * block_fp32 + BACKWARD_QUERY_PASSES * out_fp32 + 2 * block) \
        / step.bytes_per_s + BACKWARD_STEP_KERNELS * step.kernel_overhead_s
    return (cp - 1) * forward_step, cp * backward_step


def ring_attention_cost(kv: KeyValues, attention_forward_s: float, attention_backward_s: float, group: Group,
                        step: StepCosts | None = None, traced: bool = False) -> RingAttentionCost:
    """The ring's cost for the keys and values `kv` split over `group` (cp ranks); attention_*_s: this rank's
    attention compute of the layer under context parallelism (1/cp of the whole, load-balanced, one launch); `step`:
    what the per-step merges run at (None: free, the exchange alone); `traced`: the ring traced into a torch.compile
    graph, every exchange waited where it is issued, none hidden behind an attention step (the module docstring)."""
    batch, seq_len, kv_features, bytes_per_element = kv.batch, kv.seq_len, kv.kv_features, kv.bytes_per_element
    cp = group.size
    block = 2 * batch * seq_len / cp * kv_features * bytes_per_element
    if cp <= 1:
        return RingAttentionCost(block, 0.0, 0.0, 0.0)
    gradient_block = block / bytes_per_element * GRADIENT_BYTES
    gather = all_gather_s(cp * block, cp, group.link, group.nodes)
    send_gradient = p2p_s(gradient_block, group.link)
    forward_step, backward_step = attention_forward_s / cp, attention_backward_s / cp
    work = ring_step_work_s(kv, cp, step) if step else (0.0, 0.0)
    launches = (cp - 1) * step.kernel_overhead_s if step else 0.0  # the attention kernel once per step, not once
    if traced:  # every exchange waited where issued; the backward reads the forward's (or its recompute's) gather
        forward = gather + work[0] + launches
        backward = cp * send_gradient + work[1] + launches
    else:
        forward = max(0.0, gather - forward_step) + work[0] + launches
        backward = (max(0.0, gather - backward_step) + (cp - 1) * max(0.0, send_gradient - backward_step)
                    + send_gradient + work[1] + launches)
    traffic = 2 * (cp - 1) * block + cp * gradient_block
    query_fp32 = batch * seq_len / cp * kv_features * GRADIENT_BYTES
    working = cp * block + query_fp32 + 3 * gradient_block  # backward's: forward holds the gathered K,V alone
    return RingAttentionCost(block, forward, backward, traffic, working, kept_bytes=cp * block if traced else 0.0)
