"""Achievable-efficiency factors of the time and memory models, each with its unit and source.

The hardware profile carries the per-device factors (Gpu.matmul_efficiency for large dense GEMMs,
Gpu.memory_efficiency for streaming kernels, Gpu.kernel_overhead_s per launch, Link bus bandwidths
from nccl-tests). The factors here are per op class and per mechanism, the same on every device.
They were set from the literature and checked against the published Megatron-LM runs in
shared/reference/runs.csv (benchmarks/accuracy.py prints the comparison); they are physics, not a fit
per row: one value each for every model and layout.
"""

ATTENTION_EFFICIENCY = 0.55
"""Fraction of dense peak FLOP/s that fused attention kernels sustain, forward and backward, on the
FLOPs autoplan counts (4 b s^2 h forward, causal masking counted as full as Megatron does).
FlashAttention-2 (Dao 2023, Fig. 5-6, A100 bf16, head dim 64-128, seq 2k) reaches 50-70% of peak
forward and 40-55% backward on the causal half it computes; Megatron-LM's 2021 fused
scale-mask-softmax kernels sit lower. Dimensionless."""

GROUPED_GEMM_EFFICIENCY = 0.75
"""Fraction of the dense matmul efficiency (Gpu.matmul_efficiency) that grouped expert matmuls sustain (torch's
_grouped_mm over the stacked expert weights: what transformers' MoE blocks and torchtitan's experts run), forward
and backward. Measured on an H200 with torch 2.11 (benchmarks/gpu_kernels.py, 2026-11-27; figures in
benchmarks/results/gpu_check_h200_20261127/kernels.json): the expert MLP (gate/up and down projections, tokens spread
evenly) at Qwen3-30B-A3B's shapes (128 experts x 1024 rows), DeepSeek-V3-16B's (64 x 1536) and Mixtral-8x7B's
(8 x 2048) ran forward and backward at 0.64, 0.75 and 0.82 of one dense matmul of the same FLOPs: the median. Many
small GEMMs in one launch tile less fully than one large one. Dimensionless."""

BACKWARD_TRAFFIC_FACTOR = 2.0
"""Bytes a backward kernel moves per forward byte: it reads the output gradient and the saved inputs
and writes the input gradients. Dimensionless (roofline convention of profile/roofline.py)."""

GEMM_BACKWARD_KERNELS = 2
"""Kernels a weight matmul launches in backward: input gradient and weight gradient (cuBLAS)."""

LOSS_BUFFER_FACTOR = 3.0
"""Copies of the logits alive at the loss's backward on the last stage: the logits, the log-softmax
output cross_entropy keeps, and the logits gradient. Dimensionless, per logit byte; PyTorch's
MemTracker on a GPT-2-sized model shows 3 x the logits beyond the saved activations
(benchmarks/accuracy.py, one-GPU section)."""

LOSS_FORWARD_PASSES = 4
"""Passes over the logits (each one read or one write of every logit, in the loss's dtype) of the model's loss_fn
forward: torch's cross-entropy runs log_softmax, whose CUDA kernel (cunn_SoftMaxForward over rows longer than a
block) reads each row for its maximum, again for its sum of exponentials, and once more to write the output; the
NLL loss then reads one logit per row. The loss_fn runs outside the captured graph (and outside torch.compile, which
train.py applies per chain module): the capture records no op for it. Measured on an H200 (torch 2.11, traced
kernels, benchmarks/results/gpu_check_h200_20261127b): cunn_SoftMaxForward took 4.03 ms over 8192 x 128256 fp32
logits and 15.70 ms over 32768 x 128256, 3.7 and 3.6 passes at the profile's streaming bandwidth (4.8 TB/s x 0.8;
calibrate measured copies at 4.21 TB/s, where 4 passes take 4.0 and 16.0 ms). Dimensionless."""

LOSS_BACKWARD_PASSES = 5
"""Passes over the logits of the loss's backward: the NLL loss's gradient (a zero-filled logits-sized tensor with
one entry per row: a write), and log_softmax's backward (cunn_SoftMaxBackward: reads the gradient for its sum, then
the gradient and the saved output, and writes the input gradient). Measured as LOSS_FORWARD_PASSES: the softmax
backward took 4.26 and 16.62 ms, 3.9 and 3.8 passes at the profile's bandwidth. Dimensionless."""

FSDP_PREFETCH_UNITS = 2
"""Modules FSDP2 holds unsharded at once: the one computing and the next one prefetched
(fully_shard's implicit forward/backward prefetch of one module ahead)."""

GRADIENT_REDUCE_BYTES = 4
"""Bytes per gradient element the data-parallel reduction moves: fp32, whatever the training dtype.
The generated program reduces in fp32 (FSDP2 MixedPrecisionPolicy(reduce_dtype=float32); DDP over
fp32 parameters under autocast), as Megatron-LM did for bf16 (accumulate_allreduce_grads_in_fp32)."""

TP_DTENSOR_FORWARD_OPS = 2
"""Ops a tensor-parallel Linear runs on DTensors in forward (transpose and addmm of the sharded weight;
counted with a TorchDispatchMode over ColwiseParallel/RowwiseParallel Linears, torch 2.13). Each costs
Gpu.dtensor_op_overhead_s of host time on top of its kernel."""

TP_DTENSOR_BACKWARD_OPS = 7
"""The same count for its backward: transposes, the two matmuls, the bias gradient's sum and a view."""

COMPILE_TIME_FACTOR = {"gemm": 1.0, "attention": 1.0, "pointwise": 1 / 3, "memory": 1.0, "view": 1.0}
"""Time of an op under torch.compile (inductor, applied per chain module as torchtitan compiles each
TransformerBlock) over its eager time, per op class (chain/ops.py: an op's cost kind, and "pointwise" for the
elementwise "memory" ops). Matmuls and attention run the same cuBLAS / FlashAttention (oneDNN on CPU) kernels
either way: 1. Inductor fuses chains of pointwise ops into one kernel that reads the chain's inputs and writes
its outputs once, the intermediates staying in registers: their memory traffic and launches go. What remains
is one pass per fused group. In a Llama block's eager graph the pointwise chains are RMSNorm (upcast, pow,
add, rsqrt, mul, downcast, mul by the weight: 7 passes over the hidden state where the fused kernel makes
about 2), rotary embedding (mul, slice, neg, cat, mul, add on q and k: 6 where fused makes 2) and SwiGLU
(silu then mul: 5 tensor passes where fused makes 3): about a third of the eager traffic, 1/3. Reductions,
softmax outside attention and embedding lookups ("memory") still read their inputs once: 1. Dimensionless.
torchtitan reports 1.16x the throughput of eager with per-block compile for Llama-3.1-8B (sequence 8192,
FSDP on 8 H100s; Liang et al., TorchTitan, ICLR 2025, Table 1); benchmarks/accuracy.py prints the predicted
ratio beside it."""

HOST_ADAMW_TENSOR_OVERHEAD_S = 18e-6
"""Host time of torch's fused AdamW on the CPU per parameter tensor beyond streaming its states, seconds:
64 one-element tensors took 18 us each on this project's machine (one thread, torch 2.13; 142-158 us
unfused). What a CPU-offloaded optimizer step pays per parameter shard."""
