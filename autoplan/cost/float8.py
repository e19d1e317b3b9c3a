"""float8 linears, priced only: what torchao's float8 training (torchtitan's `float8` converter, tensorwise dynamic
scaling) or Transformer Engine's FP8 does to a Linear's time.

The generated program cannot run float8 (it needs torchao or Transformer Engine and an accelerator with float8
tensor cores), so the planner never chooses it and plan_model refuses to write a program priced with it. It exists
to price published runs that trained with float8 linears (benchmarks/accuracy.py, runs_frontier.csv's
`precision` column) as they ran.

A float8 linear runs its three GEMMs (output, input gradient, weight gradient) at the accelerator's float8 peak
(hardware profile `peak_tflops: fp8`, times Gpu.matmul_efficiency, as torchao's roofline model takes one achievable
fraction for bf16 and float8 GEMMs alike) and pays, around them, the casts of its operands to float8. torchao's
roofline model of tensorwise scaling (torchao/float8/roofline_utils.py, get_float8_mem_sympy) counts per cast of
a tensor of n elements, bf16 in, float8 out:

    amax:  read 2n bytes (a reduction; none when torch.compile fuses it into the kernel that made the tensor)
    cast:  read 2n, write the float8 tensor twice (row- and column-major, for the backward's GEMMs): 4n bytes

and casts the input and the weight in the forward (the input's amax fused with its producer, the weight's not),
the output gradient in the backward (fused), the fp8 input and weight kept for the backward's GEMMs. Each cast's
amax also runs a second, one-element reduction stage: one more kernel launch per cast. In eager mode (no compile)
no amax is fused with its producer: each is its own pass. The output layer stays bf16 (torchtitan's converter
skips "output"; Transformer Engine's FP8 covers the transformer layers), and so do grouped expert matmuls.
Transformer Engine's delayed scaling casts the same operands without amax passes and its weights once per step
(FLOAT8_RECIPES). Memory is priced as for bf16 (what the float8 copies change in the saved activations is not).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.cost.module_costs import OpCost

FLOAT8_PEAK_KEY = "fp8"
"""The hardware profile's peak_tflops key for dense float8 tensor-core FLOP/s (H100 SXM: 1979, datasheet)."""
BF16_BYTES = 2
"""What the cast reads per element (the bf16 operand)."""
FLOAT8_BYTES = 1
"""What it writes per element, twice (row- and column-major)."""
AMAX_BYTES_PER_ELEMENT = BF16_BYTES
"""The amax reduction reads the bf16 tensor once (torchao roofline_utils: kernel 1)."""
CAST_BYTES_PER_ELEMENT = BF16_BYTES + 2 * FLOAT8_BYTES
"""The scaled cast reads the bf16 tensor and writes its float8 copy row- and column-major (roofline_utils:
kernel 3)."""


def is_float8_linear(op: OpCost) -> bool:
    """A weight matmul that float8 training converts: a dense GEMM reading parameters, not the output layer
    (tensor-parallel role "head") nor a grouped expert matmul."""
    return op.kind == "gemm" and op.parameter_bytes > 0 and op.tp_role != "head" and not op.grouped


@dataclass(frozen=True)
class CastElements:
    """Elements of a float8 linear's three cast operands on one rank, for one micro-batch."""

    input: float
    weight: float
    output_gradient: float


def cast_elements(op: OpCost, capture_bytes: int, microbatch: float, tp: int, split: frozenset[str]) -> CastElements:
    """The operands' elements a rank casts: a column-parallel Linear keeps its input whole and holds 1/tp of the
    weight and output; a row-parallel one 1/tp of its input and weight, its output (partial sums) whole; an op on
    sequence shards (sequence parallelism through MoE blocks: a router) 1/tp of its tokens, its weight whole."""
    x = op.input_activation_bytes * microbatch / capture_bytes
    w = op.parameter_bytes / capture_bytes
    y = op.output_bytes * microbatch / capture_bytes
    if tp > 1 and op.tp_role == "colwise":
        w, y = w / tp, y / tp
    elif tp > 1 and op.tp_role == "rowwise":
        x, w = x / tp, w / tp
    elif tp > 1 and op.tp_role in split:
        x, y = x / tp, y / tp
    return CastElements(x, w, y)


