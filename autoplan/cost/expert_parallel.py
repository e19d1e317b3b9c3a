"""What expert parallelism costs one rank, per expert layer and micro-batch (torch-free), as
runtime/expert_parallel.py runs it:

- Traffic: every (token, slot) row goes to its expert's rank and comes back, an all-to-all each way in
  the forward and again in the backward (the gradients retrace the route): 4 all-to-alls of
  rows x features x bytes. Of a rank's rows, (ep-1)/ep leave it when the router spreads them evenly (the
  all-to-all's bus factor), so one all-to-all takes alpha + rows x features x bytes x (ep-1)/ep / busbw.
  The next op needs its result (the experts need their rows, the combine needs the outputs), so nothing
  hides it.
- Load imbalance: the layer waits for the rank with the most rows. A router spreading n rows over ep
  ranks uniformly at random gives each a binomial count (mean n/ep, standard deviation
  sqrt(n (1/ep)(1-1/ep))); the largest of ep such counts lies about sqrt(2 ln ep) deviations above the
  mean (the Gaussian maximum), so the busiest rank holds (1 + sqrt(2 ln(ep) (ep-1) / n)) times the mean.
  A router that prefers some experts is worse: a measured ratio replaces this one when there is one
  (measured_imbalance: the rows `autoplan profile --measure` counted per expert, grouped as the ranks hold
  the experts).
- Memory: a rank holds E/ep of the experts' weights, gradients and optimizer states; every other
  parameter stays data-parallel.
- Expert parallelism is folded over dp_shard x cp x tp (layout.expert_folded_ranks): the ep group is the
  innermost ep of those ranks (stride 1, over the tp ranks first), the experts stay whole (ETP 1), and each tp
  rank routes its own 1/tp of the tokens, sequence parallelism or not (rows and expert compute / tp; cost/context.py
  expert_shard_degree for the states).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from autoplan.chain.experts import ExpertLayer
from autoplan.cost.comm import Group, all_to_all_s

ALL_TO_ALLS_PER_LAYER = 4
"""Dispatch and combine in the forward, and both again in the backward."""


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


def router_imbalance(rows: float, degree: int) -> float:
    """The busiest of `degree` ranks' rows over the mean when `rows` rows are spread uniformly at random
    (the Gaussian maximum of `degree` binomial counts; 1 for one rank)."""
    if degree <= 1 or rows <= 0:
        return 1.0
    return 1.0 + math.sqrt(2 * math.log(degree) * (degree - 1) / rows)


def measured_imbalance(rows_per_expert: Sequence[int], degree: int) -> float | None:
    """The busiest of `degree` ranks' rows over the mean when rank r holds experts r*E/degree .. (r+1)*E/degree - 1
    (runtime/expert_parallel.py) and the router sends each expert the measured rows (ModelProfile.router_loads);
    None without a measurement or when `degree` does not split the experts evenly."""
    experts = len(rows_per_expert)
    total = sum(rows_per_expert)
    if degree <= 1 or not experts or experts % degree or total <= 0:
        return None
    share = experts // degree
    busiest = max(sum(rows_per_expert[r * share:(r + 1) * share]) for r in range(degree))
    return busiest * degree / total


def expert_parallel_cost(layer: ExpertLayer, tokens_per_microbatch: float, bytes_per_element: float,
                         group: Group, measured_imbalance: float | None = None) -> ExpertParallelCost:
    """The cost of `layer` on one rank of the expert-parallel `group` for a micro-batch of
    `tokens_per_microbatch` tokens on that rank (measured_imbalance: the router's ratio from a profile
    measurement, replacing the uniform one)."""
    rows = tokens_per_microbatch * layer.top_k
    degree = group.size
    if degree <= 1:
        return ExpertParallelCost(rows, 0.0, 1.0, float(layer.parameter_numel))
    one = all_to_all_s(rows * layer.hidden * bytes_per_element, degree, group.link, group.nodes)
    imbalance = measured_imbalance if measured_imbalance is not None else router_imbalance(rows * degree, degree)
    return ExpertParallelCost(rows, ALL_TO_ALLS_PER_LAYER * one, max(1.0, imbalance),
                              layer.parameter_numel / degree)
