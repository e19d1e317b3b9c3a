"""A profile prepared for pricing layouts on a cluster: the chain, its tensor-parallel facts and static
costs, module tables and memory inputs cached per (tp, micro-batch, sp, cp, ep), and the mesh's communicators.

Mesh dims in rank order ("pp", "dp_replicate", "dp_shard", "cp", "tp"), torchtitan's: tensor parallel groups
are contiguous (stride 1, inside a node), cp has stride tp, dp_shard stride tp x cp, dp_replicate stride
tp x cp x dp_shard and the pipeline stride tp x cp x dp. FSDP shards over dp_shard x cp (stride tp). Expert
parallelism is folded over dp_shard x cp x tp (layout.expert_folded_ranks): the expert-parallel group is the
innermost ep of those ranks (stride 1, the tp ranks first), the experts' FSDP group the rest of them (stride ep).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

from autoplan.chain.attention import attention_facts
from autoplan.chain.batch_statistics import batch_statistics, batch_statistics_modules
from autoplan.chain.experts import expert_layers
from autoplan.chain.modules import build_chain
from autoplan.chain.tensor_parallel import tensor_parallel_facts
from autoplan.cost import comm
from autoplan.cost.compute import ModuleTable, ShardedModules, TableSetting, module_table, sharded_table
from autoplan.cost.context_parallel import KeyValues, StepCosts, ring_attention_cost
from autoplan.cost.expert_parallel import expert_parallel_cost, measured_imbalance
from autoplan.cost.dtypes import activation_scale, bytes_per_element, training_dtype
from autoplan.cost.memory import LayoutMemory, MemoryInputs, MemoryLayout, layout_memory
from autoplan.cost.module_costs import SEQUENCE_ROLES, SPLIT_ROLES, ChainCosts, chain_costs
from autoplan.hardware.types import Cluster
from autoplan.layout import expert_folded_ranks, fsdp_wraps
from autoplan.plan import Parallelism, Training
from autoplan.profile_data import ModelProfile

GIB = 2**30


def gib(nbytes: float) -> str:
    """Bytes as GiB for messages: one decimal, or two significant digits below 1 GiB."""
    value = nbytes / GIB
    return f"{value:.1f}" if abs(value) >= 1 else f"{value:.2g}"


@dataclass(frozen=True)
class Groups:
    tp: comm.Group
    shard: comm.Group
    """FSDP's: dp_shard x cp ranks."""
    replicate: comm.Group
    pipeline: comm.Group
    cp: comm.Group
    ep: comm.Group
    expert_shard: comm.Group
    """The ranks the expert parameters are FSDP-sharded over (dp_shard x cp / ep, or 1: expert_shard_degree)."""
    expert_replicate: comm.Group
    """The ranks holding the same experts' shard, which all-reduce their gradients (dp_replicate, or dp / ep when
    the experts are not sharded), with the tp ranks beside them under sequence parallelism (whose expert gradients
    are each their tokens' share)."""


def _sequence_local_numel(profile: ModelProfile, plan: dict[str, str], module_of: dict[str, int],
                          n: int, sharded: frozenset[str] = frozenset()) -> tuple[float, ...]:
    """Per chain module, the elements of the parameters of the modules that run on each tp rank's sequence shard
    (tensor-parallel style "sequence_local"), where the ops reading them run (each counted once); not those split
    over the tp ranks (a shared expert's Linear pair inside such a module runs on DTensors)."""
    local = tuple(fqn + "." for fqn, style in plan.items() if style == "sequence_local")
    found: list[set[str]] = [set() for _ in range(n)]
    for op in profile.ops:
        if op.node in module_of:
            found[module_of[op.node]].update(p for p in op.params if p in profile.parameters and p.startswith(local)
                                             and p not in sharded)
    return tuple(float(sum(profile.parameters[p] for p in params)) for params in found)


