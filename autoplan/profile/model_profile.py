"""Turn a captured OpGraph into a ModelProfile: per op FLOPs, bytes, saved activations and time."""

from __future__ import annotations

from typing import Any

from dataclasses import replace

from autoplan.capture import OpGraph, OpNode, ValueRef, capture_model
from autoplan.hardware.types import HardwareProfile
from autoplan.profile.measure import OpTimer, device_description, measure_device, timed_dtype
from autoplan.profile.replay import FakeReplayer, OpCall, ReplayResult, SavedTensor, op_call
from autoplan.profile.roofline import backward_bytes, peak_flops, roofline_seconds
from autoplan.profile.timing_cache import TimingCache, cache_key
from autoplan.profile_data import ModelProfile, OpProfile
from autoplan.profile.whole_model import time_whole_model
from autoplan.profile.loss_probe import loss_parallel_problem, sequence_targets_problem
from autoplan.profile.router_loads import measure_router_loads
from autoplan.contract import ModelSource


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _new_saved_bytes(graph: OpGraph, node: OpNode, slot_refs: list[ValueRef], saved: tuple[SavedTensor, ...],
                     kept_roots: set[ValueRef]) -> int:
    """Bytes of what this op saves that no earlier op already keeps alive.

    A saved input or output is counted as the whole storage it lives in, once for the graph (a view's
    storage is its base's); parameters, buffers and constants are never counted (kept anyway)."""
    total = 0
    for tensor in saved:
        if tensor.kind == "internal":
            total += tensor.nbytes
            continue
        if tensor.kind == "input":
            ref = slot_refs[tensor.index]
        elif tensor.index < len(node.outputs):
            ref = ValueRef(node.name, tensor.index)
        else:  # an output the graph does not have (the replay ran the accelerator's kernel): new memory
            total += tensor.nbytes
            continue
        if graph.root_is_state(ref):
            continue
        root = graph.storage_root.get(ref, ref)
        if root not in kept_roots:
            kept_roots.add(root)
            total += graph.meta(root).storage_bytes
    return total


def _is_view(graph: OpGraph, node: OpNode) -> bool:
    """True when every output aliases an input (transpose, view, split): no kernel, no traffic."""
    if not node.outputs or node.target._schema.is_mutable:
        return False
    refs = [ValueRef(node.name, i) for i in range(len(node.outputs))]
    return all(graph.storage_root.get(ref, ref) != ref for ref in refs)


class _Timer:
    """Op times: measured on this machine's device when asked and possible, else a roofline on the
    hardware profile."""

    def __init__(self, hardware: HardwareProfile, op_timer: OpTimer | None, dtype: str) -> None:
        peak_flops(hardware.gpu, dtype)  # an unknown dtype is the user's error: say so before any work
        self.gpu, self.dtype = hardware.gpu, dtype
        self.op_timer = op_timer

    def __call__(self, call: OpCall, result: ReplayResult, view: bool, input_bytes: int, output_bytes: int,
                 grad_input_bytes: int, has_backward: bool) -> tuple[float, float, str]:
        if self.op_timer is not None:
            timing = self.op_timer(call, input_bytes + output_bytes)
            if timing is not None:
                return timing.forward_s, timing.backward_s, "measured"
        if view:
            return 0.0, 0.0, "estimated"
        forward = roofline_seconds(result.flops_fwd, input_bytes + output_bytes, self.gpu, self.dtype)
        backward = 0.0
        if has_backward:
            traffic = backward_bytes(input_bytes, output_bytes, grad_input_bytes)
            backward = roofline_seconds(result.flops_bwd, traffic, self.gpu, self.dtype)
        return forward, backward, "estimated"


def _op_timer(graph: OpGraph, model: str, train_dtype: str = "fp32") -> OpTimer:
    """A timer on this machine's device, timing ops as a `train_dtype` plan runs them there (timed_dtype), with
    the on-disk cache of (model, batch shapes, device and timed dtype)."""
    device = measure_device()
    float_dtype = timed_dtype(device, train_dtype)
    inputs = [(name, g.meta.shape, str(g.meta.dtype)) for name, g in graph.inputs.items() if g.kind == "input"]
    return OpTimer(TimingCache.open(cache_key(model, inputs, device_description(device, float_dtype))), device,
                   float_dtype)


