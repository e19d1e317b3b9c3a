"""cost.context_parallel: ring attention's exposed time against its closed form, compute-bound (only the
last gradient block shows) and link-bound, and nothing at cp=1."""

import pytest

from autoplan.cost.comm import Group
from autoplan.cost.context_parallel import GRADIENT_BYTES, ring_attention_cost
from autoplan.hardware.types import Link

LINK = Link("nvlink", bus_bandwidth_bytes_per_s=400e9, latency_s=10e-6, source="test")
BATCH, SEQ, KV, BYTES = 1, 131072, 1024, 2  # a Llama-3-8B layer (8 kv heads x 128) at 128K tokens


def send(nbytes):
    return 10e-6 + nbytes / 400e9


def test_a_compute_bound_ring_exposes_only_the_last_gradient_block():
    cost = ring_attention_cost(BATCH, SEQ, KV, BYTES, attention_forward_s=1.0, attention_backward_s=2.5,
                               group=Group(8, LINK))
    block = 2 * BATCH * SEQ / 8 * KV * BYTES
    assert cost.block_bytes == block
    assert cost.forward_exposed_s == 0.0
    assert cost.backward_exposed_s == pytest.approx(send(block / BYTES * GRADIENT_BYTES))
    assert cost.traffic_bytes == 7 * 2 * block + 8 * block / BYTES * GRADIENT_BYTES


def test_a_link_bound_ring_exposes_what_each_send_takes_beyond_its_step():
    forward, backward = 1e-5, 2e-5  # attention far faster than the link
    cost = ring_attention_cost(BATCH, SEQ, KV, BYTES, forward, backward, Group(4, LINK))
    block = 2 * BATCH * SEQ / 4 * KV * BYTES
    gradient = block / BYTES * GRADIENT_BYTES
    assert cost.forward_exposed_s == pytest.approx(3 * (send(block) - forward / 4))
    assert cost.backward_exposed_s == pytest.approx(3 * (send(block) + send(gradient) - backward / 4) + send(gradient))


def test_one_rank_has_no_ring():
    cost = ring_attention_cost(BATCH, SEQ, KV, BYTES, 1.0, 2.0, Group(1, LINK))
    assert (cost.forward_exposed_s, cost.backward_exposed_s, cost.traffic_bytes) == (0.0, 0.0, 0.0)
