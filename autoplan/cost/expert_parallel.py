"""What expert parallelism costs one rank, per expert layer and micro-batch (torch-free), as
runtime/distributed/expert_parallel.py runs it:

- Traffic: every (token, slot) row goes to its expert's rank and comes back, an all-to-all each way in
  the forward and again in the backward (the gradients retrace the route): 4 all-to-alls of
  rows x features x bytes. Of a rank's rows, (ep-1)/ep leave it when the router spreads them evenly (the
  all-to-all's bus factor), so one all-to-all takes alpha + rows x features x bytes x (ep-1)/ep / busbw.
  The next op needs its result (the experts need their rows, the combine needs the outputs), so nothing
  hides it. The all-to-all ends when the busiest rank has received its rows (dispatch) or sent them back
  (combine), so its bytes are those of the busiest rank: the mean's times the imbalance below.
- Load imbalance: the layer waits for the rank with the most rows. A router spreading n rows over ep
  ranks uniformly at random gives the ranks multinomial counts (mean n/ep), which for large n are
  n/ep + sqrt(n/ep) (Z_r - mean of the Z) for ep independent standard normals Z_r (the counts sum to n); the
  busiest rank lies E[max of ep standard normals] x sqrt(n/ep) rows above the mean (expected_normal_maximum:
  0.56 for 2 ranks, 1.42 for 8, 2.0 for 32). A token's k rows go to k distinct experts of E, so the rows a rank
  gets of one token are hypergeometric, not binomial: the variance shrinks by (E - k) / (E - 1). The busiest
  rank holds 1 + E[max] sqrt(ep (E - k) / ((E - 1) n)) times the mean (router_imbalance).
  A router that prefers some experts is worse: a measured ratio replaces this one when there is one
  (measured_imbalance: the rows `autoplan profile --measure` counted per expert, grouped as the ranks hold
  the experts).
- The route around the all-to-alls (runtime/distributed/expert_parallel.py _route), which the captured experts module does not
  hold (it runs only when ep > 1): in the forward, the gather of each row's token into destination order, the
  multiply of the returned rows by their router weights and the index_add that sums them per token, each a
  read and a write of rows x features x bytes (ROUTE_FORWARD_PASSES); in the backward, the index_add's gather of
  the output gradient, the multiply's two gradients (rows x weights, and the weights' gradient reading the rows
  and the gradient) and the gather's scatter-add back onto the tokens (ROUTE_BACKWARD_PASSES); each at the
  device's streaming bandwidth (Gpu.memory_bandwidth_bytes_per_s x memory_efficiency). Before the rows move,
  the forward exchanges the row counts (one all-to-all of ep integers: latency) and then the expert ids (rows x 8
  bytes), and reads both counts back to the host (`.tolist()`, ROUTE_HOST_SYNCS): each sync drains the GPU's
  queue, which then waits for the next kernel's launch (Gpu.kernel_overhead_s).
- Memory: a rank holds E/ep of the experts' weights, gradients and optimizer states; every other
  parameter stays data-parallel. Under selective recompute the program keeps the outputs of the route's
  all-to-alls (runtime/distributed/recompute.py saved_ops, torchtitan's save list): the rows and expert ids the rank
  received (the busiest rank's: the mean's times the imbalance) and its own rows back from the experts, per
  expert layer and micro-batch (ExpertParallelCost.selective_kept_bytes); its recomputation then runs the
  route's permutation passes and host syncs again but no exchange (route_recompute_s).
- Expert parallelism is folded over dp_shard x cp x tp (layout.expert_folded_ranks): the ep group is the
  innermost ep of those ranks (stride 1, over the tp ranks first), the experts stay whole (ETP 1), and each tp
  rank routes its own 1/tp of the tokens, sequence parallelism or not (rows and expert compute / tp; cost/context.py
  expert_shard_degree for the states).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from autoplan.chain.experts import ExpertLayer
from autoplan.cost.comm import Group, all_to_all_s
from autoplan.hardware.types import Gpu

ALL_TO_ALLS_PER_LAYER = 4
"""Dispatch and combine in the forward, and both again in the backward."""

ROUTE_FORWARD_PASSES = 6
"""Bytes the route's forward moves around the all-to-alls per byte of its rows (rows x features x element): the
gather into destination order, the router-weight multiply and the per-token index_add, each one read and one
write."""

ROUTE_BACKWARD_PASSES = 8
"""The same for its backward: the index_add's gather (2), the multiply's input gradient (2) and its weights'
gradient reading the rows and the gradient (2), the gather's scatter-add (2)."""

