"""Context parallelism is refused for a model whose attention takes a mask tensor it does not leave to is_causal
(tests/models/tiny_gpt.py builds a triu mask for nn.MultiheadAttention): torch's ring attention takes is_causal or no
mask, so train.py stopped at start-up on the plan the planner had accepted. Masks transformers leaves to is_causal at
run time (ModelProfile.masks_left_to_is_causal) stay planned with cp (tests/test_context_parallel*.py)."""

from pathlib import Path

import pytest

import autoplan
from autoplan.errors import UserError

TINY_GPT = Path(__file__).resolve().parent / "models" / "tiny_gpt.py"


def test_cp_is_refused_where_attention_takes_its_own_mask(tmp_path):
    with pytest.raises(UserError, match=r"cp=2: its attention in 'h\.0\.attn' takes a mask tensor that is not a "
                                        r"causal mask the model leaves to is_causal at run time .* context "
                                        r"parallelism's ring attention takes is_causal or no mask \(use cp=1\)"):
        autoplan.plan(str(TINY_GPT), gpus=2, gpu="cpu", global_batch=4, pin="cp=2", out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
