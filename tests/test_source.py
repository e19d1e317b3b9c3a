"""Loading model.py by the contract: every broken file is one clear UserError."""

import pytest

from autoplan.errors import UserError
from autoplan.contract import call_user, load_source, split_spec

GOOD = """
import torch
def build_model():
    return torch.nn.Linear(4, 2)
def other():
    return torch.nn.Linear(4, 3)
def example_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randn(batch_size, 2)
"""


def write(tmp_path, text, name="model.py"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_loads_the_contract(tmp_path):
    source = load_source(str(write(tmp_path, GOOD)))
    assert source.factory_name == "build_model"
    assert source.loss_fn is None
    assert source.build_model().out_features == 2


def test_factory_can_be_named(tmp_path):
    path = write(tmp_path, GOOD)
    assert split_spec(f"{path}:other") == (path, "other")
    assert load_source(f"{path}:other").build_model().out_features == 3


@pytest.mark.parametrize("content, message", [
    ("", "empty"),
    (b"\x00\x01binary", "binary"),
    ("def build_model(:\n", "syntax error in .*model.py:1"),
    ("import no_such_module_xyz\n", "model.py imports no_such_module_xyz, which is not installed and not a module or package in "),
    ("raise RuntimeError('boom')\n", "importing model.py failed \\(model.py:1\\): RuntimeError: boom"),
    ("def build_model(): pass\n", "must define example_batch"),
    ("x = 1\n", "must define build_model\\(\\) and example_batch"),
])
def test_broken_files_give_one_clear_error(tmp_path, content, message):
    with pytest.raises(UserError, match=message):
        load_source(str(write(tmp_path, content)))


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_source(str(tmp_path / "nope.py"))


def test_factory_that_raises_names_the_line(tmp_path):
    source = load_source(str(write(tmp_path, GOOD + "\ndef bad():\n    raise ValueError('no weights')\n")))
    with pytest.raises(UserError, match=r"bad\(\) in model.py raised \(model.py:\d+\): ValueError: no weights"):
        call_user(source, "bad()", source.module.bad)