ROUTE_HOST_SYNCS = 2
"""Host reads of the row counts per forward (the counts sent and those received, `.tolist()`)."""

ID_BYTES = 8
"""Bytes per row of the expert ids sent with the rows (int64)."""


@dataclass(frozen=True)
class ExpertParallelCost:
    """One expert layer on one rank, per micro-batch."""

    rows: float
    """(token, slot) rows this rank routes (tokens x k)."""
    all_to_all_s: float
    """Time of the four all-to-alls, seconds (exposed: the next op waits for each)."""
    imbalance: float
    """The busiest rank's expert rows over the mean (>= 1): the experts' compute time is multiplied by it."""
    expert_parameter_numel: float
    """Expert parameter elements this rank holds (E/ep experts)."""
    route_forward_s: float = 0.0
    """The route's forward beyond the rows' all-to-alls: the counts and ids all-to-alls, its host syncs and its
    permutation passes (exposed: the experts wait for them), seconds."""
    route_backward_s: float = 0.0
    """The route's backward permutation passes, seconds."""
    route_recompute_s: float = 0.0
    """What selective recompute runs of the route again: its forward's host syncs and permutation passes, not its
    exchanges (their outputs are kept), seconds."""
    selective_kept_bytes: float = 0.0
    """What selective recompute keeps of the route: its all-to-alls' outputs (the rows and ids received, at the
    busiest rank's count, and the rank's own rows back), bytes per micro-batch."""


QUADRATURE_POINTS = 4001
"""Points of the Simpson rule over [-10, 10] for expected_normal_maximum (its error is below 1e-9)."""


@lru_cache(maxsize=None)
def expected_normal_maximum(n: int) -> float:
    """E[max of n independent standard normals]: the integral of x n phi(x) Phi(x)^(n-1) (0 for n = 1)."""
    if n <= 1:
        return 0.0
    lo, hi, points = -10.0, 10.0, QUADRATURE_POINTS
    step = (hi - lo) / (points - 1)
    total = 0.0
    for i in range(points):
        x = lo + i * step
        density = n * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (0.5 * math.erfc(-x / math.sqrt(2))) ** (n - 1)
        weight = 1 if i in (0, points - 1) else (4 if i % 2 else 2)
        total += weight * x * density
    return total * step / 3


def router_imbalance(rows: float, degree: int, experts: int = 0, top_k: int = 1) -> float:
    """The busiest of `degree` ranks' rows over the mean when `rows` rows are spread uniformly at random, each
    token's `top_k` rows over distinct experts of `experts` (0: rows independent) split evenly over the ranks
    (the module docstring; 1 for one rank)."""
    if degree <= 1 or rows <= 0:
        return 1.0
    distinct = (experts - top_k) / (experts - 1) if experts > 1 and top_k > 1 else 1.0
    return 1.0 + expected_normal_maximum(degree) * math.sqrt(degree * distinct / rows)


