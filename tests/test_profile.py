"""Profile: FLOPs against closed forms, saved activations against autograd, parameters, roofline times,
and measured times on this CPU."""

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest
import torch

from autoplan.capture import capture_model
from autoplan.errors import UserError
from autoplan.hardware.profiles import load_hardware
from autoplan.profile import measure, profile_graph, profile_model
from autoplan.profile_data import ModelProfile
from autoplan.report.unsupported import unsupported_ops_text
from autoplan.contract import load_source

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
BATCH = 2


@pytest.fixture(scope="module")
def a100():
    return load_hardware("a100-sxm4-80gb")


@pytest.fixture(scope="module")
def gpt_source():
    return load_source(str(EXAMPLES / "gpt.py"))


@pytest.fixture(scope="module")
def gpt_graph(gpt_source):
    return capture_model(gpt_source, BATCH)


@pytest.fixture(scope="module")
def gpt(gpt_graph, gpt_source, a100):
    return profile_graph(gpt_graph, gpt_source.spec, BATCH, a100, measure=False)


def _ops(profile, op):
    return [o for o in profile.ops if o.op == op]


def test_mlp_flops_equal_the_closed_form_exactly(a100):
    source = load_source(str(EXAMPLES / "mlp.py"))
    m = source.module
    batch = 3
    profile = profile_model(source, batch, a100, measure=False)
    forward = 2 * batch * (m.IN_FEATURES * m.HIDDEN + m.LAYERS * m.HIDDEN * m.HIDDEN + m.HIDDEN * m.OUT_FEATURES)
    assert sum(o.flops_fwd for o in profile.ops) == forward
    # weight gradients everywhere; no input gradient for the first layer (its input is data)
    assert sum(o.flops_bwd for o in profile.ops) == 2 * forward - 2 * batch * m.IN_FEATURES * m.HIDDEN
    assert profile.tokens_per_sample is None  # float features, not token ids
    # saved for backward: each linear's input (the first one's for its weight gradient) and each GELU's
    # input; the residual adds keep nothing
    saved_elements = batch * (m.IN_FEATURES + m.LAYERS * 2 * m.HIDDEN + m.HIDDEN)
    assert sum(o.saved_bytes for o in profile.ops) == 4 * saved_elements
    assert profile.param_count == (m.IN_FEATURES + 1) * m.HIDDEN + m.LAYERS * (m.HIDDEN + 1) * m.HIDDEN \
        + (m.HIDDEN + 1) * m.OUT_FEATURES


