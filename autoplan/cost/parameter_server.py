"""What a parameter server would cost (torch-free): the step's gradient push and parameter pull,
priced to show why autoplan runs all-reduce collectives instead (issue 21's "why not a parameter server").

Synchronous data parallelism with S dedicated server shards (each holds 1/S of the parameters) and N
workers: every worker pushes its whole gradient (G bytes) and pulls the whole updated parameters (P
bytes), 1/S of each through each server. A server shard's link carries N x G / S in and N x P / S out;
a worker's link carries G out and P in. The push waits for the slowest of the two ends, and so does the
pull:

    push = alpha + max(N x G / (S x server bandwidth), G / worker bandwidth)
    pull = alpha + max(N x P / (S x server bandwidth), P / worker bandwidth)

A ring all-reduce moves 2 (N-1)/N x G per rank whatever N is; a parameter server matches it only when
there are as many server links as workers (S = N, each server's load G + P), which is a sharded
reduce-scatter plus all-gather: what DDP's all-reduce and FSDP already run, without the server hosts.
Horovod's ring all-reduce is that same collective over NCCL; torch's DDP runs it natively.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.hardware.types import AlphaBeta


@dataclass(frozen=True)
class ParameterServerCost:
    """One training step's synchronization through a parameter server."""

    workers: int
    servers: int
    push_s: float
    """Gradients from every worker to the servers, seconds."""
    pull_s: float
    """Updated parameters from the servers to every worker, seconds."""
    bottleneck: str
    """"server links" or "worker links": which end limits the transfers."""
    arithmetic: str
    """The push and pull written out with their numbers."""

    @property
    def step_s(self) -> float:
        return self.push_s + self.pull_s


def parameter_server_cost(gradient_bytes: float, parameter_bytes: float, workers: int, servers: int,
                          server_link: AlphaBeta, worker_link: AlphaBeta) -> ParameterServerCost:
    """The push and pull of one step (module docstring) over each server's and each worker's link, alpha the
    larger of their latencies."""
    server_bandwidth_bytes_per_s = server_link.bus_bandwidth_bytes_per_s
    worker_bandwidth_bytes_per_s = worker_link.bus_bandwidth_bytes_per_s
    latency_s = max(server_link.latency_s, worker_link.latency_s)
    if workers < 1 or servers < 1:
        raise ValueError(f"a parameter server needs at least one worker and one server, got {workers} and {servers}")
    server_push = workers * gradient_bytes / (servers * server_bandwidth_bytes_per_s)
    server_pull = workers * parameter_bytes / (servers * server_bandwidth_bytes_per_s)
    worker_push = gradient_bytes / worker_bandwidth_bytes_per_s
    worker_pull = parameter_bytes / worker_bandwidth_bytes_per_s
    push = latency_s + max(server_push, worker_push)
    pull = latency_s + max(server_pull, worker_pull)
    servers_bound = server_push + server_pull >= worker_push + worker_pull
    gb = 1e9
    if servers_bound:
        shards = f"{servers} server{'s' if servers > 1 else ''}"
        arithmetic = (f"push {workers} x {gradient_bytes / gb:.3g} GB / ({shards} x "
                      f"{server_bandwidth_bytes_per_s / gb:.3g} GB/s) = {server_push:.3g} s, pull {workers} x "
                      f"{parameter_bytes / gb:.3g} GB / ({servers} x {server_bandwidth_bytes_per_s / gb:.3g} GB/s) "
                      f"= {server_pull:.3g} s")
    else:
        arithmetic = (f"push {gradient_bytes / gb:.3g} GB / {worker_bandwidth_bytes_per_s / gb:.3g} GB/s = "
                      f"{worker_push:.3g} s, pull {parameter_bytes / gb:.3g} GB / "
                      f"{worker_bandwidth_bytes_per_s / gb:.3g} GB/s = {worker_pull:.3g} s")
    return ParameterServerCost(workers, servers, push, pull, "server links" if servers_bound else "worker links",
                               arithmetic)
