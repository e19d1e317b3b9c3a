"""cost.parameter_server: push and pull against the closed form; with as many server links as workers it
moves what a ring all-reduce moves, with fewer it is N/S times the server load."""

import pytest

from autoplan.cost.comm import all_reduce_s
from autoplan.cost.parameter_server import parameter_server_cost
from autoplan.hardware.types import AlphaBeta, Link

GB = 1e9


def test_few_servers_are_the_bottleneck_and_the_arithmetic_says_so():
    cost = parameter_server_cost(gradient_bytes=16 * GB, parameter_bytes=16 * GB, workers=64, servers=8,
                                 server_link=AlphaBeta(1e-4, 50 * GB), worker_link=AlphaBeta(1e-4, 50 * GB))
    assert cost.push_s == pytest.approx(1e-4 + 64 * 16 / (8 * 50))
    assert cost.pull_s == pytest.approx(1e-4 + 64 * 16 / (8 * 50))
    assert cost.bottleneck == "server links"
    assert cost.arithmetic.startswith("push 64 x 16 GB / (8 servers x 50 GB/s) = 2.56 s")


def test_as_many_server_links_as_workers_move_what_a_ring_all_reduce_moves():
    workers, nbytes, bandwidth = 64, 16 * GB, 50 * GB
    link = AlphaBeta(0.0, bandwidth)
    cost = parameter_server_cost(nbytes, nbytes, workers, workers, link, link)
    assert cost.bottleneck == "server links"  # a tie goes to the servers
    ring = all_reduce_s(nbytes, workers, Link("ib", bandwidth, 0.0, "test"))  # 2 (N-1)/N x bytes / busbw
    assert cost.step_s == pytest.approx(ring * workers / (workers - 1))
    assert parameter_server_cost(nbytes, nbytes, workers, 8, link, link).step_s == \
        pytest.approx(cost.step_s * workers / 8)


def test_one_slow_worker_link_bounds_a_well_served_job():
    cost = parameter_server_cost(1 * GB, 1 * GB, workers=2, servers=4, server_link=AlphaBeta(0.0, 100 * GB),
                                 worker_link=AlphaBeta(0.0, 10 * GB))
    assert cost.bottleneck == "worker links" and cost.step_s == pytest.approx(0.2)
    with pytest.raises(ValueError, match="at least one worker and one server"):
        parameter_server_cost(1, 1, 0, 1, AlphaBeta(0.0, 1), AlphaBeta(0.0, 1))