def expert_shard_degree(fsdp_shard: int, ep: int, tp: int = 1) -> int:
    """Ranks the expert parameters' states shard over, with FSDP over `fsdp_shard` ranks (dp_shard x cp), expert
    parallelism `ep` and tensor parallelism `tp`. Expert parallelism is folded over dp_shard x cp x tp
    (layout.expert_folded_ranks): a rank holds E/ep experts, whole (ETP 1), and FSDP2 shards them over the
    dp_shard x cp x tp / ep ranks holding the same ones (runtime/distributed/expert_parallel.py "efsdp"), so a rank keeps
    1/(dp_shard x cp x tp) of the expert states. At ep 1 the experts are parameters like the others, whole on each tp
    rank: fsdp_shard. 1 (whole E/ep experts, gradients all-reduced over the ranks holding them) without FSDP
    (fsdp_shard 1), or when the folded ranks are no multiple of ep (ep then borrows replicas: priced, not run)."""
    if fsdp_shard <= 1:
        return 1
    if ep == 1:
        return fsdp_shard
    folded = expert_folded_ranks(dp_shard=fsdp_shard, cp=1, tp=tp)
    return 1 if folded % ep else folded // ep


def memory_layout(par: Parallelism, autocast: bool = False) -> MemoryLayout:
    """What `par`'s memory vectors read of it (cost/memory.py layout_memory); `autocast` as Context.autocast_layout."""
    ddp = par.fsdp_shard == 1 and par.dp_replicate > 1 and par.tp == 1  # runtime/distributed/parallel.py
    return MemoryLayout(fsdp_shard=par.fsdp_shard, reshards_after_forward=par.reshards_after_forward,
                        pp_enabled=par.pp_enabled, offload=par.offload,
                        expert_shard=expert_shard_degree(par.fsdp_shard, par.ep, par.tp), autocast=autocast, ddp=ddp,
                        accumulates=par.microbatches > 1)


@dataclass(frozen=True)
class TableKey:
    """What a module table (Context.table) reads of a layout: its cache key. From a Parallelism (TableKey.of), or
    written out where a table is priced at a fractional micro-batch (a context-parallel rank's share)."""

    tp: int = 1
    microbatch: float = 1
    sp: bool = False
    """Sequence parallel (only with tp > 1: of() and the constructor's callers keep it off at tp = 1)."""
    loss_parallel: bool = True
    """The loss on the vocabulary-parallel head's sharded logits, else on gathered ones."""
    cp: int = 1
    ep: int = 1

    @staticmethod
    def of(layout: "Parallelism | TableKey") -> "TableKey":
        if isinstance(layout, TableKey):
            return replace(layout, sp=layout.sp and layout.tp > 1)
        return TableKey(layout.tp, layout.microbatch, layout.sp_enabled, layout.loss_parallel, layout.cp, layout.ep)


@dataclass(frozen=True)
class Pricing:
    """How a Context prices what runs beside the layout: the program's compile setting, and the settings of published
    runs that are priced only (never a plan's program)."""

    compiled: bool = False
    """Modules run under torch.compile (plan.json compile.enable): priced per op class (compute.py)."""
    float8_linears: str | None = None
    """The float8 recipe the Linears are priced with (cost/float8.py FLOAT8_RECIPES), None for the training dtype:
    priced only."""
    ring_traced: bool = False
    """Context parallelism's ring priced as traced into torch.compile graphs (cost/context_parallel.py, every exchange
    exposed) even where the modules are priced eager (`compiled` off): a published run's compiled blocks on a layout
    whose compile autoplan's program refuses. Priced only; with `compiled` the ring is priced traced anyway (the
    program's compiled modules trace it)."""


