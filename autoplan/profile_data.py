"""The profile of a model as plain data: what capture + profile hand to the cost model and solver.

Nothing here imports torch, so `cost/` and `solve/` can work from a saved profile.
Every quantity is for ONE forward+backward pass at `ModelProfile.batch_size` samples, in the dtype
the model was captured in (`ModelProfile.dtype`). The cost model scales activations, FLOPs and times
linearly to the micro-batch it plans for.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class OpProfile:
    """One ATen op of the captured forward graph, with what its backward costs."""

    node: str
    """Name of the FX node in the captured graph (unique within the graph)."""
    op: str
    """ATen overload, e.g. "aten.linear.default"."""
    module: str
    """Fully qualified name of the innermost nn.Module that ran this op ("" for the root module)."""
    module_stack: tuple[str, ...]
    """Every enclosing module's FQN, outermost first, excluding the root; empty for root-level ops."""
    inputs: tuple[str, ...]
    """Names of the op nodes whose outputs this op reads (data-flow edges; graph inputs excluded)."""
    params: tuple[str, ...]
    """FQNs of the parameters (and buffers) this op reads directly, e.g. "layers.0.weight"."""
    input_shapes: tuple[tuple[int, ...], ...]
    """Shapes of the tensor arguments, in argument order."""
    dtype: str
    """dtype of the (first) output, e.g. "float32"."""
    flops_fwd: float
    """Forward FLOPs (a multiply-add counts 2)."""
    flops_bwd: float
    """Backward FLOPs of this op (gradients w.r.t. inputs that need them and parameters)."""
    input_bytes: int
    """Bytes of all tensor inputs read (activations and parameters)."""
    output_bytes: int
    """Bytes of all tensor outputs."""
    saved_bytes: int
    """Bytes this op adds to what autograd keeps for backward, each tensor counted once in the graph."""
    time_fwd_s: float
    """Forward time on the profiled device, seconds."""
    time_bwd_s: float
    """Backward time on the profiled device, seconds."""
    source: str
    """"measured" (timed on the local device) or "estimated" (roofline on a hardware profile)."""
    output_shapes: tuple[tuple[int, ...], ...] = ()
    """Shapes of the tensor outputs, in order (empty in profiles saved before they were recorded): which
    dimensions an op keeps, e.g. a norm's reduction over the head dimension only."""
    dropout_p: float = 0.0
    """The op's dropout probability argument as the capture (in training mode) called it, e.g.
    scaled_dot_product_attention's dropout_p; 0 when it has none."""
    dims: tuple[int, ...] | None = None
    """The dimensions the op computes along, from its schema's int arguments named dim, dims, dim0 or dim1 (a
    softmax's, topk's, sort's, an index_add's dimension, the dimensions a sum reduces, a transpose's two),
    counted from 0 in its first input; () when it takes such an argument left unset (a sum over everything);
    None when it takes none or the profile predates them. Which dimensions an op mixes, where shapes alone
    cannot tell (chain/tensor_parallel.py: what runs on sequence shards)."""


@dataclass(frozen=True)
class ModelProfile:
    """A captured and profiled model."""

    model: str
    """Where the model came from, e.g. "examples/gpt.py:build_model"."""
    batch_size: int
    """Samples in the batch the ops were captured and profiled at."""
    dtype: str
    """dtype of the model's floating-point parameters at capture, e.g. "float32"."""
    device: str
    """"cpu" when timings were measured here, else the hardware profile name used to estimate them."""
    ops: tuple[OpProfile, ...]
    """Every op of the forward graph in topological (execution) order."""
    parameters: dict[str, int] = field(default_factory=dict)
    """Trainable parameter FQN -> number of elements (tied parameters appear once)."""
    parameter_bytes_per_element: int = 4
    """Bytes per parameter element at capture (4 for float32)."""
    tokens_per_sample: int | None = None
    """Sequence length when the inputs are integer token ids, else None."""
    output_nodes: tuple[str, ...] = ()
    """Op nodes whose values are model outputs."""
    capture_method: str = "export"
    """How the graph was captured: "export", "symbolic_trace" or "dispatch" (see autoplan.capture)."""
    unsupported_ops: tuple[str, ...] = ()
    """ATen ops that have no FLOP formula (counted as 0 FLOPs, timed or estimated by bytes)."""
    capture_failures: tuple[str, ...] = ()
    """Why each capture method tried before `capture_method` failed, one line each."""
    op_failures: tuple[str, ...] = ()
    """Ops profiled only in part, one line each: not replayable on fake tensors (counted as 0 FLOPs and
    nothing saved) or not timeable on this machine (estimated instead)."""
    router_loads: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Experts module FQN -> (token, slot) rows its router sent each expert on the example batch, counted on
    the real model when ops were measured (profile/router_loads.py); empty otherwise."""
    loss_parallel_problem: str = ""
    """Why the loss_fn cannot run on logits sharded on the vocabulary (profile/loss_probe.py); "" if it can."""
    sequence_targets_problem: str = ""
    """Why the targets cannot be cut to a rank's share of the sequence, as context parallelism needs
    (profile/loss_probe.py); "" if they can."""
    masks_left_to_is_causal: bool = False
    """Every attention mask in the captured graph is one transformers leaves to SDPA's is_causal when the program
    runs (capture/masks.py): its SDPA calls run without them (chain/attention.py run_time_saved_bytes)."""
    whole_model_times_s: dict[int, float] = field(default_factory=dict)
    """Batch size -> measured forward+backward seconds of the whole real model on this machine (one
    thread), when ops were measured and the model is small enough (profile/whole_model.py)."""

    @property
    def param_count(self) -> int:
        return sum(self.parameters.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> "ModelProfile":
        raw = json.loads(text)
        ops = tuple(
            OpProfile(**{
                **op,
                "module_stack": tuple(op["module_stack"]),
                "inputs": tuple(op["inputs"]),
                "params": tuple(op["params"]),
                "input_shapes": tuple(tuple(s) for s in op["input_shapes"]),
                "output_shapes": tuple(tuple(s) for s in op.get("output_shapes", ())),
                "dims": tuple(op["dims"]) if op.get("dims") is not None else None,
            })
            for op in raw.pop("ops")
        )
        raw["output_nodes"] = tuple(raw.get("output_nodes", ()))
        raw["unsupported_ops"] = tuple(raw.get("unsupported_ops", ()))
        raw["capture_failures"] = tuple(raw.get("capture_failures", ()))
        raw["op_failures"] = tuple(raw.get("op_failures", ()))
        raw["router_loads"] = {name: tuple(counts) for name, counts in raw.get("router_loads", {}).items()}
        raw["whole_model_times_s"] = {int(b): float(t) for b, t in raw.get("whole_model_times_s", {}).items()}
        return ModelProfile(ops=ops, **raw)
