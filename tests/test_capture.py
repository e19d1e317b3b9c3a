"""Capture: export on fake tensors with module attribution, the dispatch fallback, user errors."""

import re
import resource
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import autoplan.capture as capture_package
from autoplan.capture import ValueRef, capture_model
from autoplan.errors import UserError
from autoplan.hardware.profiles import load_hardware
from autoplan.profile import profile_graph
from autoplan.contract import load_source

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
BLOCK = re.compile(r"^blocks\.(\d+)$")


@pytest.fixture(scope="module")
def gpt_graph():
    return capture_model(load_source(str(EXAMPLES / "gpt.py")), 2)


def _model_file(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return load_source(str(path))


def test_gpt_is_captured_by_export_with_token_inputs(gpt_graph):
    assert gpt_graph.method == "export" and gpt_graph.failures == ()
    assert gpt_graph.tokens_per_sample == 64
    assert sum(1 for n in gpt_graph.nodes if str(n.target) == "aten.linear.default") == 4 * 4 + 1


def test_every_op_of_a_block_lands_under_that_block(gpt_graph):
    ops_by_block = defaultdict(list)
    for node in gpt_graph.nodes:
        blocks = [m for m in node.module_stack if BLOCK.match(m)]
        assert len(blocks) <= 1
        if blocks:
            ops_by_block[blocks[0]].append(str(node.target))
            # the stack nests: every inner module's FQN extends the enclosing one
            for outer, inner in zip(node.module_stack, node.module_stack[1:]):
                assert inner.startswith(outer + ".")
    assert sorted(ops_by_block) == [f"blocks.{i}" for i in range(4)]
    sequences = list(ops_by_block.values())
    assert all(seq == sequences[0] for seq in sequences)
    assert sequences[0].count("aten.linear.default") == 4
    assert sequences[0].count("aten.scaled_dot_product_attention.default") == 1


def test_innermost_module_and_root_level_ops(gpt_graph):
    modules = {node.name: node.module for node in gpt_graph.nodes}
    qkv = [n for n in gpt_graph.nodes if n.module == "blocks.2.attn.qkv"]
    assert [str(n.target) for n in qkv] == ["aten.linear.default"]
    assert qkv[0].module_stack == ("blocks.2", "blocks.2.attn", "blocks.2.attn.qkv")
    root_ops = [n for n in gpt_graph.nodes if n.module == ""]
    assert root_ops and all(n.module_stack == () for n in root_ops)
    assert modules[gpt_graph.outputs[0].node] == "lm_head"


def test_tied_weights_are_one_parameter(gpt_graph):
    params = {gpt_graph.inputs[r.node].target for n in gpt_graph.nodes for r in n.input_refs()
              if r.node in gpt_graph.inputs and gpt_graph.inputs[r.node].kind == "parameter"}
    assert "lm_head.weight" not in params and "wte.weight" in params
    head = [n for n in gpt_graph.nodes if n.module == "lm_head"][0]
    assert [gpt_graph.inputs[r.node].target for r in head.input_refs() if r.node in gpt_graph.inputs] == ["wte.weight"]
    assert "lm_head.weight" not in gpt_graph.parameters


def test_no_grad_regions_are_inlined_and_marked(tmp_path):
    # What autoplan needs from export: ops a model runs under no_grad (a rotary table, a running statistic)
    # come out inlined under their module and marked as building no autograd graph, and the rest not.
    source = _model_file(tmp_path, "no_grad.py", """
        import torch
        from torch import nn

        class Table(nn.Module):
            def forward(self, x):
                with torch.no_grad():
                    return torch.arange(x.shape[1], dtype=x.dtype).cos()

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.table = Table()
                self.fc = nn.Linear(8, 8)

            def forward(self, x):
                return self.fc(x + self.table(x))

        def build_model():
            return M()

        def example_batch(batch_size):
            return torch.randn(batch_size, 8), torch.randn(batch_size, 8)
    """)
    graph = capture_model(source, 2)
    assert graph.method == "export"
    marked = {n.module for n in graph.nodes if not n.grad_enabled}
    assert marked == {"table"}
    assert all(n.grad_enabled for n in graph.nodes if n.module == "fc")


def test_dict_batch_becomes_kwargs_and_hf_llama_exports(tmp_path):
    source = _model_file(tmp_path, "llama.py", """
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        def build_model():
            return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=4,
                                                num_key_value_heads=2, max_position_embeddings=64))

        def example_batch(batch_size):
            ids = torch.randint(0, 256, (batch_size, 17))
            return {"input_ids": ids[:, :-1]}, ids[:, 1:]
    """)
    graph = capture_model(source, 3)
    assert graph.method == "export" and graph.tokens_per_sample == 16
    assert graph.inputs["input_ids"].meta.shape == (3, 16)
    layers = {m for n in graph.nodes for m in n.module_stack if re.fullmatch(r"model\.layers\.\d+", m)}
    assert layers == {"model.layers.0", "model.layers.1"}
    profile = profile_graph(graph, source.spec, 3, load_hardware("h100-sxm5-80gb"), measure=False)
    assert sum(o.flops_fwd for o in profile.ops) > 0 and profile.unsupported_ops == ()
    assert profile.param_count == sum(graph.parameters.values()) > 0


CUSTOM_OUTPUT = """
    import torch
    from torch import nn

    class Output:  # not a pytree: torch.export rejects it, eager execution does not care
        def __init__(self, y):
            self.y = y

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.b = nn.Linear(16, 4)

        def forward(self, x):
            return Output(self.b(torch.relu(self.a(x))))

    def build_model():
        return Net()

    def example_batch(batch_size):
        return torch.randn(batch_size, 8), torch.randn(batch_size, 4)
"""


def test_custom_output_object_is_captured_by_symbolic_trace(tmp_path):
    graph = capture_model(_model_file(tmp_path, "custom.py", CUSTOM_OUTPUT), 2)
    assert graph.method == "symbolic_trace"
    assert len(graph.failures) == 1 and graph.failures[0].startswith("export: ")
    linears = [n for n in graph.nodes if str(n.target) == "aten.linear.default"]
    assert [n.module_stack for n in linears] == [("a",), ("b",)]
    assert graph.outputs == (ValueRef(linears[-1].name, 0),)
    assert graph.parameters == {"a.weight": 128, "a.bias": 16, "b.weight": 64, "b.bias": 4}


def test_dispatch_fallback_records_ops_when_both_tracers_fail(tmp_path, monkeypatch):
    def broken_tracer(fake):
        raise RuntimeError("tracer cannot handle this")

    monkeypatch.setitem(capture_package._TRACERS, "symbolic_trace", broken_tracer)
    graph = capture_model(_model_file(tmp_path, "custom.py", CUSTOM_OUTPUT), 2)
    assert graph.method == "dispatch"
    assert [f.split(":")[0] for f in graph.failures] == ["export", "symbolic_trace"]
    assert graph.failures[1] == "symbolic_trace: RuntimeError: tracer cannot handle this"
    addmms = [n for n in graph.nodes if str(n.target) == "aten.addmm.default"]
    assert [n.module for n in addmms] == ["a", "b"]
    assert graph.outputs == (ValueRef(addmms[-1].name, 0),)
    assert graph.parameters == {"a.weight": 128, "a.bias": 16, "b.weight": 64, "b.bias": 4}


DATA_DEPENDENT = """
    import torch
    from torch import nn

    class Gate(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.b = nn.Linear(16, 4)

        def forward(self, x):
            h = torch.relu(self.a(x))
            if h.sum().item() > 0:  # data-dependent control flow: fake tensors have no values
                h = h * 2
            return self.b(h)

    def build_model():
        return Gate()

    def example_batch(batch_size):
        return torch.randn(batch_size, 8), torch.randn(batch_size, 4)
"""


def test_data_dependent_forward_is_recorded_on_real_tensors(tmp_path):
    graph = capture_model(_model_file(tmp_path, "gate.py", DATA_DEPENDENT), 2)
    assert graph.method == "dispatch"
    assert [f.split(":")[0] for f in graph.failures] == ["export", "symbolic_trace", "dispatch on fake tensors"]
    assert "recorded on real tensors" in graph.failures[-1]
    assert [n.module for n in graph.nodes if str(n.target) == "aten.addmm.default"] == ["a", "b"]
    assert graph.parameters == {"a.weight": 128, "a.bias": 16, "b.weight": 64, "b.bias": 4}


def test_data_dependent_model_too_large_to_run_for_real_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setattr(capture_package, "REAL_RUN_MAX_STATE_BYTES", 100)
    with pytest.raises(UserError, match=r"cannot capture gate\.py on fake tensors .* 0\.0 GiB of parameters it is "
                                        r"too large to run for real"):
        capture_model(_model_file(tmp_path, "gate.py", DATA_DEPENDENT), 2)


def test_value_dependent_weight_init_falls_back_to_the_meta_device(tmp_path):
    source = _model_file(tmp_path, "trunc.py", """
        import torch
        from torch import nn
        from torch.nn.init import trunc_normal_  # bound at import: the capture's skipping cannot reach it

        def build_model():
            model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
            model[2].weight = model[0].weight  # tied: must stay one parameter
            trunc_normal_(model[0].weight, std=0.02)  # reads values: fails on fake tensors
            model.register_buffer("scale", torch.ones(8))
            return model

        def example_batch(batch_size):
            return torch.randn(batch_size, 8), torch.randn(batch_size, 8)
    """)
    graph = capture_model(source, 2)
    assert graph.method == "export"
    assert graph.parameters == {"0.weight": 64, "0.bias": 8, "2.bias": 8}
    assert all(g.meta.shape for g in graph.inputs.values())


def test_initializers_are_skipped_on_fake_tensors_and_restored(tmp_path):
    """nn.init's initializers called through the module (what nn.Linear and most models do) are skipped while the
    factory runs on fake tensors: a value-reading one no longer sends the factory to the meta device, so the user's
    own bug after it is reported as it is, and torch.nn.init is left as it was."""
    import torch.nn.init

    before = dict(vars(torch.nn.init))
    source = _model_file(tmp_path, "vit2.py", """
        import torch
        from torch import nn

        def build_model():
            model = nn.Linear(8, 8)
            nn.init.trunc_normal_(model.weight, std=0.02)
            config = {"n_embd": 8}
            return nn.Linear(config["n_embd"], config["n_layer"])

        def example_batch(batch_size):
            return torch.randn(batch_size, 8), torch.randn(batch_size, 8)
    """)
    with pytest.raises(UserError) as raised:
        capture_model(source, 2)
    assert str(raised.value).startswith("build_model() in vit2.py raised (vit2.py:9): KeyError: 'n_layer'")
    assert "meta device" not in str(raised.value)
    assert vars(torch.nn.init) == before


def test_export_only_reports_the_export_error(tmp_path):
    with pytest.raises(UserError, match=r"torch\.export of custom\.py failed: RuntimeError"):
        capture_model(_model_file(tmp_path, "custom.py", CUSTOM_OUTPUT), 2, method="export")


def test_batch_that_does_not_fit_the_model_shows_the_shape_error(tmp_path):
    source = _model_file(tmp_path, "bad.py", """
        import torch
        from torch import nn

        def build_model():
            return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

        def example_batch(batch_size):
            return torch.randn(batch_size, 7), torch.randn(batch_size, 4)
    """)
    with pytest.raises(UserError, match=r"forward on example_batch\(2\) in bad\.py raised.*\[2, 7\].*\[8, 16\]"):
        capture_model(source, 2)


def test_errors_in_user_factories_are_one_line(tmp_path):
    source = _model_file(tmp_path, "broken.py", """
        import torch

        def build_model():
            raise ValueError("no such layer")

        def example_batch(batch_size):
            return torch.zeros(batch_size, 2), None
    """)
    expected = r"build_model\(\) in broken\.py raised \(broken\.py:5\): ValueError: no such layer"
    with pytest.raises(UserError, match=expected):
        capture_model(source, 2)


def test_a_billion_parameter_model_allocates_nothing(tmp_path):
    source = _model_file(tmp_path, "big.py", f"""
        import sys
        sys.path.insert(0, {str(EXAMPLES)!r})
        from gpt import GPT, example_batch

        def build_model():
            return GPT(vocab=32000, seq_len=64, n_layer=4, n_head=32, n_embd=4096)
    """)
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    graph = capture_model(source, 2)
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib) / 2**20
    assert sum(graph.parameters.values()) > 0.9e9  # 3.6 GiB of fp32 weights if they were real
    assert grown_gib < 0.5


