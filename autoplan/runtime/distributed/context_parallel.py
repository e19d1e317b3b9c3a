"""Ring attention for the CPU attention kernel, so torch's context parallelism runs on CPU/gloo.

`torch.distributed.tensor.experimental.context_parallel` shards the sequence of q, k and v over a mesh
dimension and sends `scaled_dot_product_attention` on those shards to a ring: each rank attends its
queries to every rank's keys and values in turn and merges the partial results by their logsumexp. Its
handlers cover the CUDA kernels only (flash, memory-efficient, cuDNN); on CPU, SDPA dispatches to
`aten._scaled_dot_product_flash_attention_for_cpu`, which DTensor then refuses ("does not have a sharding
strategy registered"). That kernel returns the logsumexp the merge needs, and its backward takes it, so
`register_cpu_ring_attention` gives both the same treatment torch gives the CUDA flash kernel: torch's own
ring (`_templated_ring_attention` and its backward, with their causal load balancing), run on the local
shards, and the results wrapped back as sequence-sharded DTensors. This lets context parallelism be
checked for loss parity here; on GPUs torch's own handlers run.

The handlers join torch's context-parallel op table, so they are active exactly while a
`context_parallel` region is (and DTensor's plain dispatch never sees a sequence-sharded attention).
Attention masks are not handled (torch's CUDA handlers refuse them too): causal or full attention only.

With tensor parallelism (mesh dims cp and tp), q, k and v reach attention as DTensors on the "tp" mesh split on
the heads (runtime/distributed/tensor_parallel.py keeps a column-parallel Linear's output a DTensor), which torch's
context_parallel refuses: tensor_parallel_heads_local hands it each rank's local heads, so every tensor-parallel rank
runs the ring over the cp ranks of its own tp index on its heads (the cp group is the mesh's "cp" dim). Under
sequence parallelism the first block's input is split on the sequence over the tp ranks; SequenceShards gathers it,
cuts the cp share and splits that over the tp ranks again, so sequence parallelism goes on within the share (one
all-gather over tp per micro-batch forward, one backward). The loss on vocabulary-sharded logits (loss_parallel)
takes the targets' cp share as it is.

ContextParallelRegion is what the generated program's step runs each micro-batch in: torch's context_parallel
over the mesh's "cp" ranks (targets cut to the rank's share), the load balancing set from the attention's
causality, and the shard_block_inputs hooks on the block found by runtime/distributed/attention_blocks.py and the chain
modules after it.

Pipeline stages are graphs torch.export recorded with the shapes it saw (PipelineContextParallel). Exported on a
rank with the blocks' sharding hooks (shard_block_inputs) in place, a stage's graph cuts that rank's share of the
sequence where a block starts and keeps its shapes from there on, so the activations the stages send each other
from there on are the rank's share; attention_through_functional then sends the stages' attention calls to the
function context_parallel patches, and the whole schedule step (every stage's forward and backward) runs inside
one ring region, the last stage's targets cut to the rank's share in the order the export cut the activations.

transformers builds its causal mask as a tensor when it traces (torch.export), and passes is_causal=True to SDPA
instead when it runs eagerly without padding: it keeps the mask under export because an exported graph fixes
is_causal for the example's shapes (pytorch#108108), which a pipeline stage's graph does anyway (its shapes are
static). The ring takes no mask tensor, so causal_mask_as_is_causal lets transformers decide during the export as
it does eagerly, exactly when the mask would be SDPA's own causal triangle; any mask left in a stage's attention is
refused with the stage and call (check_maskless).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from autoplan.errors import UserError
from autoplan.runtime.distributed.dropout import attention_without_dropout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from autoplan.runtime.distributed.attention_blocks import AttentionBlocks

SEQUENCE_DIM = 2
"""The sequence dimension of SDPA's (batch, heads, sequence, head_dim) tensors, as torch's ring uses."""

_aten = torch.ops.aten
FORWARD = _aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def register_cpu_ring_attention() -> None:
    """Add the CPU kernel's ring handlers to torch's context-parallel op table (idempotent)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    _attention.custom_ops[FORWARD] = _ring_forward
    _attention.custom_ops[BACKWARD] = _ring_backward


