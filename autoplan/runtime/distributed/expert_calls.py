"""Experts modules kept as module calls in the exported graph that the pipeline stages are cut from.

Expert parallelism replaces an experts module's forward by all-to-all routing (runtime/distributed/expert_parallel.py). A
pipeline stage is cut from torch.export's graph (runtime/distributed/split.py), where a module's ops are inlined, so there
would be no module left to route through. While the model is exported for the split, `experts_as_calls` makes
each experts module (capture/experts.py's rule: transformers' Mixtral, Qwen2-MoE, OLMoE, ... and
examples/mixtral.py) call one opaque op instead, `autoplan::experts_call(hidden_states, top_k_index,
top_k_weights, fqn) -> Tensor` (a torch.library custom op whose fake implementation gives the output's shape:
that of hidden_states), so the graph holds one node per experts call, naming the module, with the call's three
inputs. The stage builder (runtime/distributed/stage_graph.py) turns that node back into a call of the model's own module,
placed in the stage at the module's FQN with its parameters under the model's names; expert parallelism then
shards it as it shards the module of a model without a pipeline.

The op only stands for the module in the exported graph: nothing runs it (a stage calls the module itself).
Its parameters are not inputs of the op, so the graph does not read them: the stage registers them with the
module.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

import torch
from torch import fx, nn

from autoplan.capture.experts import is_experts_module


@torch.library.custom_op("autoplan::experts_call", mutates_args=())
def experts_call(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 fqn: str) -> torch.Tensor:
    """Stands for `fqn`'s experts module in an exported graph (see the module docstring); never run."""
    raise RuntimeError(f"autoplan::experts_call stands for the experts module {fqn!r} in an exported graph; the "
                       f"pipeline stage calls the module itself")


@experts_call.register_fake
def _experts_call_shape(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        fqn: str) -> torch.Tensor:
    return torch.empty_like(hidden_states)


EXPERTS_CALL = torch.ops.autoplan.experts_call.default
"""The op as it appears in an exported graph's call_function nodes."""


@contextlib.contextmanager
def experts_as_calls(model: nn.Module) -> Iterator[dict[str, nn.Module]]:
    """While inside: every experts module of `model` calls experts_call instead of running its ops. Yields the
    modules by FQN; their forwards are put back on exit."""
    modules = {fqn: sub for fqn, sub in model.named_modules() if is_experts_module(sub)}
    with _forwards_replaced(modules, _opaque_forward):
        yield modules


@contextlib.contextmanager
def _forwards_replaced(modules: dict[str, nn.Module], opaque) -> Iterator[None]:
    """While inside: each module's forward is opaque(module, fqn); the modules' own are put back on exit."""
    replaced = []
    try:
        for fqn, sub in modules.items():
            replaced.append((sub, "forward" in vars(sub), vars(sub).get("forward")))
            sub.forward = opaque(sub, fqn)
        yield
    finally:
        for sub, had_own, own in replaced:
            if had_own:
                sub.forward = own
            else:
                del sub.forward


def _opaque_forward(module: nn.Module, fqn: str):
    """A forward taking the module's own arguments (hidden_states, top_k_index, top_k_weights), positional or by
    name, that calls experts_call."""
    signature = inspect.signature(module.forward)

    def forward(*args, **kwargs) -> torch.Tensor:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        tensors = list(bound.arguments.values())
        if len(tensors) != 3 or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise ValueError(f"{fqn} ({type(module).__name__}) is called with {len(tensors)} argument(s); an "
                             f"experts module takes hidden_states, top_k_index and top_k_weights")
        return experts_call(*tensors, fqn)

    return forward


@torch.library.custom_op("autoplan::module_call", mutates_args=())
def module_call(hidden_states: torch.Tensor, fqn: str) -> torch.Tensor:
    """Stands for the module `fqn` (one tensor in, one of the same shape out: a mixture of experts' block) in an
    exported graph (see modules_as_calls); never run."""
    raise RuntimeError(f"autoplan::module_call stands for the module {fqn!r} in an exported graph; the pipeline "
                       f"stage calls the module itself")


@module_call.register_fake
def _module_call_shape(hidden_states: torch.Tensor, fqn: str) -> torch.Tensor:
    return torch.empty_like(hidden_states)


MODULE_CALL = torch.ops.autoplan.module_call.default


@contextlib.contextmanager
def modules_as_calls(model: nn.Module, fqns: tuple[str, ...]) -> Iterator[None]:
    """While inside: each module named in `fqns` (a module run on each tensor-parallel rank's tokens under sequence
    parallelism, runtime/distributed/tensor_parallel.py run_on_local_tokens) calls module_call instead of running its ops, so
    the pipeline stage calls the model's own module there (the exported graph would fix its views to the whole
    sequence's sizes). Its forward takes one tensor and returns one of the same shape (a transformers MoE block)."""
    with _forwards_replaced({fqn: model.get_submodule(fqn) for fqn in fqns}, _opaque_module_forward):
        yield


def _opaque_module_forward(module: nn.Module, fqn: str):
    signature = inspect.signature(module.forward)

    def forward(*args, **kwargs) -> torch.Tensor:
        bound = signature.bind(*args, **kwargs)
        tensors = [v for v in bound.arguments.values() if isinstance(v, torch.Tensor)]
        if len(tensors) != 1 or len(bound.arguments) != 1:
            raise ValueError(f"{fqn} ({type(module).__name__}) runs on each rank's tokens under sequence parallelism "
                             f"inside a pipeline stage, which needs a forward of one tensor; it takes "
                             f"{', '.join(bound.arguments)}")
        return module_call(tensors[0], fqn)

    return forward


def called_experts(node: fx.Node) -> str | None:
    """The FQN of the experts module (or module run on local tokens: module_call) an exported graph's node stands
    for, None for any other node."""
    if node.op == "call_function" and node.target in (EXPERTS_CALL, MODULE_CALL):
        return node.args[-1]
    return None
