"""The weight-gradient pass of the zero-bubble schedules, completed for stage outputs no received input reaches.

torch.distributed.pipelining's split backward (stage_backward_input, then stage_backward_weight) computes a
stage's weight gradients only along the paths from its outputs that pass through an op reached from a stage
input requiring gradient (its "intermediates"): the input-gradient pass records the gradient at each such op and
the weight pass resumes from there. A path from an output that no such input reaches is taken by neither pass.
torch covers the case only for stage 0 (its whole backward in the W pass). On any other stage those weights lose
that gradient, or get none: a stage holding a second copy of a tied embedding that reads only the token ids (BART's
decoder embed_tokens beside the encoder's last layer) ends a step with no gradient on it; the copy's sum over the
tied stages then misses it.

SplitBackwardStage records, in the input pass, the stage outputs that no input requiring gradient reaches and their
output gradients, and in the weight pass takes the gradient of the stage's weights from them too. The two parts
are disjoint: an op downstream of an input is never upstream of such an output (it would be reached from the
input), so no gradient is counted twice.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc, construct_reverse_graph, reverse_closure
from torch.utils import _pytree as pytree

UNREACHED = "autoplan_unreached_outputs"
"""The key of the entry SplitBackwardStage adds to torch's param groups: the outputs the input pass did not take."""


def unreached_outputs(outputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor | None] | None,
                      inputs: Sequence[Any]) -> list[tuple[GradientEdge, torch.Tensor]]:
    """(edge, gradient) of each output with a gradient that no input requiring gradient reaches through the
    autograd graph. `output_grads` None: `outputs` is the loss (gradient one)."""
    edges: list[tuple[Node, torch.Tensor]] = []
    for index, output in enumerate(outputs):
        if not isinstance(output, torch.Tensor) or (not output.requires_grad and output.grad_fn is None):
            continue
        grad = torch.ones_like(output) if output_grads is None else output_grads[index]
        node = _get_grad_fn_or_grad_acc(output)
        if grad is not None and node is not None:
            edges.append((GradientEdge(node, output.output_nr if output.grad_fn is not None else 0), grad))
    if not edges:
        return []
    input_nodes = [node for node in (_get_grad_fn_or_grad_acc(t) for t in inputs
                                     if isinstance(t, torch.Tensor) and t.requires_grad) if node is not None]
    reverse = construct_reverse_graph([edge.node for edge, _ in edges])
    reached, _ = reverse_closure(input_nodes, set(), reverse)
    return [(edge, grad) for edge, grad in edges if edge.node not in reached]


def weight_gradients_from(unreached: Sequence[tuple[GradientEdge, torch.Tensor]],
                          weights: Sequence[torch.nn.Parameter]) -> None:
    """Accumulate into the weights' .grad their gradient through the `unreached` outputs (the graph is kept
    for torch's weight pass, which runs next and may share ops with these paths)."""
    weights = [w for w in weights if w.requires_grad]
    if not unreached or not weights:
        return
    grads = torch.autograd.grad([edge for edge, _ in unreached], weights, grad_outputs=[g for _, g in unreached],
                                retain_graph=True, allow_unused=True)
    for weight, grad in zip(weights, grads):
        if grad is None:
            continue
        if weight.grad is None:
            weight.grad = grad
        else:
            weight.grad += grad


class SplitBackwardStage(PipelineStage):
    """A PipelineStage whose weight-gradient pass also takes the outputs no input reaches (module docstring)."""

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type == "input":
            outputs = bwd_kwargs["stage_output"]
            flat = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
            grads = bwd_kwargs["output_grads"]
            flat_grads = None if grads is None else list(grads) if isinstance(grads, (tuple, list)) else [grads]
            unreached = unreached_outputs(flat, flat_grads, pytree.tree_leaves(bwd_kwargs["input_values"]))
            input_grads, param_groups = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            if unreached:
                param_groups = [*param_groups, {UNREACHED: unreached}]
            return input_grads, param_groups
        if backward_type == "weight":
            groups = bwd_kwargs["param_groups"] or []
            for group in groups:
                if UNREACHED in group:
                    weight_gradients_from(group[UNREACHED], list(self.submod.parameters()))
            bwd_kwargs = {**bwd_kwargs, "param_groups": [g for g in groups if UNREACHED not in g]}
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