@dataclass(frozen=True)
class Float8Recipe:
    """How a float8 training library casts a Linear's operands."""

    name: str
    amax_pass: bool
    """Dynamic scaling: each cast first reduces its tensor's amax (torchao's tensorwise recipe). Delayed scaling
    (Transformer Engine's default DelayedScaling) takes the scale from the amax history the casts record as they
    write: no amax pass, no second reduction stage."""
    fuses_producer: bool | None
    """Whether the amax of the input and of the output gradient rides with the kernel that produced them: under
    torch.compile for torchao (None: as the modules are compiled), always for Transformer Engine (its LayerNormLinear
    and fused activations write the float8 operand)."""
    caches_weights: bool
    """Whether the weight's float8 copy is made once per optimizer step and reused by every micro-batch (Transformer
    Engine's is_first_microbatch, which Megatron-Core passes), or cast again at every forward (torchao: FSDP2
    reshards the weight and the cast runs in the Linear's forward)."""


FLOAT8_RECIPES = {
    "torchao": Float8Recipe("torchao", amax_pass=True, fuses_producer=None, caches_weights=False),
    "transformer_engine": Float8Recipe("transformer_engine", amax_pass=False, fuses_producer=True,
                                       caches_weights=True),
}
"""The float8 recipes priced: torchao's tensorwise dynamic scaling (torchtitan's float8 converter; torchao
roofline_utils.py) and Transformer Engine's delayed scaling (NeMo / Megatron-Core "fp8"; TE docs: DelayedScaling,
Linear.forward is_first_microbatch "caching FP8 weights" across the micro-batches of a step). Transformer Engine's
weight casts, once per step, are not priced: amortized over the step's micro-batches (a 7B layer's weights cast
in ~0.1 ms per step against seconds of compute per micro-batch at long sequence)."""


def recipe(name: str) -> Float8Recipe:
    """The recipe by name; ValueError naming the known ones."""
    if name not in FLOAT8_RECIPES:
        raise ValueError(f"unknown float8 recipe {name!r} (known: {', '.join(FLOAT8_RECIPES)})")
    return FLOAT8_RECIPES[name]


def cast_bytes(elements: CastElements, compiled: bool,
               how: Float8Recipe = FLOAT8_RECIPES["torchao"]) -> tuple[float, float]:
    """Memory traffic of the casts (forward, backward), bytes: per cast CAST_BYTES_PER_ELEMENT, plus, with an amax
    pass, AMAX_BYTES_PER_ELEMENT where the amax is its own pass (always the weight's; the input's and the output
    gradient's unless fused with their producer). Weights cached across micro-batches cost nothing here."""
    fused = how.fuses_producer if how.fuses_producer is not None else compiled
    producer_amax = AMAX_BYTES_PER_ELEMENT if how.amax_pass and not fused else 0.0
    weight_amax = AMAX_BYTES_PER_ELEMENT if how.amax_pass else 0.0
    weight = 0.0 if how.caches_weights else elements.weight * (CAST_BYTES_PER_ELEMENT + weight_amax)
    forward = elements.input * (CAST_BYTES_PER_ELEMENT + producer_amax) + weight
    backward = elements.output_gradient * (CAST_BYTES_PER_ELEMENT + producer_amax)
    return forward, backward


def cast_kernels(compiled: bool, how: Float8Recipe = FLOAT8_RECIPES["torchao"]) -> tuple[int, int]:
    """Kernels the casts launch (forward, backward): per cast the scaled cast, with an amax pass also its second
    (one-element) stage and its first pass where not fused with the producer (the weight's always); none for
    cached weights."""
    fused = how.fuses_producer if how.fuses_producer is not None else compiled
    per_cast = 1 + (1 + (0 if fused else 1) if how.amax_pass else 0)
    per_weight = 0 if how.caches_weights else 1 + (2 if how.amax_pass else 0)
    return per_cast + per_weight, per_cast
