"""A profile prepared for pricing layouts on a cluster: the chain, its tensor-parallel facts and static
costs, module tables and memory inputs cached per (tp, micro-batch), and the mesh's communicators.

Mesh dims in rank order ("pp", "dp_replicate", "dp_shard", "tp"): tensor parallel groups are
contiguous (stride 1, inside a node), dp_shard has stride tp, dp_replicate stride tp x dp_shard and the
pipeline stride tp x dp.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from autoplan.chain.batch_statistics import batch_statistics, batch_statistics_modules
from autoplan.chain.modules import build_chain
from autoplan.chain.tensor_parallel import tensor_parallel_facts
from autoplan.cost import comm
from autoplan.cost.compute import TableSetting, ModuleTable, module_table
from autoplan.cost.dtypes import activation_scale, bytes_per_element, training_dtype
from autoplan.cost.memory import LayoutMemory, MemoryInputs, layout_memory
from autoplan.cost.module_costs import chain_costs
from autoplan.hardware.types import Cluster
from autoplan.plan import Parallelism, Training
from autoplan.profile.types import ModelProfile

GIB = 2**30


def gib(nbytes: float) -> str:
    """Bytes as GiB for messages: one decimal, or two significant digits below 1 GiB."""
    value = nbytes / GIB
    return f"{value:.1f}" if abs(value) >= 1 else f"{value:.2g}"


@dataclass(frozen=True)
class Groups:
    tp: comm.Group
    shard: comm.Group
    replicate: comm.Group
    pipeline: comm.Group


class Context:
    """A profile prepared for pricing layouts on a cluster; module tables cached per (tp, micro-batch)."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, training: Training, features: frozenset[str],
                 compiled: bool = False) -> None:
        self.profile, self.cluster, self.training, self.features = profile, cluster, training, features
        self.compiled = compiled
        """Modules run under torch.compile (plan.json compile.enable): priced per op class (compute.py)."""
        self.chain = build_chain(profile)
        self.facts = tensor_parallel_facts(profile, vocab_parallel="tp_vocab_parallel" in features,
                                           fused_split="tp_fused_split" in features)
        self.costs = chain_costs(profile, self.chain, self.facts)
        self.batch_statistics = batch_statistics(profile)
        """Calls of modules that normalize over the batch (BatchNorm), in graph order."""
        self.batch_norm_modules = batch_statistics_modules(self.batch_statistics)
        self.loss_parallel_problem = profile.loss_parallel_problem if self.facts.has_head else ""
        """Why the loss cannot run on the vocabulary-parallel head's sharded logits ("" if it can, or no head)."""
        self.dtype = training_dtype(training.dtype)
        self.dtype_bytes = bytes_per_element(self.dtype)
        self.scale = activation_scale(self.chain.capture_dtype, self.dtype)
        self.use_measured = self.costs.measured and cluster.gpu.name == "cpu"
        self._tables: dict[tuple[int, int, bool], ModuleTable] = {}
        self._inputs: dict[tuple[int, int, bool], MemoryInputs] = {}
        self._layouts: dict[tuple, LayoutMemory] = {}

    def at(self, cluster: Cluster, training: Training) -> "Context":
        """This context for another GPU count or global batch, sharing the chain, the tensor-parallel facts,
        the static costs and the per-(tp, micro-batch) tables, which depend on the GPU, its node size and
        the training dtype only (those must be the same)."""
        same = (cluster.hardware, cluster.gpus_per_node, training.dtype) == (
            self.cluster.hardware, self.cluster.gpus_per_node, self.training.dtype)
        if not same:
            raise ValueError("Context.at: the hardware, GPUs per node and dtype must stay the same")
        other = copy.copy(self)
        other.cluster, other.training = cluster, training
        return other

    def compiled_as(self, compiled: bool) -> "Context":
        """This context with the modules under torch.compile or not, sharing every cache (the module tables
        are keyed by it)."""
        other = copy.copy(self)
        other.compiled = compiled
        return other

    def group(self, size: int, stride: int) -> comm.Group:
        """A mesh-dim communicator. Across nodes, NCCL runs one ring per NIC, so a group with k GPUs
        in each node moves k x the per-GPU inter-node bus bandwidth (capped by the node's own)."""
        span = (size - 1) * stride + 1
        per_node = self.cluster.gpus_per_node
        nodes = size if stride >= per_node else max(1, math.ceil(span / per_node))
        link = self.cluster.link_for(size, stride)
        if nodes > 1:
            local = max(1, min(size // nodes, per_node // stride)) if stride < per_node else 1
            intra = self.cluster.hardware.intra_node.bus_bandwidth_bytes_per_s
            link = link.with_bus_bandwidth(min(intra, link.bus_bandwidth_bytes_per_s * local))
        return comm.Group(size, link, min(size, nodes))

    def groups(self, par: Parallelism) -> Groups:
        t, s, r = par.tensor_parallel_degree, par.data_parallel_shard_degree, par.data_parallel_replicate_degree
        return Groups(self.group(t, 1), self.group(s, t), self.group(r, t * s),
                      self.group(par.pipeline_parallel_degree, t * s * r))

    def send_s(self, nbytes: float, par: Parallelism, link) -> float:
        """One activation (or gradient) crossing a stage boundary. Each tensor-parallel rank sends the
        whole replicated tensor (torch.distributed.pipelining), unless "pp_scatter_gather" is on:
        Megatron-LM sends 1/tp per rank and all-gathers it inside the node (Narayanan et al. SC21 4.1)."""
        tp = par.tensor_parallel_degree
        if tp == 1 or "pp_scatter_gather" not in self.features:
            return comm.p2p_s(nbytes, link)
        return comm.p2p_s(nbytes / tp, link) + comm.all_gather_s(nbytes, tp, self.group(tp, 1).link)

    def table(self, tp: int, microbatch: int, sp: bool = False, loss_parallel: bool = True) -> ModuleTable:
        """Module costs at tensor-parallel degree `tp`, micro-batch size `microbatch`, sequence parallel `sp`,
        the loss on sharded logits or gathered ones (`loss_parallel`), and this context's compile setting."""
        key = (tp, microbatch, sp and tp > 1, self.compiled, loss_parallel)
        if key not in self._tables:
            self._tables[key] = module_table(self.costs, TableSetting(
                gpu=self.cluster.gpu, capture_dtype=self.chain.capture_dtype, train_dtype=self.dtype, tp=tp,
                microbatch=microbatch, tp_link=self.group(tp, 1).link, use_measured=self.use_measured,
                sp=key[2], compiled=self.compiled, loss_parallel=loss_parallel))
        return self._tables[key]

    def total_numel(self, tp: int) -> float:
        """Parameter elements on a tensor-parallel rank, tied ones once."""
        return sum(self.module_numel(tp)) + sum(self.group_numel(tp))

    def module_numel(self, tp: int) -> list[float]:
        return [u.replicated_numel + u.split_numel / tp for u in self.costs.modules]

    def group_numel(self, tp: int) -> list[float]:
        return [g.numel / (tp if split else 1) for g, split in zip(self.chain.tied_groups, self.costs.tied_split)]

    def layout_memory(self, inputs: MemoryInputs, shard: int, reshard_after_forward: bool, pp: int,
                      offload: bool = False) -> LayoutMemory:
        key = (id(inputs), shard, reshard_after_forward, pp > 1, offload)
        if key not in self._layouts:
            self._layouts[key] = layout_memory(inputs, self.dtype, shard, reshard_after_forward, pp, offload)
        return self._layouts[key]

    def memory_inputs(self, tp: int, microbatch: int, sp: bool = False, loss_parallel: bool = True) -> MemoryInputs:
        key = (tp, microbatch, sp and tp > 1, loss_parallel)
        if key not in self._inputs:
            self._inputs[key] = self._memory_inputs(*key)
        return self._inputs[key]

    def _memory_inputs(self, tp: int, microbatch: int, sp: bool, loss_parallel: bool) -> MemoryInputs:
        table = self.table(tp, microbatch, sp, loss_parallel)
        own, groups = self.module_numel(tp), self.group_numel(tp)
        whole = [own[u] + sum(n for n, g in zip(groups, self.chain.tied_groups) if u in g.modules)
                 for u in range(len(own))]
        return MemoryInputs(
            module_numel=tuple(own), group_numel=tuple(groups),
            tied_group_modules=tuple(g.modules for g in self.chain.tied_groups),
            module_largest_numel=tuple(whole), activations=table.activation_bytes,
            working_bytes=table.working_bytes,
            cut_bytes=tuple(c * microbatch * self.scale for c in self.chain.cut_bytes),
        )
