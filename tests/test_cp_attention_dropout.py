"""Context parallelism is refused for a model whose attention drops attention weights (SDPA's dropout_p > 0 in
training): the ring attention runs no dropout (with it the program failed at its first step: "aten.add.Tensor got
mixed torch.Tensor and DTensor", benchmarks/chaos.py's cp run with dropout). The capture records each op's
dropout_p; the same model without attention dropout (its other dropouts kept) is planned with cp."""

from pathlib import Path

import pytest

import autoplan
from autoplan.errors import UserError

MODELS = Path(__file__).resolve().parents[1] / "benchmarks" / "models"


def test_cp_is_refused_where_attention_drops_weights_and_planned_where_it_does_not(tmp_path):
    with pytest.raises(UserError, match=r"cp=2: its attention in 'blocks\.0\.attn' applies dropout to the attention "
                                        r"weights \(dropout_p 0\.1\), which context parallelism's ring attention does "
                                        r"not run \(use cp=1\)"):
        autoplan.plan(str(MODELS / "chaos_gpt.py"), gpus=2, gpu="cpu", pin="cp=2,compile=off", out=str(tmp_path / "a"))
    assert not (tmp_path / "a").exists()
    plan = autoplan.plan(str(MODELS / "chaos_gpt_ring.py"), gpus=2, gpu="cpu", pin="cp=2,compile=off",
                         out=str(tmp_path / "b"))
    assert plan.parallelism.cp == 2


def test_the_capture_records_the_attention_dropout():
    from autoplan.chain.attention import SDPA_PACKETS
    from autoplan.chain.ops import packet

    profile = autoplan.profile(str(MODELS / "chaos_gpt.py"), gpu="cpu", batch_size=2)
    rates = {op.dropout_p for op in profile.ops if packet(op) in SDPA_PACKETS}
    assert rates == {0.1}
    ring = autoplan.profile(str(MODELS / "chaos_gpt_ring.py"), gpu="cpu", batch_size=2)
    assert {op.dropout_p for op in ring.ops if packet(op) in SDPA_PACKETS} == {0.0}