def test_hf_cache_objects_in_outputs_and_use_cache_in_the_batch(tmp_path):
    body = """
        import torch
        from torch import nn
        from transformers import LlamaConfig, LlamaForCausalLM

        CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

        class Cached(nn.Module):  # insists on a KV cache: outputs a DynamicCache, which export rejects
            def __init__(self):
                super().__init__()
                self.inner = LlamaForCausalLM(CONFIG)

            def forward(self, input_ids, use_cache=None):
                return self.inner(input_ids=input_ids, use_cache=True)

        def build_model():
            return LlamaForCausalLM(CONFIG)

        def build_cached():
            return Cached()

        def example_batch(batch_size):
            ids = torch.randint(0, 256, (batch_size, 17))
            return {"input_ids": ids[:, :-1], "use_cache": True}, ids[:, 1:]
    """
    source = _model_file(tmp_path, "cached.py", body)
    plain = capture_model(source, 2)
    assert plain.method == "export" and len(plain.outputs) == 1  # use_cache=True in the batch is overridden
    # the cache object is dropped from the exported output (as the pipeline's stages drop it): exported, so a
    # pipeline can be planned, and its outputs are the logits alone
    cached = capture_model(load_source(f"{tmp_path / 'cached.py'}:build_cached"), 2)
    assert cached.method == "export" and not cached.failures
    assert [cached.meta(ref).shape for ref in cached.outputs] == [(2, 16, 256)]
    assert sum(1 for n in cached.nodes if str(n.target) == "aten.linear.default") == \
        sum(1 for n in plain.nodes if str(n.target) == "aten.linear.default")


