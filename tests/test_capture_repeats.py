"""Runs of identical blocks are traced three blocks deep and replicated: the result must equal a
capture of the whole model, op by op, and anything that breaks the pattern is captured whole."""

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from autoplan.capture import capture_model
from autoplan.capture.repeats import find_runs
from autoplan.hardware.profiles import load_hardware
from autoplan.profile import profile_graph
from autoplan.contract import load_source

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
H100 = load_hardware("h100-sxm5-80gb")

SHAPES = {
    "llama": dict(VOCAB=256, HIDDEN=64, INTERMEDIATE=128, LAYERS=7, HEADS=4, KV_HEADS=2, SEQ_LEN=16),
    "t5": dict(VOCAB=256, D_MODEL=64, D_FF=128, D_KV=16, HEADS=4, ENCODER_LAYERS=6, DECODER_LAYERS=6,
               SOURCE_LEN=16, TARGET_LEN=8),
    "mlp": {},
}


def _source(name: str, **overrides):
    source = load_source(str(EXAMPLES / f"{name}.py"))
    for constant, value in {**SHAPES[name], **overrides}.items():
        setattr(source.module, constant, value)
    return source


def _rows(graph, source):
    profile = profile_graph(graph, source.spec, 2, H100, measure=False, dtype="bf16")
    return [(o.op, o.module, o.module_stack, o.input_shapes, o.params, o.flops_fwd, o.flops_bwd, o.saved_bytes,
             o.output_bytes, o.time_fwd_s) for o in profile.ops], profile


@pytest.mark.parametrize("name, cloned", [("llama", {"3", "4", "5", "6"}), ("t5", {"4", "5"}),
                                           ("mlp", {"3", "4", "5"})])
def test_replicated_capture_equals_the_whole_capture(name, cloned):
    source = _source(name)
    whole = capture_model(source, 2, reuse_repeats=False)
    reused = capture_model(source, 2)
    assert {n.name.rpartition("__")[2] for n in reused.nodes if "__" in n.name} == cloned
    whole_rows, whole_profile = _rows(whole, source)
    reused_rows, reused_profile = _rows(reused, source)
    assert reused_rows == whole_rows
    assert reused_profile.parameters == whole_profile.parameters
    assert len(reused_profile.output_nodes) == len(whole_profile.output_nodes)


def test_runs_skip_blocks_that_differ_and_ignore_layer_indices():
    t5 = _source("t5").build_model()
    runs = {(r.container, r.start, r.stop) for r in find_runs(t5)}
    # block 0 of each stack owns the relative position bias; the rest differ only in layer_idx
    assert runs == {("encoder.block", 1, 6), ("decoder.block", 1, 6)}


class _Block(nn.Module):
    def __init__(self, sliding: bool) -> None:
        super().__init__()
        self.sliding = sliding
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) if self.sliding else self.fc(x).relu()


def test_alternating_blocks_are_not_a_run():
    model = nn.Sequential(*(_Block(sliding=i % 2 == 0) for i in range(8)))
    assert find_runs(model) == []
    assert len(find_runs(nn.Sequential(*(_Block(True) for _ in range(8))))) == 1


def test_a_loop_that_treats_blocks_differently_is_captured_whole(tmp_path):
    path = tmp_path / "odd.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))

            def forward(self, x):
                for i, block in enumerate(self.blocks):
                    x = block(x) if i % 2 == 0 else block(x).relu()  # the parent decides, per index
                return x

        def build_model():
            return Net()

        def example_batch(batch_size):
            return torch.randn(batch_size, 8), torch.randn(batch_size, 8)
    """))
    graph = capture_model(load_source(str(path)), 2)
    assert not any("__" in n.name for n in graph.nodes)
    assert sum(str(n.target) == "aten.relu.default" for n in graph.nodes) == 3


def test_an_eighty_layer_model_is_traced_three_layers_deep():
    source = _source("llama", LAYERS=80)
    graph = capture_model(source, 2)
    layers = {m for n in graph.nodes for m in n.module_stack if m.count(".") == 2 and m.startswith("model.layers.")}
    assert layers == {f"model.layers.{i}" for i in range(80)}
    traced = {n.module_stack[1] for n in graph.nodes if "__" not in n.name and len(n.module_stack) > 1
              and n.module_stack[1].startswith("model.layers.")}
    assert traced == {"model.layers.0", "model.layers.1", "model.layers.2"}
    with torch.device("meta"):
        expected = {name: p.numel() for name, p in source.build_model().named_parameters()}
    assert graph.parameters == expected
    used = {graph.inputs[r.node].target for n in graph.nodes for r in n.input_refs()
            if r.node in graph.inputs and graph.inputs[r.node].kind == "parameter"}
    assert used == set(expected)  # every layer's weights are read by its own cloned ops
