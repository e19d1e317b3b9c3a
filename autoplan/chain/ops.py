"""The op-kind table: what autoplan knows about an ATen op from its name. One table for the profiler
(which ops ought to have a FLOP formula), the cost model (an op's kind: gemm, attention, memory, view)
and tensor parallelism (which ops a split tensor may pass through).

An op is named by its packet: "aten.linear.default" -> "linear". Its traits:

    view         returns a view of its input: no kernel, no memory traffic
    reshape      moves or copies elements without mixing a feature dimension split evenly into heads
    pointwise    elementwise math: a split tensor stays split
    per_head     attention over heads: each head's output depends on that head's features only
    attention    per_head ops that compute (SDPA, activation x activation matmuls); softmax is per_head
                 only: its cost is the bytes it moves
    gemm         a matmul-like op whose cost is FLOPs (with a weight: a "gemm"; without: "attention")
    splits       cuts a tensor into pieces (what a fused qkv projection's split runs)
    reduction    reduces its input over some dimensions (which ones: the op's input and output shapes)
    norm         normalizes over its trailing dimensions, as many as its weight has (layer and RMS norms)
    loss_parallel  torch's loss_parallel computes it on logits sharded on the vocabulary
    loss         a loss of logits and targets (computed inside a model's forward: HF labels=, nanoGPT targets)
    mask         saves a one-byte bool mask for backward, whatever the training dtype (dropout)
    linear       nn.Linear's own op (tensor-parallel codegen shards Linear modules by name)
    embedding    nn.Embedding's own op
    along        computes along the dimensions its dim arguments name (OpProfile.dims), each output element
                 from the input elements that differ only there: softmax, top-k, sort, cumsum, reductions
    gathers      selects rows of its first input along its dimension (dim 0 for index) by an index tensor
    scatters     writes (adds) rows of a source into its first input along its dimension, at an index tensor
    grouped      a grouped matmul: each row of its first input times the weight of the group its row falls in
                 (the groups' row offsets: its third input)
    creates      makes a new tensor from sizes alone (no input's values): arange, zeros, empty
    summed       a sum (or mean) of its input's elements: over a dimension split into even shards it is the sum
                 (or mean) of the shards' own results, so one all-reduce of its output joins them
"""

from __future__ import annotations

from functools import lru_cache

from autoplan.profile_data import OpProfile

_TABLE = """
linear                                        | linear gemm
addmm mm mv addmv                             | gemm
bmm matmul baddbmm einsum                     | gemm attention per_head
convolution conv1d conv2d conv3d _grouped_mm  | gemm
scaled_dot_product_attention                  | attention per_head
_scaled_dot_product_flash_attention           | attention per_head
_scaled_dot_product_efficient_attention       | attention per_head
_scaled_dot_product_cudnn_attention           | attention per_head
_scaled_dot_product_flash_attention_for_cpu   | attention per_head
softmax _softmax _safe_softmax                | per_head
embedding                                     | embedding
view _unsafe_view transpose permute t         | view reshape
unsqueeze squeeze expand select alias detach  | view reshape
split split_with_sizes chunk unbind narrow    | view reshape splits
slice                                         | view reshape splits
as_strided                                    | view
view_as_complex view_as_real                  | view reshape
reshape contiguous clone cat stack flatten    | reshape
unflatten _to_copy to type_as lift_fresh_copy | reshape
add sub mul div neg pow exp log sqrt rsqrt    | pointwise
abs square tanh sigmoid relu gelu silu erf    | pointwise
sin cos clamp minimum maximum where           | pointwise
masked_fill hardtanh leaky_relu elu mish      | pointwise
softplus gelu_ silu_ relu_ mul_ add_          | pointwise
copy_ copy                                    | pointwise
bernoulli rand_like zeros_like ones_like      | pointwise
dropout native_dropout                        | pointwise mask
mean sum amax amin var var_mean std logsumexp | reduction along
mean sum                                      | summed
prod max min argmax argmin any all            | along
softmax _softmax _safe_softmax log_softmax    | along
topk sort argsort cumsum cumprod histc        | along
bincount                                      | along
floor_divide remainder fmod eq ne lt le gt ge | pointwise
logical_and logical_or logical_not bitwise_and | pointwise
bitwise_not bitwise_or bitwise_xor           | pointwise
div_ sub_ floor_divide_ sigmoid_ exp_         | pointwise
index index_select gather                     | gathers
index_add index_add_ index_put index_put_     | scatters
index_copy index_copy_ scatter scatter_       | scatters
scatter_add scatter_add_ scatter_reduce       | scatters
_grouped_mm grouped_mm_fallback grouped_mm    | grouped
arange zeros empty full ones empty_like       | creates
new_zeros new_empty new_full new_ones         | creates
zeros_like ones_like full_like                | creates
linalg_vector_norm norm                       | reduction
rms_norm _fused_rms_norm layer_norm           | norm
native_layer_norm                             | norm
_log_softmax log_softmax                      | loss_parallel
cross_entropy_loss nll_loss nll_loss_nd       | loss_parallel loss
nll_loss_forward nll_loss2d_forward           | loss_parallel loss
"""
"""Each line: op packets | the traits they all have."""

TRAITS = ("view", "reshape", "pointwise", "per_head", "attention", "gemm", "splits", "mask", "reduction", "norm",
          "loss_parallel", "loss", "linear", "embedding", "along", "gathers", "scatters", "grouped", "creates",
          "summed")


def _parse(table: str) -> dict[str, frozenset[str]]:
    traits: dict[str, set[str]] = {}
    for line in table.strip().splitlines():
        names, _, listed = line.partition("|")
        unknown = set(listed.split()) - set(TRAITS)
        if unknown:
            raise ValueError(f"op table: unknown trait(s) {', '.join(sorted(unknown))} in {line!r}")
        for name in names.split():
            traits.setdefault(name, set()).update(listed.split())
    return {name: frozenset(found) for name, found in traits.items()}