def test_factory_that_casts_to_bf16_keeps_its_tied_weights(tmp_path):
    source = _model_file(tmp_path, "half.py", f"""
        import sys
        import torch
        sys.path.insert(0, {str(EXAMPLES)!r})
        from gpt import GPT, example_batch

        def build_model():
            return GPT(vocab=64, seq_len=64, n_layer=2, n_head=2, n_embd=32).to(torch.bfloat16)
    """)
    graph = capture_model(source, 2)
    assert graph.method == "export" and graph.param_dtype == torch.bfloat16
    assert "lm_head.weight" not in graph.parameters and graph.parameters["wte.weight"] == 64 * 32


def test_a_factory_failing_on_fake_and_meta_tensors_reports_its_own_error(tmp_path):
    """trunc_normal_ reads values (fake tensors stop there); on the meta device the factory gets further and
    fails on its own bug: that is the error to report, not the fake tensors' DataDependentOutputException."""
    source = _model_file(tmp_path, "vit.py", """
        import torch
        from torch import nn
        from torch.nn.init import trunc_normal_

        def build_model():
            model = nn.Linear(8, 8)
            trunc_normal_(model.weight, std=0.02)
            config = {"n_embd": 8}
            return nn.Linear(config["n_embd"], config["n_layer"])

        def example_batch(batch_size):
            return torch.randn(batch_size, 8), torch.randn(batch_size, 8)
    """)
    with pytest.raises(UserError) as raised:
        capture_model(source, 2)
    message = str(raised.value)
    assert message.startswith("build_model() in vit.py raised (vit.py:10): KeyError: 'n_layer' (on the meta device; "
                              "on fake tensors it had stopped earlier at vit.py:8: "), message
    assert "\n" not in message