def _ring_forward(op_call, args: tuple, kwargs: dict) -> tuple[DTensor, DTensor]:
    """(output, logsumexp) of attention over the whole sequence, from the ranks' sequence shards."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    query, key, value = args[:3]
    dropout_p = args[3] if len(args) > 3 else kwargs.get("dropout_p", 0.0)
    is_causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
    _refuse_mask(kwargs)
    out, logsumexp = _attention._templated_ring_attention(
        query.device_mesh.get_group(), SEQUENCE_DIM, FORWARD, query=_local(query), key=_local(key),
        value=_local(value), is_causal=is_causal, dropout_p=dropout_p, scale=kwargs.get("scale"))
    return _sharded(out, query), _sharded(logsumexp, query)


def _ring_backward(op_call, args: tuple, kwargs: dict) -> tuple[DTensor, DTensor, DTensor]:
    """Gradients of query, key and value, each on its rank's sequence shard."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = args[:8]
    _refuse_mask(kwargs)
    grads = _attention._templated_ring_attention_backward(
        query.device_mesh.get_group(), SEQUENCE_DIM, BACKWARD, grad_out=_local(grad_out), grad_out_name="grad_out",
        query=_local(query), key=_local(key), value=_local(value), out=_local(out), logsumexp=_local(logsumexp),
        is_causal=is_causal, dropout_p=dropout_p, scale=kwargs.get("scale"))
    return tuple(_sharded(grad, like) for grad, like in zip(grads[:3], (query, key, value)))


def _refuse_mask(kwargs: dict) -> None:
    if kwargs.get("attn_mask") is not None:
        raise NotImplementedError("context parallel ring attention on CPU takes is_causal or no mask, not an "
                                  "attn_mask tensor (torch's CUDA ring handlers refuse one too)")


def _local(tensor):
    """The rank's sequence shard of a DTensor sharded on the sequence (and only on it)."""
    if not isinstance(tensor, DTensor):
        return tensor
    if tuple(tensor.placements) != (Shard(SEQUENCE_DIM),):
        raise NotImplementedError(f"context parallel ring attention needs q, k, v sharded on the sequence "
                                  f"(Shard({SEQUENCE_DIM})) over one mesh dimension, got {tensor.placements}")
    return tensor._local_tensor


def _sharded(local: torch.Tensor, like: DTensor) -> DTensor:
    """`local` as the rank's shard of a sequence-sharded DTensor on `like`'s mesh (the global shape has
    `like`'s sequence length)."""
    shape = list(local.shape)
    shape[SEQUENCE_DIM] = like.shape[SEQUENCE_DIM]
    global_shape = torch.Size(shape)
    stride = torch.empty(global_shape, device="meta").stride()
    spec = DTensorSpec(like.device_mesh, (Shard(SEQUENCE_DIM),),
                       tensor_meta=TensorMeta(global_shape, stride, local.dtype))
    return DTensor(local, spec, requires_grad=False)


ACTIVATION_SEQUENCE_DIM = 1
"""The sequence dimension of a block's batch-first activations (batch, sequence, ...): hidden states,
position ids, rotary cos/sin."""
POSITION_TABLE_DIM = 0
"""The position dimension of a table a model computes once for the whole sequence and hands to every block
without a batch dimension (torchtitan's `freqs_cis`: (sequence, head_dim / 2), complex)."""


