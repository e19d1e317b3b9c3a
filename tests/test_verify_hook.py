"""train.py is the program a user runs (issue 29): no verify-only flags and no second training loop; `autoplan verify`
reaches into its loop at one hook (runtime.verify_hook, runtime/harness/hooks.py), which does nothing unless verify set
AUTOPLAN_VERIFY, and trains the single-device reference in its own harness (runtime/harness/reference.py). The gradient check
still sees a gradient the loop scales wrongly after clipping."""

import ast
from pathlib import Path

import pytest
import torch

from autoplan.errors import UserError
from autoplan.runtime import VerifyHook, verify_hook
from autoplan.runtime.harness.hooks import VERIFY_ENV, VerifyChecks, verify_environment
from autoplan.verify import VerifySettings, verify
from test_dropout import CALLS_PER_FORWARD, model_and_input
from test_verify import CASES, write_out

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = (ROOT / "autoplan" / "codegen" / "templates" / "train.py", ROOT / "tests" / "golden" / "train.py")
USER_FLAGS = {
    "--steps", "--device",  # what to run
    "--lr", "--min-lr", "--warmup-steps", "--decay-steps", "--weight-decay", "--betas", "--clip-grad-norm",  # AdamW
    "--process-group-timeout", "--model-file", "--plan", "--compile",  # how
    "--checkpoint-dir", "--checkpoint-every", "--resume", "--keep-checkpoints",  # checkpoints
    "--losses-out", "--metrics-out", "--profile", "--tensorboard",  # what it records
}
"""train.py's flags: each one a user training the model sets."""
VERIFY_ONLY_FLAGS = {"--reference", "--no-dropout", "--dropout-out", "--gradients-out"}
"""The flags train.py had for autoplan verify only (RUNTIME_API 10)."""


def flags(path: Path) -> set[str]:
    """Every option string a program's parser.add_argument calls name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            found |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return found


@pytest.mark.parametrize("program", PROGRAMS, ids=["template", "golden"])
def test_train_py_has_only_the_flags_a_user_needs_and_one_training_loop(program):
    assert flags(program) == USER_FLAGS
    assert not flags(program) & VERIFY_ONLY_FLAGS
    text = program.read_text()
    assert "train_reference" not in text and "NoDropout" not in text and "save_gradients" not in text
    assert text.count("optimizer.step()") == 1  # the one loop a user reads is the one verify runs


def test_the_hook_does_nothing_unless_verify_set_it():
    model, x = model_and_input()
    hook = verify_hook({})
    assert type(hook) is VerifyHook
    with hook.step():
        assert not torch.allclose(model(x), model(x))  # dropout as the model trains
    assert hook.gradients_clipped(object()) is None  # nothing to write, nothing touched


def test_verifys_hook_turns_dropout_off_in_each_step():
    model, x = model_and_input()
    hook = verify_hook(verify_environment(None))
    assert isinstance(hook, VerifyChecks) and hook.gradients_out is None
    for _ in range(2):  # entered again in every step
        with hook.step():
            assert torch.equal(model(x), model(x))
    assert hook.dropout.calls == 2 * 2 * CALLS_PER_FORWARD  # two steps, two forwards each
    assert not torch.allclose(model(x), model(x))  # and on again between steps
    assert verify_hook(verify_environment(Path("grads"))).gradients_out == Path("grads")


@pytest.mark.parametrize("value", ["not json", "[1]", '{"gradient_out": "x"}'])
def test_a_mistaken_verify_variable_is_one_line(value):
    with pytest.raises(UserError, match=f"{VERIFY_ENV}=.*unset it to train as written"):
        verify_hook({VERIFY_ENV: value})


CLIP_LINE = "            grad_norm = parallel.clip_grad_norm_(args.clip_grad_norm)"
"""train.py's clipping: the gradients after it are the ones verify compares."""


@pytest.mark.slow
def test_verify_catches_a_gradient_scaled_after_clipping_by_the_factor(tmp_path):
    """A loop that scales every gradient by 1.5 after clipping: verify's gradient check, fed by the hook on every rank
    and by the harness's reference, fails by the factor on every parameter (AdamW's update hardly depends on a
    gradient's scale, so the losses alone need not show it)."""
    model_text, model_file, plan_args = CASES["mlp dp=2 DDP, 2 accumulated micro-batches"]
    out = write_out(tmp_path, model_text, plan_args, model_file)
    train_py = out / "train.py"
    lines = train_py.read_text().splitlines(keepends=True)
    clip = [i for i, line in enumerate(lines) if line.startswith(CLIP_LINE)]
    assert len(clip) == 1
    lines[clip[0] + 1:clip[0] + 1] = ["            for p in parallel.parameters():\n", "                p.grad.mul_(1.5)\n"]
    train_py.write_text("".join(lines))
    result = verify(out, VerifySettings(steps=2, timeout_s=300))
    assert not result.passed and not result.gradients.problem, result
    assert result.gradient_max_rel_diff == pytest.approx(0.5, rel=1e-3)  # (1.5 g - g) / g on every parameter