DIM_ARGUMENTS = ("dim", "dims", "dim0", "dim1")
"""Schema argument names that say which dimensions of its input an op computes along."""


def dim_arguments(node: OpNode, graph: OpGraph) -> tuple[int, ...] | None:
    """The op's dimension arguments (DIM_ARGUMENTS, read from its schema with their defaults), each counted from 0
    in its first tensor input; None when its schema has none."""
    schema = getattr(node.target, "_schema", None)
    refs = node.input_refs()
    if schema is None or not refs:
        return None
    rank = len(graph.meta(refs[0]).shape)
    found: list[int] | None = None
    for position, argument in enumerate(schema.arguments):
        if argument.name not in DIM_ARGUMENTS:
            continue
        value = _argument_value(node, position, argument)
        found = found or []
        values = value if isinstance(value, (list, tuple)) else () if value is None else (value,)
        found += [int(v) % rank if rank else 0 for v in values if isinstance(v, int)]
    return None if found is None else tuple(found)


def dropout_argument(node: OpNode) -> float:
    """The op's dropout_p argument (read from its schema, its default when left unset), 0.0 when it has none."""
    schema = getattr(node.target, "_schema", None)
    for position, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.name == "dropout_p":
            value = _argument_value(node, position, argument)
            return float(value) if isinstance(value, (int, float)) else 0.0
    return 0.0


def _argument_value(node: OpNode, position: int, argument: Any) -> Any:
    """The value the call gave the schema's argument at `position` (by keyword or position), else its default."""
    if argument.name in node.kwargs:
        return node.kwargs[argument.name]
    if position < len(node.args) and not argument.kwarg_only:
        return node.args[position]
    return argument.default_value


def profile_graph(graph: OpGraph, model: str, batch_size: int, hardware: HardwareProfile, measure: bool,
                  dtype: str = "fp32") -> ModelProfile:
    """Profile every op of `graph`. `dtype`, the training dtype, names the hardware peak the roofline uses
    ("fp32", "bf16") and, measured on a GPU, the dtype the ops are timed in."""
    op_timer = _op_timer(graph, model, dtype) if measure else None
    timer = _Timer(hardware, op_timer, dtype)
    replayer = FakeReplayer(accelerator=hardware.gpu.name != "cpu")
    requires_grad = {ValueRef(name): graph_input.requires_grad for name, graph_input in graph.inputs.items()}
    kept_roots: set[ValueRef] = set()
    weight_of: dict[str, tuple[str, ...]] = {}
    """Nodes computed from parameters alone (a weight cast, transposed or viewed, e.g. a router's
    `F.linear(x.float(), self.weight.float())`): the op reading one multiplies by those parameters."""
    ops: list[OpProfile] = []
    unsupported: set[str] = set()
    replay_errors: dict[str, str] = {}
    for node in graph.nodes:
        call, slot_refs = op_call(node, graph, requires_grad)
        result = replayer(call, len(node.outputs))
        for index, meta in enumerate(node.outputs):
            differentiable = meta.dtype.is_floating_point or meta.dtype.is_complex
            replayed = index < len(result.out_requires_grad) and result.out_requires_grad[index]
            requires_grad[ValueRef(node.name, index)] = differentiable and replayed
        if result.missing_formula:
            unsupported.add(str(node.target))
        if result.error is not None:
            replay_errors.setdefault(str(node.target), result.error)

        input_bytes = sum(graph.meta(ref).nbytes for ref in slot_refs)
        output_bytes = sum(meta.nbytes for meta in node.outputs)
        grad_input_bytes = sum(graph.meta(ref).nbytes for ref, spec in zip(slot_refs, call.slots) if spec.requires_grad)
        has_backward = grad_input_bytes > 0 and any(result.out_requires_grad)
        time_fwd, time_bwd, source = timer(call, result, _is_view(graph, node), input_bytes, output_bytes,
                                           grad_input_bytes, has_backward)
        params = [graph.inputs[ref.node].target for ref in slot_refs
                  if ref.node in graph.inputs and graph.inputs[ref.node].kind in ("parameter", "buffer")]
        params += [p for ref in slot_refs for p in weight_of.get(ref.node, ())]
        if slot_refs and all(ref.node in weight_of or ref.node in graph.inputs and
                             graph.inputs[ref.node].kind == "parameter" for ref in slot_refs):
            weight_of[node.name] = tuple(dict.fromkeys(params))  # computed from parameters alone
        ops.append(OpProfile(
            node=node.name,
            op=str(node.target),
            module=node.module,
            module_stack=node.module_stack,
            inputs=tuple(dict.fromkeys(ref.node for ref in slot_refs if ref.node in graph.node_by_name)),
            params=tuple(dict.fromkeys(params)),
            input_shapes=tuple(graph.meta(ref).shape for ref in node.input_refs()),
            dtype=_dtype_name(node.outputs[0].dtype) if node.outputs else "",
            flops_fwd=result.flops_fwd,
            flops_bwd=result.flops_bwd,
            input_bytes=input_bytes,
            output_bytes=output_bytes,
            saved_bytes=_new_saved_bytes(graph, node, slot_refs, result.saved, kept_roots),
            time_fwd_s=time_fwd,
            time_bwd_s=time_bwd,
            source=source,
            output_shapes=tuple(tuple(meta.shape) for meta in node.outputs),
            dims=dim_arguments(node, graph),
            dropout_p=dropout_argument(node),
        ))
    op_failures = [f"{op}: not replayed on fake tensors, counted as 0 FLOPs and nothing saved ({error})"
                   for op, error in sorted(replay_errors.items())]
    if op_timer is not None:
        op_timer.cache.save()
        op_failures += [f"{op}: not timed on {op_timer.device}, estimated instead ({error})"
                        for op, error in sorted(op_timer.errors.items())]
    return ModelProfile(
        model=model,
        batch_size=batch_size,
        dtype=_dtype_name(graph.param_dtype),
        device=op_timer.device if op_timer is not None else hardware.gpu.name,
        ops=tuple(ops),
        parameters=dict(graph.parameters),
        parameter_bytes_per_element=graph.param_dtype.itemsize,
        tokens_per_sample=graph.tokens_per_sample,
        output_nodes=tuple(dict.fromkeys(ref.node for ref in graph.outputs if ref.node in graph.node_by_name)),
        capture_method=graph.method,
        unsupported_ops=tuple(sorted(unsupported)),
        capture_failures=graph.failures,
        op_failures=tuple(op_failures),
        masks_left_to_is_causal=bool(graph.mask_skips) and all(graph.mask_skips),
    )