class SequenceShards:
    """This rank's share of a sequence under context parallelism, in torch's order: with causal load
    balancing (torch's head-tail balancer, on while `_cp_options.enable_load_balance` is, as `context_parallel`
    and PipelineContextParallel set it) rank r of c holds the r-th and (2c-1-r)-th of 2c chunks, so every rank
    attends to as many earlier tokens; else the r-th of c. The share is cut as runs of consecutive positions
    (narrow, then cat), so an exported graph holds no index tensor."""

    def __init__(self, mesh, seq_len: int, device: torch.device) -> None:
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
            _create_default_load_balancer,
        )

        self.seq_len, self.size, self.rank = seq_len, mesh.size(), mesh.get_local_rank()
        if seq_len % self.size:
            raise ValueError(f"cannot split a sequence of {seq_len} tokens into {self.size} equal shares")
        balancer = _create_default_load_balancer(seq_len, self.size, device)
        order = balancer._generate_indices()[0].cpu() if balancer is not None else torch.arange(seq_len)
        self.positions = order.chunk(self.size)[self.rank]
        """The token positions this rank holds, in the order it holds them."""
        self.runs = _runs(self.positions.tolist())
        """(first position, length) of each run of consecutive positions in `positions`."""

    def shard(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """The rank's share of `tensor` along `dim` (differentiable: gradients flow to the whole tensor). A
        DTensor split on `dim` over the tensor-parallel ranks (sequence parallelism: the embeddings' output)
        is all-gathered over them first (torch's head-tail order does not follow their contiguous pieces) and
        its share split over them again (a local slice), so sequence parallelism goes on within the share."""
        placements = tensor.placements if isinstance(tensor, DTensor) else None
        if placements is not None and any(p.is_shard(dim % tensor.dim()) for p in placements):
            tensor = tensor.redistribute(placements=[Replicate() if p.is_shard(dim % tensor.dim()) else p
                                                     for p in placements])
        pieces = [tensor.narrow(dim, start, length) for start, length in self.runs]
        share = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)
        return share.redistribute(placements=placements) if placements is not None else share

    def shard_sequences(self, value):
        """Every tensor in `value` (nested) that holds the whole sequence, sharded: an activation whose sequence
        dimension (1) is the whole sequence, and a position table, a tensor that needs no gradient and has a row
        per position (dimension 0), such as torchtitan's `freqs_cis` handed to every block (torchtitan's own
        context parallel shards it on dimension 0 beside the batch's dimension 1). A block that takes the
        table's first rows for its own sequence, `freqs_cis[0:seqlen]`, then reads this rank's positions."""
        from torch.utils import _pytree as pytree

        def one(item):
            if not isinstance(item, torch.Tensor):
                return item
            if item.dim() > ACTIVATION_SEQUENCE_DIM and item.shape[ACTIVATION_SEQUENCE_DIM] == self.seq_len:
                return self.shard(item, ACTIVATION_SEQUENCE_DIM)
            if item.dim() > POSITION_TABLE_DIM and item.shape[POSITION_TABLE_DIM] == self.seq_len \
                    and not item.requires_grad:
                return self.shard(item, POSITION_TABLE_DIM)
            return item

        return pytree.tree_map(one, value)


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for position in positions:
        if runs and runs[-1][0] + runs[-1][1] == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return runs


def shard_block_inputs(blocks, shards: "SequenceShards"):
    """Hooks that hand each block (a transformer layer) its rank's share of every whole-sequence input:
    the first block's hidden states, and the position embeddings the model computed for the whole
    sequence (rotary cos/sin) at every block; later blocks' hidden states arrive sharded already. What
    runs before the first block (embeddings, positions, masks) sees the whole sequence, so an unmodified
    model keeps its positions right; what runs after the last block (norm, head, loss) sees the shard.
    Returns the hook handles (remove them to undo)."""
    def pre_hook(module, args, kwargs):
        return shards.shard_sequences(args), shards.shard_sequences(kwargs)

    return [block.register_forward_pre_hook(pre_hook, with_kwargs=True) for block in blocks]


def functional_attention(*args, **kwargs):
    """F.scaled_dot_product_attention looked up when called, so that the version torch's context_parallel
    patches in runs (F's attribute is the C builtin torch._C._nn.scaled_dot_product_attention, which is what
    a graph calling F.scaled_dot_product_attention itself would hold on to). The output is laid out as the
    attention kernels lay theirs out, (batch, sequence, heads, features) in memory: the exported graph may
    view it as such (its `.contiguous()` after the transpose was a no-op when traced), and the ring's merged
    output is laid out the other way."""
    out = torch.nn.functional.scaled_dot_product_attention(*args, **kwargs)
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def attention_through_functional(stage) -> int:
    """In a pipeline stage's exported graphs (an fx.GraphModule and its chain modules), call attention as
    F.scaled_dot_product_attention instead of the aten op the export recorded: torch's context_parallel
    reaches attention by patching that function (its MONKEY_PATCH dispatch mode), which an exported graph
    calling aten.scaled_dot_product_attention directly would bypass, attending each rank's queries to its own
    keys only. The arguments are the same. Returns how many calls were redirected."""
    from torch import fx

    redirected = 0
    for graph_module in stage.modules():
        if not isinstance(graph_module, fx.GraphModule):
            continue
        nodes = [n for n in graph_module.graph.nodes
                 if n.op == "call_function" and n.target is _aten.scaled_dot_product_attention.default]
        for node in nodes:
            node.target = functional_attention
        if nodes:
            graph_module.recompile()
            redirected += len(nodes)
    return redirected