OP_TRAITS: dict[str, frozenset[str]] = _parse(_TABLE)
"""Packet -> its traits (see the module docstring)."""


def ops_with(trait: str) -> frozenset[str]:
    """Every packet of the table that has `trait`."""
    if trait not in TRAITS:
        raise ValueError(f"unknown op trait {trait!r} (known: {', '.join(TRAITS)})")
    return frozenset(name for name, traits in OP_TRAITS.items() if trait in traits)


def packet(op: OpProfile) -> str:
    """"aten.linear.default" -> "linear"."""
    return packet_of(op.op)


@lru_cache(maxsize=None)
def packet_of(op_name: str) -> str:
    """"aten.linear.default" -> "linear" (a bare "linear" stays). Remembered: the tensor-parallel analysis asks
    for every op's packet millions of times on a deep model, from a few hundred distinct names."""
    parts = op_name.split(".")
    return parts[1] if len(parts) > 2 else parts[-1]


def has_trait(op: OpProfile, trait: str) -> bool:
    return trait in OP_TRAITS.get(packet(op), ())


AUTOCAST_LOWER = frozenset("""
linear addmm mm mv addmv addbmm bmm matmul baddbmm einsum convolution conv1d conv2d conv3d conv_transpose1d
conv_transpose2d conv_transpose3d _convolution prelu _grouped_mm scaled_dot_product_attention
_scaled_dot_product_flash_attention _scaled_dot_product_efficient_attention _scaled_dot_product_cudnn_attention
""".split())
"""Op packets torch.autocast runs in the lower precision (bf16) on CUDA: its lower_precision_fp list
(aten/src/ATen/autocast_mode.cpp), matmuls, convolutions and attention. Their inputs are cast to bf16 (the
casts are what they save for backward) and their outputs are bf16."""
AUTOCAST_FP32 = frozenset("""
layer_norm native_layer_norm group_norm native_group_norm softmax _softmax log_softmax _log_softmax pow rsqrt exp
expm1 log log1p log2 log10 reciprocal sum cumsum prod norm logsumexp cross_entropy_loss nll_loss nll_loss_forward
nll_loss2d mse_loss l1_loss smooth_l1_loss huber_loss kl_div binary_cross_entropy_with_logits cosine_similarity
""".split())
"""Op packets torch.autocast runs in float32 on CUDA (its fp32 list): norms, softmax, reductions, losses."""


def autocast_fp32_nodes(ops: tuple[OpProfile, ...] | list[OpProfile]) -> frozenset[str]:
    """The float ops (nodes, in graph order) of a float32 capture whose outputs torch.autocast(bfloat16) keeps
    in float32: AUTOCAST_FP32 ops; and, by type promotion, every other op but AUTOCAST_LOWER's that reads a
    float32 value: a parameter (fp32 weights under autocast), a graph input (no op input) or an fp32 op's output.
    In a Hugging Face transformer that is the embedding's output and the residual stream it feeds (adds, norms),
    while the matmuls, attention and the MLP between them run in bf16. Grouped expert matmuls run in bf16 too,
    though autocast does not cast them: the program casts the experts' weights to the training dtype each forward
    (runtime/distributed/expert_parallel.py) and transformers casts the routed tokens to the weights' dtype; so does the expert
    MLP after them (measured on CPU under autocast: the experts keep bf16 tokens, gate/up outputs and weights)."""
    fp32: set[str] = set()
    for op in ops:
        if op.dtype != "float32" or packet(op) in AUTOCAST_LOWER or is_grouped_matmul_name(packet(op)):
            continue
        if packet(op) in AUTOCAST_FP32 or op.params or not op.inputs or any(i in fp32 for i in op.inputs):
            fp32.add(op.node)
    return frozenset(fp32)


def cost_kind(op: OpProfile) -> str:
    """The cost model's kind: "view" (no kernel), "attention" (activation x activation FLOPs), "gemm"
    (FLOPs against a weight: Linear, conv, grouped expert matmuls) or "memory" (elementwise, norms,
    embedding lookups, softmax: their cost is the bytes they move)."""
    name = packet(op)
    traits = OP_TRAITS.get(name, frozenset())
    if "view" in traits:
        return "view"
    if is_grouped_matmul_name(name) and op.flops_fwd > 0:  # its weights arrive as views of the stacked parameters
        return "gemm"
    if "attention" in traits and not op.params:
        return "attention"
    if ("gemm" in traits or name.startswith("conv")) and op.params and op.flops_fwd > 0:
        return "gemm"
    if "gemm" in traits and op.flops_fwd > 0:
        return "attention"
    return "memory"


def is_grouped_matmul_name(name: str) -> bool:
    """A matmul of row groups by stacked expert weights, by its packet name: aten._grouped_mm, and transformers'
    grouped_mm fallback (what a capture on fake tensors records)."""
    return "grouped_mm" in name


_FLOP_WORDS = frozenset({"mm", "dot", "bilinear", "tensordot", "attention", "conv", "addbmm"})
"""Words of an op name that mark FLOP-costed ops beyond the table's gemm packets (matched per word of
the name split at "_", so "_scaled_dot_product_flash_attention_for_cpu" and "_grouped_mm" count)."""


def counts_flops(op_name: str) -> bool:
    """True for ops whose cost is FLOPs, so a missing FLOP formula matters ("aten.addmm.default")."""
    words = set(packet_of(op_name).split("_"))
    return bool(words & (ops_with("gemm") | _FLOP_WORDS))