def test_measured_times_on_this_cpu(a100, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPLAN_CACHE", str(tmp_path))
    profile = profile_model(load_source(str(EXAMPLES / "mlp.py")), 4, load_hardware("cpu"), measure=True)
    assert profile.device == "cpu" and {o.source for o in profile.ops} == {"measured"}
    linears = _ops(profile, "aten.linear.default")
    assert linears and all(o.time_fwd_s > 0 and o.time_bwd_s > 0 for o in linears)


def test_gpt_forward_flops_match_the_transformer_formula(gpt, gpt_source):
    module = gpt_source.module
    layers, h, vocab, seq = module.N_LAYER, module.N_EMBD, module.VOCAB, module.SEQ_LEN
    tokens = BATCH * seq
    matmul_params = layers * 12 * h * h + vocab * h  # qkv 3h^2, proj h^2, mlp 8h^2; tied lm_head
    attention = layers * 4 * BATCH * seq * seq * h  # QK^T and PV, causal counted as full
    expected = 2 * matmul_params * tokens + attention
    total = sum(o.flops_fwd for o in gpt.ops)
    assert total == pytest.approx(expected, rel=0.01)
    assert gpt.unsupported_ops == ()


def test_backward_is_twice_forward_for_matmuls(gpt):
    matmuls = _ops(gpt, "aten.linear.default") + _ops(gpt, "aten.scaled_dot_product_attention.default")
    assert len(matmuls) == 4 * 5 + 1
    for op in matmuls:
        assert op.flops_fwd > 0 and op.flops_bwd == 2 * op.flops_fwd


def test_elementwise_ops_cost_no_flops(gpt):
    for name in ("aten.add.Tensor", "aten.gelu.default", "aten.layer_norm.default"):
        ops = _ops(gpt, name)
        assert ops and all(o.flops_fwd == 0 and o.flops_bwd == 0 for o in ops)
        assert all(o.input_bytes > 0 and o.output_bytes > 0 for o in ops)


def test_parameters_match_the_real_model_with_tied_weights_once(gpt, gpt_source):
    model = gpt_source.build_model()
    assert gpt.param_count == sum(p.numel() for p in model.parameters())
    assert "lm_head.weight" not in gpt.parameters
    head = [o for o in gpt.ops if o.module == "lm_head"]
    assert [o.params for o in head] == [("wte.weight",)]
    assert gpt.output_nodes == (head[0].node,)
    assert gpt.tokens_per_sample == 64 and gpt.dtype == "float32" and gpt.parameter_bytes_per_element == 4


def test_op_inputs_are_op_nodes_in_topological_order(gpt):
    seen = set()
    for op in gpt.ops:
        assert set(op.inputs) <= seen
        seen.add(op.node)


def _whole_model_saved_bytes(source, batch):
    """What autograd keeps after one real forward: distinct storages of saved tensors, no parameters."""
    torch.manual_seed(0)
    model = source.build_model()
    inputs, _ = source.example_batch(batch)
    state = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in state:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(inputs)
    return sum(storages.values())


@pytest.mark.parametrize("method", ["export", "dispatch"])
def test_saved_bytes_sum_to_what_autograd_keeps(gpt_source, a100, method):
    profile = profile_model(gpt_source, BATCH, a100, measure=False, capture_method=method)
    assert sum(o.saved_bytes for o in profile.ops) == pytest.approx(_whole_model_saved_bytes(gpt_source, BATCH),
                                                                     rel=0.02)


def test_saved_bytes_count_each_tensor_once(gpt):
    by_node = {o.node: o for o in gpt.ops}
    for sdpa in _ops(gpt, "aten.scaled_dot_product_attention.default"):
        proj = next(o for o in gpt.ops if sdpa.node in _ancestors(by_node, o) and o.op == "aten.linear.default")
        assert proj.saved_bytes == 0  # its input is a view of the attention output, already saved


def _ancestors(by_node, op, depth=3):
    found = set(op.inputs)
    if depth:
        for name in op.inputs:
            found |= _ancestors(by_node, by_node[name], depth - 1)
    return found


def test_roofline_times_use_the_hardware(gpt, a100):
    gpu = a100.gpu
    assert gpt.device == "a100-sxm4-80gb" and {o.source for o in gpt.ops} == {"estimated"}
    qkv = next(o for o in gpt.ops if o.module == "blocks.0.attn.qkv")
    compute = qkv.flops_fwd / (gpu.peak_flops["fp32"] * gpu.matmul_efficiency)
    memory = (qkv.input_bytes + qkv.output_bytes) / (gpu.memory_bandwidth_bytes_per_s * gpu.memory_efficiency)
    assert qkv.time_fwd_s == pytest.approx(max(compute, memory) + gpu.kernel_overhead_s)
    assert qkv.time_bwd_s > qkv.time_fwd_s
    for view in _ops(gpt, "aten.transpose.int"):
        assert view.time_fwd_s == 0 and view.time_bwd_s == 0
    first = gpt.ops[0]
    assert first.op == "aten.arange.default" and first.time_bwd_s == 0  # nothing to differentiate


def test_bf16_peak_makes_matmuls_faster(gpt_graph, gpt_source, a100, gpt):
    bf16 = profile_graph(gpt_graph, gpt_source.spec, BATCH, a100, measure=False, dtype="bf16")
    fp32_head = next(o for o in gpt.ops if o.module == "lm_head")
    bf16_head = next(o for o in bf16.ops if o.module == "lm_head")
    assert bf16_head.time_fwd_s < fp32_head.time_fwd_s


def test_unknown_dtype_for_the_hardware_is_a_user_error(gpt_graph, gpt_source):
    with pytest.raises(UserError, match=r"v100-sxm2-32gb has no peak FLOP/s for dtype 'bf16': it lists fp16, fp32"):
        profile_graph(gpt_graph, gpt_source.spec, BATCH, load_hardware("v100-sxm2-32gb"), False, dtype="bf16")


def test_profile_round_trips_through_json(gpt):
    assert ModelProfile.from_json(gpt.to_json()) == gpt


def test_dispatch_capture_counts_cpu_attention_flops(gpt_source, a100, gpt):
    profile = profile_model(gpt_source, BATCH, a100, measure=False, capture_method="dispatch")
    attention = _ops(profile, "aten._scaled_dot_product_flash_attention_for_cpu.default")
    assert len(attention) == 4 and all(o.flops_fwd > 0 and o.flops_bwd == 2 * o.flops_fwd for o in attention)
    assert sum(o.flops_fwd for o in profile.ops) == sum(o.flops_fwd for o in gpt.ops)
    assert sum(o.flops_bwd for o in profile.ops) == sum(o.flops_bwd for o in gpt.ops)


def test_measured_times_are_cached_on_disk_per_model_shapes_and_device(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPLAN_CACHE", str(tmp_path))
    timed = []
    original = measure.measure_call

    def counting_measure_call(call, device="cpu", float_dtype=None):
        timed.append(call)
        return original(call, device, float_dtype)

    monkeypatch.setattr(measure, "measure_call", counting_measure_call)
    source = load_source(str(EXAMPLES / "mlp.py"))
    first = profile_model(source, 4, load_hardware("cpu"), measure=True)
    distinct = len(timed)
    assert 0 < distinct < len(first.ops)  # the six identical layers are timed once
    files = list((tmp_path / "timings").glob("*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert saved["key"]["model"] == source.spec and saved["key"]["device"].startswith("cpu: ")
    assert len(saved["timings"]) == distinct + 1  # and the whole model's forward+backward
    assert set(first.whole_model_times_s) == {1, 8} and all(t > 0 for t in first.whole_model_times_s.values())
    second = profile_model(load_source(str(EXAMPLES / "mlp.py")), 4, load_hardware("cpu"), measure=True)
    assert len(timed) == distinct  # nothing timed again
    assert [(o.time_fwd_s, o.time_bwd_s) for o in second.ops] == [(o.time_fwd_s, o.time_bwd_s) for o in first.ops]
    profile_model(source, 3, load_hardware("cpu"), measure=True)  # other shapes: another file
    assert len(list((tmp_path / "timings").glob("*.json"))) == 2 and len(timed) > distinct


def test_ops_too_large_to_time_here_are_estimated_and_listed(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPLAN_CACHE", str(tmp_path))
    monkeypatch.setattr(measure, "MAX_TIMED_OP_BYTES", 1000)
    profile = profile_model(load_source(str(EXAMPLES / "mlp.py")), 4, load_hardware("cpu"), measure=True)
    linears = _ops(profile, "aten.linear.default")
    assert {o.source for o in linears} == {"estimated"} and all(o.time_fwd_s > 0 for o in linears)
    assert any(f.startswith("aten.linear.default: not timed on cpu, estimated instead (") and "timing limit" in f
               for f in profile.op_failures)
    assert "## ops profiled in part" in unsupported_ops_text(profile)


def test_unsupported_ops_text_lists_fallbacks_and_unreplayable_ops(tmp_path, a100):
    path = tmp_path / "routed.py"
    path.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Routed(nn.Module):
            def __init__(self):
                super().__init__()
                self.a = nn.Linear(8, 8)

            def forward(self, x):
                h = self.a(x)
                picked = torch.nonzero(h[:, 0] > 0).flatten()  # data-dependent size
                return h.index_add(0, picked, h[picked])

        def build_model():
            return Routed()

        def example_batch(batch_size):
            return torch.randn(batch_size, 8), torch.randn(batch_size, 8)
    """))
    profile = profile_model(load_source(str(path)), 4, a100, measure=False)
    text = unsupported_ops_text(profile)
    assert profile.capture_method == "dispatch" and len(profile.capture_failures) == 3
    assert text.startswith(f"# {profile.model}: captured by recording the ops of an eager forward")
    assert "## capture methods that failed first\nexport: " in text
    assert any(f.startswith("aten.nonzero.default: not replayed on fake tensors") for f in profile.op_failures)
    assert ModelProfile.from_json(profile.to_json()) == profile


def test_unsupported_ops_text_names_ops_without_a_flop_formula_and_says_when_all_is_well(gpt):
    assert unsupported_ops_text(gpt).endswith("nothing unsupported: every op has a FLOP formula and was replayed "
                                              "and timed or estimated\n")
    lacking = dataclasses.replace(gpt, unsupported_ops=("aten.linear.default",))
    assert "aten.linear.default (17 ops)" in unsupported_ops_text(lacking)


def test_unsupported_ops_text_says_where_op_times_come_from(gpt):
    n = len(gpt.ops)
    measured = dataclasses.replace(gpt, device="cpu", ops=tuple(dataclasses.replace(o, source="measured")
                                                                  for o in gpt.ops))
    assert unsupported_ops_text(measured).splitlines()[1] == f"op times: measured on this machine (cpu), {n} ops"
    mixed = dataclasses.replace(measured, ops=(dataclasses.replace(gpt.ops[0], source="estimated"),
                                               *measured.ops[1:]))
    assert unsupported_ops_text(mixed).splitlines()[1].startswith(
        f"op times: measured on this machine for {n - 1} ops; estimated for cpu by a roofline")
    estimated = dataclasses.replace(gpt, ops=tuple(dataclasses.replace(o, source="estimated") for o in gpt.ops))
    assert unsupported_ops_text(estimated).splitlines()[1].endswith(f"plus a launch cost), {n} ops")