@contextmanager
def tensor_parallel_heads_local():
    """Within a `context_parallel` region, F.scaled_dot_product_attention taking tensor-parallel DTensors (q, k, v
    on the "tp" mesh, split on the heads: runtime/distributed/tensor_parallel.py keeps a column-parallel Linear's output a
    DTensor) as their local heads. torch's patched function wraps every tensor it is given as a shard of the
    sequence over the "cp" mesh and refuses a DTensor on another mesh (an AssertionError in its sdpa_input_fn);
    attention is independent per head, so each tensor-parallel rank runs the ring over the cp group on its own
    heads and the output is its heads' share again. Restores the function on exit."""
    import torch.nn.functional as F

    ring = F.scaled_dot_product_attention  # the version context_parallel patched in

    def attend(*args, **kwargs):
        args, kwargs = attention_without_dropout(args, kwargs)  # what NoDropout's mode does, seen by torch.compile
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)]
        if not tensors:
            return _value_width_as_query(ring, args, kwargs)
        like = args[0] if isinstance(args[0], DTensor) else tensors[0]
        for t in tensors:
            if t.device_mesh != like.device_mesh or any(
                    not p.is_replicate() and not (p.is_shard() and p.dim % t.dim() < SEQUENCE_DIM)
                    for p in t.placements):
                raise NotImplementedError(f"context parallel attention takes tensor-parallel q, k, v split on the "
                                          f"batch or heads (dims 0, 1), got {t.placements} on {t.device_mesh}")
        out = _value_width_as_query(ring, tuple(_to_local(a) for a in args),
                                    {k: _to_local(v) for k, v in kwargs.items()})
        return DTensor.from_local(out, like.device_mesh, like.placements, run_check=False)

    F.scaled_dot_product_attention = attend
    try:
        yield
    finally:
        F.scaled_dot_product_attention = ring


def _value_width_as_query(attention, args: tuple, kwargs: dict):
    """`attention(*args, **kwargs)`, on CPU with values as wide as the queries and keys: a value head narrower than
    the query's (DeepSeek's multi-head latent attention: 192-wide q and k, 128-wide v) sends the CPU's SDPA to its
    math path, which the ring (register_cpu_ring_attention: the CPU flash kernel's) does not replace. The values
    are padded with zero features and the output cut back: each output feature is the same weighted sum of the
    same value feature (the padding's outputs are zeros, and their gradients reach nothing)."""
    if len(args) < 3 or args[0].device.type != "cpu" or args[2].shape[-1] >= args[0].shape[-1]:
        return attention(*args, **kwargs)
    query, value, width = args[0], args[2], args[2].shape[-1]
    padded = torch.nn.functional.pad(value, (0, query.shape[-1] - width))
    return attention(*args[:2], padded, *args[3:], **kwargs)[..., :width]


def _to_local(value):
    return value.to_local() if isinstance(value, DTensor) else value


@contextmanager
def load_balanced(causal: bool):
    """Within: torch's ring balances the causal triangle over the ranks (its head-tail load balancing,
    `_cp_options.enable_load_balance`) exactly when the attention is `causal`; the setting is restored after."""
    from torch.distributed.tensor.experimental._attention import _cp_options

    saved, _cp_options.enable_load_balance = _cp_options.enable_load_balance, causal
    try:
        yield
    finally:
        _cp_options.enable_load_balance = saved


