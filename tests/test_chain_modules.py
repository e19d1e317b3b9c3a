"""The module chain: modules, order, glue, per-sample quantities, tied groups, cut bytes."""

from dataclasses import replace
from pathlib import Path

import pytest
from chain_fixtures import gpt_param_formula, gpt_profile

from autoplan.chain.modules import build_chain
from autoplan.profile_data import ModelProfile, OpProfile

FIXTURES = Path(__file__).parent / "fixtures"


def _op(node, stack, inputs=(), params=(), time=1.0, out=4, saved=0):
    return OpProfile(node=node, op="aten.x", module=stack[-1] if stack else "", module_stack=tuple(stack),
                     inputs=tuple(inputs), params=tuple(params), input_shapes=(), dtype="float32",
                     flops_fwd=time, flops_bwd=2 * time, input_bytes=4, output_bytes=out, saved_bytes=saved,
                     time_fwd_s=time, time_bwd_s=2 * time, source="measured")


def _profile(ops, parameters=None, batch=1):
    return ModelProfile(model="hand", batch_size=batch, dtype="float32", device="cpu", ops=tuple(ops),
                        parameters=parameters or {})


def test_gpt_with_many_layers_gives_one_module_per_block():
    chain = build_chain(gpt_profile(n_layer=12))
    assert chain.fqns == ("wte", "wpe", *(f"blocks.{i}" for i in range(12)), "ln_f", "lm_head")