def profile_model(source: ModelSource, batch_size: int, hardware: HardwareProfile, measure: bool,
                  dtype: str = "fp32", capture_method: str = "auto") -> ModelProfile:
    """Capture `source`'s model at `batch_size` and profile it: times measured on this machine's device
    (the GPU if there is one, else the CPU) when `measure`, else estimated on `hardware` at its `dtype`
    peak."""
    graph = capture_model(source, batch_size, capture_method)
    profile = profile_graph(graph, source.spec, batch_size, hardware, measure, dtype)
    profile = replace(profile, loss_parallel_problem=loss_parallel_problem(source, batch_size),
                      sequence_targets_problem=sequence_targets_problem(source, batch_size))
    if profile.device == "cpu" and any(op.source == "measured" for op in profile.ops):
        profile = replace(profile, whole_model_times_s=_whole_model_times(graph, source, profile))
    if measure:
        parameter_bytes = profile.param_count * profile.parameter_bytes_per_element
        profile = replace(profile, router_loads=measure_router_loads(source, batch_size, parameter_bytes))
    return profile


WHOLE_MODEL_KEY = "whole model forward+backward"
"""Timing-cache entry of the whole-model times: [batch, seconds, batch, seconds, ...]."""


def _whole_model_times(graph: OpGraph, source: ModelSource, profile: ModelProfile) -> dict[int, float]:
    """time_whole_model, kept in the op timing cache: plans of the same model on this machine then
    rest on the same measurement (planning stays deterministic)."""
    cache = _op_timer(graph, source.spec).cache
    entry = cache.get(WHOLE_MODEL_KEY)
    if not isinstance(entry, list):
        times = time_whole_model(source, profile.param_count * profile.parameter_bytes_per_element)
        entry = [x for batch, seconds in sorted(times.items()) for x in (batch, seconds)]
        cache.put(WHOLE_MODEL_KEY, entry)
        cache.save()
    return {int(entry[i]): float(entry[i + 1]) for i in range(0, len(entry) - 1, 2)}