class ContextParallelRegion:
    """Where a micro-batch's forward, loss and backward run under context parallelism (the step enters it
    per micro-batch): torch's `context_parallel` over the mesh's "cp" ranks, whose ring attention
    (register_cpu_ring_attention on CPU) runs the model's SDPA calls, with the load balancing of the causal
    triangle when the attention is causal; the targets' sequence tensors cut to the rank's share in the same
    order; and the hooks (shard_block_inputs) feeding the block of the first attention call and every chain
    module after it its share of each whole-sequence input."""

    def __init__(self, cp_mesh: "DeviceMesh", module: torch.nn.Module, blocks: "AttentionBlocks") -> None:
        from autoplan.runtime.distributed.recompute import submodule

        register_cpu_ring_attention()
        self.mesh, self.attention = cp_mesh, blocks
        """The 1-D "cp" mesh; the AttentionBlocks (runtime/distributed/attention_blocks.py)."""
        self.blocks = [submodule(module, path) for path in blocks.modules]

    @contextmanager
    def __call__(self, targets):
        """Yields the rank's share of `targets` (every tensor whose dimension 1 is the attention's sequence,
        cut; the others as they are); the forward, the loss and its backward run inside."""
        from torch.distributed.tensor.experimental import context_parallel
        from torch.utils import _pytree as pytree

        seq_len = self.attention.sequence_length
        leaves, spec = pytree.tree_flatten(targets)
        cut = [isinstance(t, torch.Tensor) and t.dim() > ACTIVATION_SEQUENCE_DIM
               and t.shape[ACTIVATION_SEQUENCE_DIM] == seq_len for t in leaves]
        if not any(cut):
            shapes = [tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor)]
            raise UserError(f"context parallelism cuts the targets to the rank's share of the sequence, but no "
                            f"target tensor has the attention's {seq_len} tokens along dimension "
                            f"{ACTIVATION_SEQUENCE_DIM} (shapes {shapes})")
        local = [t.clone() if c else t for t, c in zip(leaves, cut)]  # context_parallel shards them in place
        buffers = [t for t, c in zip(local, cut) if c]
        handles = []
        try:
            with load_balanced(self.attention.causal), context_parallel(
                    self.mesh, buffers=buffers, buffer_seq_dims=[ACTIVATION_SEQUENCE_DIM] * len(buffers),
                    no_restore_buffers=set(buffers)), tensor_parallel_heads_local():
                shards = SequenceShards(self.mesh, seq_len, buffers[0].device)
                handles = shard_block_inputs(self.blocks, shards)
                yield pytree.tree_unflatten(local, spec)
        finally:
            for handle in handles:
                handle.remove()


@contextmanager
def causal_mask_as_is_causal(positions_given: bool):
    """While the model is exported for pipeline stages under context parallelism: transformers decides on its
    causal mask as it does when it runs eagerly on an unpadded batch of one sequence per row, where it passes
    is_causal=True to SDPA and no mask. Under torch.export it cannot read the values it decides on, so it keeps the
    mask; here its two tests (transformers.masking_utils) answer from what is known without values:

    - find_packed_sequence_indices: no packed sequences when the model made its position ids itself
      (`positions_given` False: its inputs hold none; transformers then numbers each row 0..S-1), else its own
      answer (a mask);
    - _ignore_causal_mask_sdpa: the mask is left to is_causal when it would be exactly SDPA's causal triangle (no
      padding mask, as many queries as keys at the same offset, no window shorter than the sequence), else its
      own answer (a mask).

    transformers keeps the mask under export because an exported graph fixes is_causal for the example's shapes
    (pytorch#108108); a pipeline stage's graph has those static shapes anyway. A mask kept is refused by
    check_maskless. Nothing changes for a model whose library is not transformers (its masking module not loaded)."""
    from autoplan.capture.masks import mask_questions_answered

    with mask_questions_answered(lambda triangle, own: triangle or own(), positions_given):
        yield


def positions_given(model: torch.nn.Module, inputs: Any) -> bool:
    """Whether `inputs` hand `model` position ids (capture/masks.py positions_in)."""
    from autoplan.capture.masks import positions_in
    from autoplan.contract import model_args

    return positions_in(model, *model_args(inputs))