def measured_imbalance(rows_per_expert: Sequence[int], degree: int) -> float | None:
    """The busiest of `degree` ranks' rows over the mean when rank r holds experts r*E/degree .. (r+1)*E/degree - 1
    (runtime/distributed/expert_parallel.py) and the router sends each expert the measured rows (ModelProfile.router_loads);
    None without a measurement or when `degree` does not split the experts evenly."""
    experts = len(rows_per_expert)
    total = sum(rows_per_expert)
    if degree <= 1 or not experts or experts % degree or total <= 0:
        return None
    share = experts // degree
    busiest = max(sum(rows_per_expert[r * share:(r + 1) * share]) for r in range(degree))
    return busiest * degree / total


def route_s(rows: float, features: int, bytes_per_element: float, group: Group, gpu: Gpu) -> tuple[float, float]:
    """(forward, backward) seconds of the route around the rows' all-to-alls for `rows` (token, slot) rows of
    `features` elements on one rank of `group` (the module docstring; 0 for one rank)."""
    if group.size <= 1 or rows <= 0:
        return 0.0, 0.0
    row_bytes = rows * features * bytes_per_element
    stream = gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency
    counts = all_to_all_s(group.size * ID_BYTES, group.size, group.link, group.nodes)
    ids = all_to_all_s(rows * ID_BYTES, group.size, group.link, group.nodes)
    forward = counts + ids + route_recompute_s(rows, features, bytes_per_element, group, gpu)
    return forward, ROUTE_BACKWARD_PASSES * row_bytes / stream


def route_recompute_s(rows: float, features: int, bytes_per_element: float, group: Group, gpu: Gpu) -> float:
    """Seconds of the route's forward without its exchanges (its host syncs and permutation passes): what
    selective recompute runs of it again (0 for one rank)."""
    if group.size <= 1 or rows <= 0:
        return 0.0
    stream = gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency
    return ROUTE_HOST_SYNCS * gpu.kernel_overhead_s + ROUTE_FORWARD_PASSES * rows * features * bytes_per_element / stream


def selective_kept_bytes(rows: float, features: int, bytes_per_element: float, imbalance: float,
                         degree: int) -> float:
    """Bytes selective recompute keeps of the route of `rows` (token, slot) rows on one rank of `degree` (the
    module docstring): the rows and ids the busiest rank receives (rows x imbalance), its own rows back, and the
    row counts exchanged first (0 for one rank)."""
    if degree <= 1 or rows <= 0:
        return 0.0
    received = rows * imbalance
    return received * (features * bytes_per_element + ID_BYTES) + rows * features * bytes_per_element \
        + degree * ID_BYTES


def expert_parallel_cost(layer: ExpertLayer, tokens_per_microbatch: float, bytes_per_element: float,
                         group: Group, measured_imbalance: float | None = None,
                         gpu: Gpu | None = None) -> ExpertParallelCost:
    """The cost of `layer` on one rank of the expert-parallel `group` for a micro-batch of
    `tokens_per_microbatch` tokens on that rank (measured_imbalance: the router's ratio from a profile
    measurement, replacing the uniform one; `gpu`: the device the route's passes run on, none priced without)."""
    rows = tokens_per_microbatch * layer.top_k
    degree = group.size
    if degree <= 1:
        return ExpertParallelCost(rows, 0.0, 1.0, float(layer.parameter_numel))
    if measured_imbalance is None:
        imbalance = router_imbalance(rows * degree, degree, layer.num_experts, layer.top_k)
    else:
        imbalance = max(1.0, measured_imbalance)
    one = all_to_all_s(rows * imbalance * layer.hidden * bytes_per_element, degree, group.link, group.nodes)
    forward, backward = route_s(rows, layer.hidden, bytes_per_element, group, gpu) if gpu else (0.0, 0.0)
    recompute = route_recompute_s(rows, layer.hidden, bytes_per_element, group, gpu) if gpu else 0.0
    return ExpertParallelCost(rows, ALL_TO_ALLS_PER_LAYER * one, imbalance,
                              layer.parameter_numel / degree, forward, backward, recompute,
                              selective_kept_bytes(rows, layer.hidden, bytes_per_element, imbalance, degree))