def test_large_modules_are_expanded_until_fine_enough():
    profile = gpt_profile(n_layer=4)
    chain = build_chain(profile)
    assert "blocks.0" not in chain.fqns and "blocks.0.attn" in chain.fqns and "blocks.0.mlp" in chain.fqns
    total = sum(u.time_fwd_s + u.time_bwd_s for u in chain.modules)
    stacks = [op.module_stack for op in profile.ops]
    for module in chain.modules:
        is_leaf = not any(module.fqn in s and s.index(module.fqn) < len(s) - 1 for s in stacks)
        assert is_leaf or (module.time_fwd_s + module.time_bwd_s) / total <= 1 / 8 + 1e-12
    coarse = build_chain(profile, max_module_share=0.5)
    assert coarse.fqns == ("wte", "wpe", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f", "lm_head")


def test_every_module_appears_in_the_module_stack_of_its_own_ops():
    profile = gpt_profile(n_layer=4)
    chain = build_chain(profile)
    by_node = {op.node: op for op in profile.ops}
    for module in chain.modules:
        owned = [by_node[n] for n in module.ops if module.fqn in by_node[n].module_stack]
        assert owned, module.fqn
    assert sorted(n for u in chain.modules for n in u.ops) == sorted(by_node)


def test_glue_ops_attach_to_the_module_before_them_or_the_first():
    chain = build_chain(gpt_profile(n_layer=12))
    modules = {u.fqn: u for u in chain.modules}
    assert "arange" in modules["wte"].ops  # root glue before any module -> first module
    assert "add" in modules["wpe"].ops  # root glue after wpe's embedding


def test_parameters_tied_groups_and_the_closed_form_count():
    profile = gpt_profile(n_layer=12, n_embd=128, vocab=512, seq=64)
    chain = build_chain(profile)
    assert chain.parameter_numel == profile.param_count
    assert chain.parameter_numel == pytest.approx(gpt_param_formula(12, 128, 512, 64) + 2 * 128)  # + ln_f
    (group,) = chain.tied_groups
    assert group.parameter == "wte.weight" and group.modules == (0, len(chain) - 1)
    assert chain.modules[-1].parameter_numel == 512 * 128 and chain.modules[-1].exclusive_parameter_numel == 0
    untied = build_chain(gpt_profile(n_layer=12, tied=False))
    assert untied.tied_groups == () and untied.modules[-1].exclusive_parameter_numel == 512 * 128


def test_quantities_are_per_sample():
    small, large = build_chain(gpt_profile(batch=2)), build_chain(gpt_profile(batch=8))
    for a, b in zip(small.modules[2:], large.modules[2:]):  # position embeddings do not grow with the batch
        assert a.flops_fwd == pytest.approx(b.flops_fwd) and a.saved_bytes == pytest.approx(b.saved_bytes)
        assert a.flops_bwd == pytest.approx(2 * a.flops_fwd)
    assert small.cut_bytes[1:] == pytest.approx(large.cut_bytes[1:])


def test_cut_bytes_follow_the_data_flow():
    seq, h = 64, 128
    chain = build_chain(gpt_profile(n_layer=12, n_embd=h, seq=seq, batch=2))
    residual = seq * h * 4  # one sample's hidden states, float32
    assert chain.cut_bytes[1:] == pytest.approx([residual] * (len(chain) - 2))
    # after wte: the token embeddings and the position ids (arange, glue charged to wte) that wpe reads
    assert chain.cut_bytes[0] == pytest.approx(residual + seq * 8 / 2)


def test_producer_read_by_several_later_modules_is_counted_once_per_cut():
    ops = [_op("a", ("u0",), out=10), _op("b", ("u1",), ("a",), out=20), _op("c", ("u2",), ("a", "b"), out=30)]
    chain = build_chain(_profile(ops), max_module_share=1.0)
    assert chain.fqns == ("u0", "u1", "u2")
    assert chain.cut_bytes == (10, 30)


def test_modules_are_ordered_by_their_first_op_and_containers_expand():
    ops = [_op("x", ("late",), time=0.01), _op("y", ("stack", "stack.0"), ("x",), time=0.01),
           _op("z", ("stack", "stack.1"), ("y",), time=0.01), _op("w", ("early",), ("z",), time=10.0)]
    chain = build_chain(_profile(ops))
    assert chain.fqns == ("late", "stack.0", "stack.1", "early")


def test_a_module_called_again_after_a_sibling_keeps_its_parent_whole():
    """Phi's resid_dropout (and the Megatron GPT's dropout) run after the attention and again after the
    MLP: cut between them, the second call would land on the stage before its input (the program
    refused such plans after they were written). The block stays one module; its neighbours still split."""
    ops = [_op("embed", ("embed",)),
           _op("attn", ("layers", "layers.0", "layers.0.attn"), ("embed",), time=5.0),
           _op("drop1", ("layers", "layers.0", "layers.0.drop"), ("attn",)),
           _op("mlp", ("layers", "layers.0", "layers.0.mlp"), ("drop1",), time=5.0),
           _op("drop2", ("layers", "layers.0", "layers.0.drop"), ("mlp",)),
           _op("attn1", ("layers", "layers.1", "layers.1.attn"), ("drop2",), time=5.0),
           _op("mlp1", ("layers", "layers.1", "layers.1.mlp"), ("attn1",), time=5.0),
           _op("head", ("head",), ("mlp1",))]
    chain = build_chain(_profile(ops))
    assert chain.fqns == ("embed", "layers.0", "layers.1.attn", "layers.1.mlp", "head")
    twice_at_root = [_op("a", ("a",)), _op("b", ("b",), ("a",)), _op("c", ("a",), ("b",))]
    assert build_chain(_profile(twice_at_root)).fqns == ("",)


def test_a_model_whose_root_runs_every_op_is_one_module():
    chain = build_chain(_profile([_op("a", ()), _op("b", (), ("a",))], {"w": 3}))
    assert chain.fqns == ("",) and chain.modules[0].parameter_numel == 3 and chain.cut_bytes == ()


def test_unread_parameters_belong_to_the_module_named_by_their_prefix():
    ops = [_op("a", ("enc",), params=("enc.w",)), _op("b", ("dec",), ("a",))]
    chain = build_chain(_profile(ops, {"enc.w": 5, "dec.unused": 7}), max_module_share=1.0)
    assert [u.parameter_numel for u in chain.modules] == [5, 7]


def test_real_capture_fixture_round_trips_to_the_generators_chain():
    loaded = ModelProfile.from_json((FIXTURES / "gpt_capture.json").read_text())
    synthetic = gpt_profile(n_layer=2, n_embd=32, vocab=96, seq=16, batch=2, device="a100-sxm4-80gb")
    real, fake = build_chain(loaded), build_chain(synthetic)
    assert real.fqns == fake.fqns and real.cut_bytes == fake.cut_bytes and real.tied_groups == fake.tied_groups
    for a, b in zip(real.modules, fake.modules):  # node names differ; what they cost does not
        assert replace(a, ops=(), time_fwd_s=0, time_bwd_s=0) == replace(b, ops=(), time_fwd_s=0, time_bwd_s=0)
        assert a.time_fwd_s == pytest.approx(b.time_fwd_s, rel=1e-3) and len(a.ops) == len(b.ops)
    assert build_chain(replace(loaded, batch_size=1)).modules[2].flops_fwd == pytest.approx(
        2 * build_chain(loaded).modules[2].flops_fwd)


def test_no_module_splits_a_tensor_parallel_pair():
    """A stage boundary between a colwise and its rowwise Linear would send sharded activations across
    stages: modules holding tensor-parallel Linears stay whole modules."""
    from autoplan.chain.tensor_parallel import find_tensor_parallel_plan

    profile = ModelProfile.from_json((FIXTURES / "llama_capture.json").read_text())
    linears = find_tensor_parallel_plan(profile, vocab_parallel=False)
    assert linears  # q/k/v/o_proj and gate/up/down_proj of every layer
    modules = [u.fqn for u in build_chain(profile).modules]
    assert not set(modules) & set(linears)
    assert not [u for u in modules for lin in linears if u.startswith(lin + ".")]
    assert "model.layers.0.self_attn" in modules and "model.layers.0.mlp" in modules