class Context:
    """A profile prepared for pricing layouts on a cluster; module tables cached per TableKey."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, training: Training, features: frozenset[str],
                 pricing: Pricing = Pricing()) -> None:
        self.profile, self.cluster, self.training, self.features = profile, cluster, training, features
        self.compiled = pricing.compiled
        """Modules run under torch.compile (plan.json compile.enable): priced per op class (compute.py)."""
        self.float8_linears = pricing.float8_linears
        """Pricing.float8_linears."""
        self.ring_traced = pricing.ring_traced
        """Pricing.ring_traced."""
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
        # ops timed on this machine price a plan for its kind of device: the CPU's for --gpu cpu, a GPU's
        # (autoplan --measure on a GPU machine, in the plan's dtype) for a GPU profile
        self.use_measured = self.costs.measured and (cluster.gpu.name == "cpu") == (self.costs.measured_on == "cpu")
        self.attention = attention_facts(profile)
        """The model's SDPA calls (what context parallelism rings) and why it cannot, if it cannot."""
        self.experts = expert_layers(profile)
        """The model's expert layers (what expert parallelism shards)."""
        module_of = {node: u for u, module in enumerate(self.chain.modules) for node in module.ops}
        owner = {op.node: op.module for op in profile.ops}
        self._expert_module = tuple(_first_module(layer.module, owner, module_of) for layer in self.experts)
        """The chain module running each expert layer's experts."""
        self.expert_numel = tuple(sum(layer.parameter_numel for layer, v in zip(self.experts, self._expert_module)
                                      if v == u) for u in range(len(self.chain)))
        """Expert parameter elements of each module (all E experts)."""
        self._attention_module = tuple(module_of[call.node] for call in self.attention.calls)
        self._attention_nodes = frozenset(call.node for call in self.attention.calls)
        self.mask_cut_bytes = _mask_cut_bytes(profile, self.attention.calls, module_of, len(self.chain))
        """Per module boundary, the bytes per sample of the attention masks crossing it (capture dtype), which the
        ring does without."""
        self._expert_nodes = frozenset(n for n, m in owner.items()
                                       if any(m == layer.module or m.startswith(layer.module + ".")
                                              for layer in self.experts))
        self._experts_on_shards = any(self.facts.role.get(n, "") in SEQUENCE_ROLES for n in self._expert_nodes)
        """Under sequence parallelism the experts run on each tp rank's sequence shard (their ops' roles)."""
        self.sequence_local_numel = _sequence_local_numel(profile, self.facts.plan, module_of, len(self.chain),
                                                          self.facts.sharded_parameters)
        """Per module, the replicated parameter elements that modules run on each tp rank's tokens read (a router's,
        the experts' at ep = 1): under sequence parallelism their gradients are summed over the tp ranks."""
        self._tables: dict[tuple, ModuleTable] = {}
        self._module_numel: dict[tuple[int, int], tuple[float, ...]] = {}
        self._op_tables: dict[tuple, ModuleTable] = {}
        self._expert_compute: dict[tuple, tuple[float, ...]] = {}
        self._inputs: dict[tuple[TableKey, bool], MemoryInputs] = {}
        self._layouts: dict[tuple, LayoutMemory] = {}
        self.memory_bounds: dict[tuple, float] = {}
        """cost/evaluate.py memory_lower_bound's, per the layout vectors, in-flight count, ranks and modes it reads."""

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
        t, r = par.tp, par.dp_replicate
        cp, ep, fsdp_shard = par.cp, par.ep, par.fsdp_shard
        experts = expert_shard_degree(fsdp_shard, ep, t)
        # the expert mesh folded over dp_shard x cp x tp (tp innermost): ep consecutive ranks, then the experts' FSDP
        # ranks, then the ranks holding the same experts' shard (the replicas, and the folded ranks beyond ep x
        # experts when FSDP2 does not shard them), which sum their gradients
        replicas = self.group(max(1, r * fsdp_shard * t // (ep * experts)), ep * experts)
        return Groups(self.group(t, 1), self.group(fsdp_shard, t), self.group(r, t * fsdp_shard),
                      self.group(par.pp, t * fsdp_shard * r), self.group(cp, t), self.group(ep, 1),
                      self.group(experts, ep), replicas)

    def send_s(self, nbytes: float, par: Parallelism, link) -> float:
        """One activation (or gradient) crossing a stage boundary. Each tensor-parallel rank sends the
        whole replicated tensor (torch.distributed.pipelining), unless "pp_scatter_gather" is on:
        Megatron-LM sends 1/tp per rank and all-gathers it inside the node (Narayanan et al. SC21 4.1)."""
        tp = par.tp
        if tp == 1 or "pp_scatter_gather" not in self.features:
            return comm.p2p_s(nbytes, link)
        return comm.p2p_s(nbytes / tp, link) + comm.all_gather_s(nbytes, tp, self.group(tp, 1).link)

    def table(self, layout: Parallelism | TableKey, autocast: bool = False) -> ModuleTable:
        """Module costs of `layout` (what of it a table reads: TableKey) under this context's compile setting; with
        `autocast` (bf16 without FSDP2: autocast_layout), the activations as torch.autocast keeps them (the times are
        the same)."""
        k = TableKey.of(layout)
        tp, microbatch, sp, cp, ep = k.tp, k.microbatch, k.sp, k.cp, k.ep
        key = (k, self.compiled, autocast)
        if key not in self._tables:
            if cp == 1 and ep == 1:
                self._tables[key] = self._part_table(self.costs, k, autocast)
            else:
                base = self.table(replace(k, cp=1, ep=1), autocast=autocast)
                rank = self._part_table(self.costs, replace(k, microbatch=microbatch / cp), autocast) \
                    if cp > 1 else None  # a rank's tokens: its kernels launch and its weights stream whole
                table = sharded_table(base, self._sharded_modules(tp, microbatch, sp, cp, ep), rank)
                self._tables[key] = self._local_expert_copies(table, ep) if autocast and ep > 1 else table
        return self._tables[key]

    def _local_expert_copies(self, table: ModuleTable, ep: int) -> ModuleTable:
        """`table` (priced from the modules with every expert local) with the experts' cast weight copies of an
        expert-parallel rank: its 1/ep of the experts (module_costs.grouped_weight_numel), not all of them."""
        element = bytes_per_element(self.dtype)
        extra = tuple(element * sum(op.autocast_weight_numel for op in module.ops if op.grouped) * (1 - 1 / ep)
                      for module in self.costs.modules)
        none = tuple(max(0.0, v - e) for v, e in zip(table.activation_bytes["none"], extra))
        activations = {m: none if m == "none" else tuple(min(v, w) for v, w in zip(kept, none))
                       for m, kept in table.activation_bytes.items()}
        return replace(table, activation_bytes=activations,
                       working_bytes=tuple(max(0.0, v - e) for v, e in zip(table.working_bytes, extra)))

    def expert_compute_s(self, layout: Parallelism | TableKey) -> tuple[float, ...]:
        """Per module, the share of table(layout).forward_s + backward_s that is its experts' ops, per micro-batch:
        (expert_forward_1 + expert_backward_1) x imbalance / expert_split / cp, as sharded_table prices them (the
        busiest expert-parallel rank on its share of the tokens; at cp > 1 the experts' kernels on the whole
        sequence / cp). 0 for modules without experts."""
        k = TableKey.of(layout)
        tp, microbatch, cp, ep = k.tp, k.microbatch, k.cp, k.ep
        key = (tp, microbatch, k.sp, self.compiled, cp, ep)
        if key not in self._expert_compute:
            n = len(self.chain)
            if not self._expert_nodes:
                self._expert_compute[key] = (0.0,) * n
            elif cp == 1 and ep == 1:
                experts = self._ops_table(self._expert_nodes, tp, microbatch, key[2])
                self._expert_compute[key] = tuple(f + b for f, b in zip(experts.forward_s, experts.backward_s))
            else:
                s = self._sharded_modules(tp, microbatch, key[2], cp, ep)
                self._expert_compute[key] = tuple(
                    (f + b) * i / s.expert_split / cp
                    for f, b, i in zip(s.expert_forward_s, s.expert_backward_s, s.imbalance))
        return self._expert_compute[key]

    def _part_table(self, costs: ChainCosts, k: TableKey, autocast: bool = False,
                    whole_modules: bool = True) -> ModuleTable:
        """The module table of `costs` at `k`'s tp, micro-batch, sp and loss_parallel (not its cp and ep)."""
        return module_table(costs, TableSetting(
            gpu=self.cluster.gpu, capture_dtype=self.chain.capture_dtype, train_dtype=self.dtype, tp=k.tp,
            microbatch=k.microbatch, tp_link=self.group(k.tp, 1).link, use_measured=self.use_measured, sp=k.sp,
            compiled=self.compiled, loss_parallel=k.loss_parallel, autocast=autocast,
            float8_linears=self.float8_linears, whole_modules=whole_modules))

    def autocast_layout(self, par: Parallelism) -> bool:
        """bf16 trains as torch.autocast over fp32 weights in this layout: FSDP2 does not wrap it
        (layout.fsdp_wraps), so no MixedPrecisionPolicy computes in bf16 (runtime/distributed/steps.py)."""
        return self.dtype == "bf16" and not fsdp_wraps(par.dp_replicate,
                                                        par.dp_shard, par.cp,
                                                        par.tp)

    def _ops_table(self, nodes: frozenset[str], tp: int, microbatch: int, sp: bool) -> ModuleTable:
        """The module table of only the ops in `nodes` (each module's share: its experts, its attention), priced once
        per setting (every cp and ep of a search asks for the same one)."""
        key = (nodes, tp, microbatch, sp, self.compiled)
        if key not in self._op_tables:
            self._op_tables[key] = self._priced_ops_table(nodes, tp, microbatch, sp)
        return self._op_tables[key]

    def _priced_ops_table(self, nodes: frozenset[str], tp: int, microbatch: int, sp: bool) -> ModuleTable:
        modules = tuple(replace(costs, ops=tuple(op for op, node in zip(costs.ops, module.ops) if node in nodes))
                        for costs, module in zip(self.costs.modules, self.chain.modules))
        return self._part_table(replace(self.costs, modules=modules), TableKey(tp, microbatch, sp), whole_modules=False)

    def _sharded_modules(self, tp: int, microbatch: int, sp: bool, cp: int, ep: int) -> ShardedModules:
        """Per module: its experts' compute and the imbalance the busiest expert-parallel rank adds, its ring
        attention's exposed traffic (one ring per SDPA call) and its expert layers' all-to-alls, per micro-batch
        (cost/context_parallel.py, cost/expert_parallel.py)."""
        n, element = len(self.chain), self.dtype_bytes
        experts = self._ops_table(self._expert_nodes, tp, microbatch, sp)
        imbalance, all_to_all, route_forward, route_backward = [1.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        route_recompute, route_kept = [0.0] * n, [0.0] * n
        ep_group = self.group(ep, 1)  # folded over the tp ranks first (runtime/distributed/expert_parallel.py)
        # with ep > 1 each tp rank routes its own 1/tp of the tokens (TensorParallelTokens); with sequence parallelism
        # through "sequence_local" MoE blocks (chain/tensor_parallel.py) the table already prices the experts' ops on
        # that share, so only the rows sent are split here
        rows_split = tp if ep > 1 else 1
        split = 1 if sp and self._experts_on_shards else rows_split
        for layer, u in zip(self.experts, self._expert_module):
            tokens = layer.tokens / self.profile.batch_size * microbatch / cp / rows_split
            loads = self.profile.router_loads.get(layer.module)
            measured = measured_imbalance(loads, ep_group.size) if loads else None  # profile --measure
            cost = expert_parallel_cost(layer, tokens, element, ep_group, measured_imbalance=measured,
                                        gpu=self.cluster.gpu)
            imbalance[u] = max(imbalance[u], cost.imbalance)
            all_to_all[u] += cost.all_to_all_s
            route_forward[u] += cost.route_forward_s
            route_backward[u] += cost.route_backward_s
            route_recompute[u] += cost.route_recompute_s
            route_kept[u] += cost.selective_kept_bytes
        ring_forward, ring_backward, change, ring_working = [0.0] * n, [0.0] * n, [0.0] * n, [0.0] * n
        ring_kept = [0.0] * n
        if cp > 1:
            attention = self._ops_table(self._attention_nodes, tp, microbatch, sp)
            calls = [self._attention_module.count(u) for u in range(n)]
            cp_group, role = self.group(cp, tp), self.facts.role
            gpu = self.cluster.gpu
            step = StepCosts(gpu.kernel_overhead_s, gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency)
            for call, u in zip(self.attention.calls, self._attention_module):
                features = call.kv_features / (tp if role.get(call.node, "") in SPLIT_ROLES else 1)
                ring = ring_attention_cost(KeyValues(microbatch, call.sequence_length, features, element),
                                           attention.forward_s[u] / calls[u] / cp,
                                           attention.backward_s[u] / calls[u] / cp, cp_group, step,
                                           traced=self.compiled or self.ring_traced)
                ring_forward[u] += ring.forward_exposed_s
                ring_backward[u] += ring.backward_exposed_s
                ring_working[u] = max(ring_working[u], ring.working_bytes)
                ring_kept[u] += ring.kept_bytes
                heads = tp if role.get(call.node, "") in SPLIT_ROLES else 1  # its heads split over tp
                change[u] += (call.ring_saved_bytes - call.saved_bytes) * microbatch * self.scale / heads
            first = self._block_start(min(self._attention_module))
            if sp and tp > 1 and first > 0:  # sequence shares under sequence parallelism (runtime/distributed/context_parallel.py)
                whole = self.cut_bytes(cp)[first - 1] * microbatch * self.scale
                tp_group = self.group(tp, 1)
                ring_forward[first] += comm.all_gather_s(whole, tp, tp_group.link, tp_group.nodes)
                ring_backward[first] += comm.all_gather_s(whole / cp, tp, tp_group.link, tp_group.nodes)
        return ShardedModules(cp=cp, expert_forward_s=experts.forward_s, expert_backward_s=experts.backward_s,
                              imbalance=tuple(imbalance), ring_forward_s=tuple(ring_forward),
                              ring_backward_s=tuple(ring_backward), all_to_all_s=tuple(all_to_all),
                              route_forward_s=tuple(route_forward), route_backward_s=tuple(route_backward),
                              route_recompute_s=tuple(route_recompute), route_kept_bytes=tuple(route_kept),
                              expert_cheap_forward_s=experts.cheap_forward_s,
                              expert_saved_bytes=experts.activation_bytes["none"],
                              saved_change_bytes=tuple(change), ring_working_bytes=tuple(ring_working),
                              ring_kept_bytes=tuple(ring_kept),
                              expert_split=split,
                              input_change_bytes=tuple(-self.mask_cut_bytes[u - 1] * microbatch * self.scale
                                                       / (tp if sp and self.costs.modules[u].sequence_input else 1)
                                                       if cp > 1 and u > 0 else 0.0 for u in range(n)))

    def _block_start(self, u: int) -> int:
        """The first chain module of the block running module u (its siblings under the same parent before it, as
        blocks.0.ln_1 before blocks.0.attn): where context parallelism cuts each rank's share of the sequence
        (runtime/distributed/attention_blocks.py: the outermost module running the attention that started after the
        embeddings)."""
        fqns = [m.fqn for m in self.chain.modules]
        parent = fqns[u].rpartition(".")[0]
        while parent and u > 0 and fqns[u - 1].startswith(parent + "."):
            u -= 1
        return u

    def cut_bytes(self, cp: int = 1) -> tuple[float, ...]:
        """Bytes per sample crossing each module boundary (capture dtype), whole sequences; without the attention
        masks when cp > 1 (the ring runs without them)."""
        if cp == 1:
            return tuple(self.chain.cut_bytes)
        return tuple(max(0.0, c - m) for c, m in zip(self.chain.cut_bytes, self.mask_cut_bytes))

    def rank_cut_bytes(self, cp: int = 1) -> tuple[float, ...]:
        """Bytes per sample each rank sends across each module boundary (capture dtype): cut_bytes(cp), divided by cp
        from the output of the first module calling attention on; the boundaries before it carry the whole sequence
        on every context-parallel rank, as the program hands the ranks their shares only where the block of the first
        attention call starts (runtime/distributed/context_parallel.py)."""
        if cp == 1:
            return self.cut_bytes()
        first = min(self._attention_module, default=0)
        return tuple(c / cp if i >= first else c for i, c in enumerate(self.cut_bytes(cp)))

    def total_numel(self, tp: int, ep: int = 1) -> float:
        """Parameter elements on a tensor-parallel rank (E/ep experts of each expert layer), tied ones once."""
        return sum(self.module_numel(tp, ep)) + sum(self.group_numel(tp))

    def module_numel(self, tp: int, ep: int = 1) -> list[float]:
        """Parameter elements each module holds on a rank (its expert layers' E/ep experts)."""
        if (tp, ep) not in self._module_numel:  # priced for every family of a search
            self._module_numel[tp, ep] = tuple(u.replicated_numel + u.split_numel / tp - e * (1 - 1 / ep)
                                               for u, e in zip(self.costs.modules, self.expert_numel))
        return list(self._module_numel[tp, ep])

    def module_expert_numel(self, ep: int) -> list[float]:
        """Of module_numel, the expert parameter elements (E/ep experts)."""
        return [e / ep for e in self.expert_numel]

    def group_numel(self, tp: int) -> list[float]:
        return [g.numel / (tp if split else 1) for g, split in zip(self.chain.tied_groups, self.costs.tied_split)]

    def layout_memory(self, inputs: MemoryInputs, setting: MemoryLayout) -> LayoutMemory:
        key = (id(inputs), setting)
        if key not in self._layouts:
            self._layouts[key] = layout_memory(inputs, self.dtype, setting)
        return self._layouts[key]

    def memory_inputs(self, layout: Parallelism | TableKey, autocast: bool = False) -> MemoryInputs:
        """What a layout's memory model reads of the modules (module table, parameters, cuts) at `layout`."""
        key = (TableKey.of(layout), self.compiled, autocast)  # the table's saved activations depend on compile
        if key not in self._inputs:
            self._inputs[key] = self._memory_inputs(key[0], autocast)
        return self._inputs[key]

    def _memory_inputs(self, k: TableKey, autocast: bool) -> MemoryInputs:
        tp, microbatch, loss_parallel, cp, ep = k.tp, k.microbatch, k.loss_parallel, k.cp, k.ep
        table = self.table(k, autocast)
        cut_scale = 1.0 if autocast else self.scale  # autocast's residual stream is fp32
        own, groups = self.module_numel(tp, ep), self.group_numel(tp)
        whole = [own[u] + sum(n for n, g in zip(groups, self.chain.tied_groups) if u in g.modules)
                 for u in range(len(own))]
        return MemoryInputs(
            module_numel=tuple(own), group_numel=tuple(groups),
            tied_group_modules=tuple(g.modules for g in self.chain.tied_groups),
            module_largest_numel=tuple(whole), activations=table.activation_bytes,
            working_bytes=table.working_bytes,
            cut_bytes=tuple(c * microbatch * cut_scale for c in self.rank_cut_bytes(cp)),
            expert_numel=tuple(self.module_expert_numel(ep)) if self.experts else (),
            output_bytes=self._output_bytes(tp, loss_parallel, cp) * microbatch * cut_scale,
        )

    def _output_bytes(self, tp: int, loss_parallel: bool, cp: int) -> float:
        """Bytes per sample of the model's outputs on a rank (capture dtype): the logits, 1/tp of them where the
        head's output stays vocabulary-sharded (loss parallel, as compute.py prices the loss), 1/cp of the sequence
        past the first attention (rank_cut_bytes)."""
        last = self.costs.modules[-1]
        sharded = tp > 1 and loss_parallel and any(op.tp_role == "head" for op in last.ops)
        return last.output_buffer_bytes / (tp if sharded else 1) / (cp if self._attention_module else 1)


def _mask_cut_bytes(profile: ModelProfile, calls, module_of: dict[str, int], modules: int) -> tuple[float, ...]:
    """Bytes per sample of the SDPA calls' masks crossing each module boundary: a mask made in module p and read
    last in module l crosses boundaries p .. l-1."""
    output = {op.node: op.output_bytes / profile.batch_size for op in profile.ops}
    span: dict[str, tuple[int, int]] = {}
    for call in calls:
        if call.mask:
            first = module_of.get(call.mask, 0)
            last = max(span.get(call.mask, (first, first))[1], module_of[call.node])
            span[call.mask] = (first, last)
    out = [0.0] * max(0, modules - 1)
    for mask, (first, last) in span.items():
        for i in range(first, min(last, len(out))):
            out[i] += output.get(mask, 0.0)
    return tuple(out)


def _first_module(fqn: str, owner: dict[str, str], module_of: dict[str, int]) -> int:
    """The chain module of the first op that `fqn` (or a module inside it) runs."""
    return next(module_of[node] for node, module in owner.items()
                if (module == fqn or module.startswith(fqn + ".")) and node in module_of)
