"""cost.context_parallel: ring attention as torch's ring runs it (rotate by all-gather, fp32 merges and gradients,
causal load balancing), against its closed form: compute-bound (only the last gradient block and the per-step work
show), link-bound (the gather hides behind step 0 only), short chunks (per-step launches and merges that no exchange
hides), the ring's buffers, and nothing at cp=1."""

import pytest

from autoplan.cost.comm import Group
from autoplan.cost.context_parallel import (BACKWARD_QUERY_PASSES, BACKWARD_STEP_KERNELS, BACKWARD_STEP_PASSES,
                                            FORWARD_MERGE_PASSES, FORWARD_STEP_KERNELS, GRADIENT_BYTES, OUTPUT_BYTES,
                                            StepCosts, ring_attention_cost, ring_step_work_s)
from autoplan.hardware.types import Link

LINK = Link("nvlink", bus_bandwidth_bytes_per_s=400e9, latency_s=10e-6, source="test")
BATCH, SEQ, KV, BYTES = 1, 131072, 1024, 2  # a Llama-3-8B layer (8 kv heads x 128) at 128K tokens
STEP = StepCosts(kernel_overhead_s=5e-6, bytes_per_s=2e12)


def send(nbytes):
    return 10e-6 + nbytes / 400e9


def gather(nbytes, ranks):
    """All-gather producing nbytes on every rank: (ranks - 1) / ranks of it crosses the link."""
    return 10e-6 + nbytes * (ranks - 1) / ranks / 400e9


def test_a_compute_bound_ring_exposes_only_the_last_gradient_block():
    cost = ring_attention_cost(BATCH, SEQ, KV, BYTES, attention_forward_s=1.0, attention_backward_s=2.5,
                               group=Group(8, LINK))
    block = 2 * BATCH * SEQ / 8 * KV * BYTES
    assert cost.block_bytes == block
    assert cost.forward_exposed_s == 0.0
    assert cost.backward_exposed_s == pytest.approx(send(block / BYTES * GRADIENT_BYTES))
    assert cost.traffic_bytes == 7 * 2 * block + 8 * block / BYTES * GRADIENT_BYTES


def test_the_keys_and_values_are_gathered_once_and_hide_behind_the_first_step_only():
    """torch's default rotate method all-gathers the whole sequence's K,V before step 0 and waits at step 1: a
    gather of cp blocks hides behind 1/cp of the attention, not each block behind its own step."""
    forward, backward = 4e-4, 8e-4
    cost = ring_attention_cost(BATCH, SEQ, KV, BYTES, forward, backward, Group(4, LINK))
    block = 2 * BATCH * SEQ / 4 * KV * BYTES
    gradient = block / BYTES * GRADIENT_BYTES
    assert gather(4 * block, 4) > forward / 4  # link-bound at this size: the gather shows
    assert cost.forward_exposed_s == pytest.approx(gather(4 * block, 4) - forward / 4)
    assert cost.backward_exposed_s == pytest.approx(gather(4 * block, 4) - backward / 4
                                                    + 3 * max(0.0, send(gradient) - backward / 4) + send(gradient))
    # per block, a 1/4-of-the-attention step would have hidden each send (the old ring price): the gather does not
    assert send(block) - forward / 4 < gather(4 * block, 4) - forward / 4


def test_each_step_pays_its_merges_and_launches_which_short_chunks_cannot_hide():
    """The per-step work runs on the compute stream: (cp - 1) merging forward steps, cp accumulating backward steps,
    each its fp32 passes and kernel launches; the attention kernel launches once per step (cp - 1 more than the
    rank's table counts). At 1024 tokens a step's launches dominate its merge traffic."""
    seq, cp = 2048, 2
    tokens = BATCH * seq / cp
    out32, block = tokens * KV * OUTPUT_BYTES, 2 * tokens * KV * BYTES
    grad32 = 2 * tokens * KV * GRADIENT_BYTES
    forward_work, backward_work = ring_step_work_s(BATCH, seq, KV, BYTES, cp, STEP)
    assert forward_work == pytest.approx((cp - 1) * ((FORWARD_MERGE_PASSES * out32 + 2 * block) / 2e12
                                                     + FORWARD_STEP_KERNELS * 5e-6))
    assert backward_work == pytest.approx(cp * ((BACKWARD_STEP_PASSES * grad32 + BACKWARD_QUERY_PASSES * out32
                                                 + 2 * block) / 2e12 + BACKWARD_STEP_KERNELS * 5e-6))
    free = ring_attention_cost(BATCH, seq, KV, BYTES, 1.0, 2.0, Group(cp, LINK))
    priced = ring_attention_cost(BATCH, seq, KV, BYTES, 1.0, 2.0, Group(cp, LINK), STEP)
    assert priced.forward_exposed_s - free.forward_exposed_s == pytest.approx(forward_work + (cp - 1) * 5e-6)
    assert priced.backward_exposed_s - free.backward_exposed_s == pytest.approx(backward_work + (cp - 1) * 5e-6)
    assert FORWARD_STEP_KERNELS * 5e-6 > FORWARD_MERGE_PASSES * out32 / 2e12  # launch-bound at short chunks


def test_the_ring_holds_the_gathered_sequence_and_fp32_gradients_while_it_runs():
    cost = ring_attention_cost(BATCH, SEQ, KV, BYTES, 1.0, 2.0, Group(8, LINK))
    block = 2 * BATCH * SEQ / 8 * KV * BYTES
    query32 = BATCH * SEQ / 8 * KV * GRADIENT_BYTES
    assert cost.working_bytes == pytest.approx(8 * block + query32 + 3 * block / BYTES * GRADIENT_BYTES)


def test_one_rank_has_no_ring():
    cost = ring_attention_cost(BATCH, SEQ, KV, BYTES, 1.0, 2.0, Group(1, LINK), STEP)
    assert (cost.forward_exposed_s, cost.backward_exposed_s, cost.traffic_bytes, cost.working_bytes) == (0, 0, 0, 0)
