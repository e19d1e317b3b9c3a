"""Every example model, at a tiny config, is captured by torch.export, profiled with per-op FLOPs that
match a closed form, and planned for 8 H100s."""

from pathlib import Path

import pytest
import torch

from autoplan.api import plan_model
from autoplan.hardware.profiles import load_hardware
from autoplan.profile import profile_model
from autoplan.report.csv import ops_frame
from autoplan.contract import load_source

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
BATCH = 2
"""Samples per profiled batch in plan_model (autoplan.api.PROFILE_BATCH_SIZE)."""

TINY = {
    "gpt": {},
    "mlp": {},
    "llama": dict(VOCAB=256, HIDDEN=64, INTERMEDIATE=128, LAYERS=2, HEADS=4, KV_HEADS=2, SEQ_LEN=32),
    "hf_gpt2": dict(VOCAB=256, HIDDEN=64, LAYERS=2, HEADS=4, SEQ_LEN=32),
    "bert": dict(VOCAB=256, HIDDEN=64, INTERMEDIATE=128, LAYERS=2, HEADS=4, SEQ_LEN=32),
    "t5": dict(VOCAB=256, D_MODEL=64, D_FF=128, D_KV=16, HEADS=4, ENCODER_LAYERS=2, DECODER_LAYERS=2,
               SOURCE_LEN=32, TARGET_LEN=16),
    "mixtral": dict(VOCAB=256, HIDDEN=64, INTERMEDIATE=128, LAYERS=2, HEADS=4, KV_HEADS=2, EXPERTS=4,
                    EXPERTS_PER_TOKEN=2, SEQ_LEN=32),
    "vit": dict(IMAGE_SIZE=32, PATCH_SIZE=8, HIDDEN=64, INTERMEDIATE=128, LAYERS=2, HEADS=4, CLASSES=10),
    "unet": dict(IMAGE_SIZE=32, BASE_WIDTH=8, DEPTH=2, CLASSES=5),
}


def tiny_source(name: str):
    source = load_source(str(EXAMPLES / f"{name}.py"))
    for constant, value in TINY[name].items():
        assert hasattr(source.module, constant), f"{name}.py has no {constant}"
        setattr(source.module, constant, value)
    return source


@pytest.fixture(scope="module")
def profiles():
    hardware = load_hardware("h100-sxm5-80gb")
    return {name: profile_model(tiny_source(name), BATCH, hardware, measure=False, dtype="bf16") for name in TINY}


@pytest.mark.parametrize("name", sorted(TINY))
def test_example_is_exported_with_per_op_flops(profiles, name):
    profile = profiles[name]
    assert profile.capture_method == "export" and profile.capture_failures == ()
    assert profile.unsupported_ops == () and profile.op_failures == ()
    ops = ops_frame(profile)
    assert len(ops) == len(profile.ops) and ops["flops_fwd"].sum() > 0
    assert ops["param_bytes"].sum() == profile.param_count * profile.parameter_bytes_per_element


@pytest.mark.parametrize("name", sorted(TINY))
def test_example_is_planned_for_eight_h100s(name):
    predicted = plan_model(tiny_source(name), 8, "h100-sxm5-80gb").plan.predicted
    assert predicted.step_time_s > 0 and predicted.peak_memory_bytes > 0


def _linear_flops(profile, tokens: int) -> float:
    """2 x tokens x (weights of every linear layer): the matmul FLOPs of a forward."""
    return 2 * tokens * sum(n for p, n in profile.parameters.items() if p.endswith("proj.weight"))


def test_llama_flops_are_matmuls_plus_attention(profiles):
    profile, c = profiles["llama"], TINY["llama"]
    tokens = BATCH * c["SEQ_LEN"]
    h, kv = c["HIDDEN"], c["HIDDEN"] // c["HEADS"] * c["KV_HEADS"]
    per_layer = 2 * tokens * (2 * h * h + 2 * h * kv + 3 * h * c["INTERMEDIATE"])
    attention = 4 * BATCH * c["SEQ_LEN"] ** 2 * h
    head = 2 * tokens * h * c["VOCAB"]
    expected = c["LAYERS"] * (per_layer + attention) + head
    assert sum(o.flops_fwd for o in profile.ops) == pytest.approx(expected, rel=1e-6)
    assert _linear_flops(profile, tokens) == c["LAYERS"] * per_layer


def test_mixture_of_experts_counts_only_the_routed_tokens(profiles):
    profile, c = profiles["mixtral"], TINY["mixtral"]
    tokens = BATCH * c["SEQ_LEN"]
    routed = tokens * c["EXPERTS_PER_TOKEN"]
    experts = 2 * routed * 3 * c["HIDDEN"] * c["INTERMEDIATE"]  # gate, up and down, top-k tokens each
    grouped = [o for o in profile.ops if "grouped_mm" in o.op]
    assert len(grouped) == 2 * c["LAYERS"]
    assert sum(o.flops_fwd for o in grouped) == c["LAYERS"] * experts
    assert all(o.flops_bwd == 2 * o.flops_fwd for o in grouped)


def test_convolutions_of_the_unet_match_their_closed_form(profiles):
    """2 x C_in x C_out x k^2 per output pixel (per input pixel for a transposed convolution), with the
    feature-map sizes read off a real forward of the tiny model."""
    source = tiny_source("unet")
    model = source.build_model()
    expected = []

    def count(module, inputs, output):
        k = module.kernel_size[0] * module.kernel_size[1]
        pixels = inputs[0].shape[2:] if isinstance(module, torch.nn.ConvTranspose2d) else output.shape[2:]
        expected.append(2 * BATCH * module.in_channels * module.out_channels * k * pixels.numel())

    for module in model.modules():
        if isinstance(module, (torch.nn.Conv2d, torch.nn.ConvTranspose2d)):
            module.register_forward_hook(count)
    model(source.example_batch(BATCH)[0])
    convs = [o.flops_fwd for o in profiles["unet"].ops if "conv" in o.op]
    assert convs == expected and len(convs) == 3 + 2 * 2 * TINY["unet"]["DEPTH"] + 2


def test_encoder_decoder_takes_two_inputs_and_runs_both_stacks(profiles):
    profile, c = profiles["t5"], TINY["t5"]
    modules = {m for o in profile.ops for m in o.module_stack}
    assert {"encoder.block.1", "decoder.block.1", "lm_head"} <= modules
    assert profile.tokens_per_sample == c["SOURCE_LEN"]
    cross = [o for o in profile.ops if o.module.endswith("EncDecAttention.k")]
    assert cross and all(o.input_shapes[0] == (BATCH, c["SOURCE_LEN"], c["D_MODEL"]) for o in cross)


def test_vision_inputs_are_images_not_tokens(profiles):
    profile = profiles["vit"]
    assert profile.tokens_per_sample is None
    assert profile.param_count == sum(p.numel() for p in tiny_source("vit").build_model().parameters())