def check_maskless(stage, index: int) -> None:
    """A UserError if an attention call of pipeline stage `index` (its exported graphs) takes a mask tensor: the
    ring attends with is_causal or no mask only."""
    from torch import fx

    for graph_module in stage.modules():
        if not isinstance(graph_module, fx.GraphModule):
            continue
        for node in graph_module.graph.nodes:
            if node.op != "call_function" or node.target not in (functional_attention,
                                                                 _aten.scaled_dot_product_attention.default):
                continue
            mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
            if mask is not None:
                value = mask.meta.get("val") if isinstance(mask, fx.Node) else mask
                what = f" {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
                name = f" ({mask.name})" if isinstance(mask, fx.Node) else ""
                raise UserError(f"context parallelism inside pipeline stages: stage {index}'s attention call "
                                f"{node.name} takes a mask tensor{what}{name}, and torch's ring attention takes "
                                f"is_causal or no mask (a padding, sliding-window or custom mask; use cp=1 or pp=1)")


class PipelineContextParallel:
    """Context parallelism inside pipeline stages (see the module docstring): the export of the stages on this
    rank's share of the sequence, the stages' attention sent to the ring, and the region a schedule step runs in.
    The share is the one SequenceShards gives, with the load balancing the attention's causality asks for, at the
    export and at every step alike, so every stage, the activations they send and the targets agree."""

    def __init__(self, cp_mesh: "DeviceMesh", blocks: "AttentionBlocks", device: torch.device) -> None:
        register_cpu_ring_attention()
        self.mesh, self.attention, self.device = cp_mesh, blocks, device
        """The 1-D "cp" mesh; the AttentionBlocks (runtime/distributed/attention_blocks.py); the compute device."""
        with load_balanced(blocks.causal):
            self.shards = SequenceShards(cp_mesh, blocks.sequence_length, device)

    @contextmanager
    def export(self, model: torch.nn.Module, inputs: Any):
        """Where `model` is exported on `inputs` for the stages: the hooks (shard_block_inputs) hand the blocks this
        rank's share, and transformers leaves its causal mask to is_causal (causal_mask_as_is_causal)."""
        from autoplan.runtime.distributed.recompute import submodule

        handles = shard_block_inputs([submodule(model, path) for path in self.attention.modules], self.shards)
        try:
            with causal_mask_as_is_causal(positions_given(model, inputs)):
                yield
        finally:
            for handle in handles:
                handle.remove()

    def prepare(self, stages: list[torch.nn.Module]) -> None:
        """Send the stages' attention calls to the ring (attention_through_functional); refuse a masked one. Every
        stage, not only this rank's, so that every rank refuses the same plan (rather than waiting on one that
        did)."""
        for index, stage in enumerate(stages):
            attention_through_functional(stage)
            check_maskless(stage, index)

    @contextmanager
    def __call__(self, targets: torch.Tensor | None):
        """Where a schedule step runs (every stage's forward and backward): torch's context_parallel, its ring
        balanced as at the export. Yields the rank's share of `targets` (the last stage's; None elsewhere)."""
        from torch.distributed.tensor.experimental import context_parallel

        seq_len = self.attention.sequence_length
        if targets is not None and (targets.dim() <= ACTIVATION_SEQUENCE_DIM
                                    or targets.shape[ACTIVATION_SEQUENCE_DIM] != seq_len):
            raise UserError(f"context parallelism cuts the targets to the rank's share of the sequence, but the "
                            f"targets {tuple(targets.shape)} do not have the attention's {seq_len} tokens along "
                            f"dimension {ACTIVATION_SEQUENCE_DIM}")
        positions = torch.arange(seq_len, device=self.device).unsqueeze(0)  # what context_parallel shards here
        with load_balanced(self.attention.causal), context_parallel(
                self.mesh, buffers=[positions], buffer_seq_dims=[ACTIVATION_SEQUENCE_DIM],
                no_restore_buffers={positions}), tensor_parallel_heads_local():
            if not torch.equal(positions[0].cpu(), self.shards.positions.long()):
                raise RuntimeError(f"context_parallel gives this rank positions {positions[0].tolist()}, the "
                                   f"stages were exported on {self.shards.positions.tolist()}")
            yield None if targets is None else self.shards.shard(targets, ACTIVATION_SEQUENCE_DIM)
