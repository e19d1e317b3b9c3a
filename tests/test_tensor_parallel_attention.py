"""Tensor parallelism splits attention by heads as torchtitan does for Llama3 and Qwen3, decided from the captured
ops' shapes: through a per-head QK-norm (HF Qwen3's decomposed RMSNorm, torchtitan's nn.RMSNorm(head_dim)) and
complex rotary embeddings (view_as_complex x freqs_cis, view_as_real); a norm over every head's features at once
(OLMo-2) or a fused qkv split (nanoGPT's c_attn) leaves the attention whole, and the plan says which Linears, the
op and why. A head whose logits feed a loss computed inside forward stays vocabulary-parallel when torch's
loss_parallel computes that loss; otherwise it is left whole with the reason and its cost. The programs these
plans generate are run by tests/test_tensor_parallel_attention_program.py."""

import json
from pathlib import Path

import pytest

from autoplan.api import ProfileOptions, profile_only
from autoplan.chain.tensor_parallel import left_whole_lines, split_lines, tensor_parallel_facts
from autoplan.plan import LeftWhole, Plan
from test_plan import make_plan

MODELS = Path(__file__).parent / "models"

OLMO2 = '''
import torch
from transformers import Olmo2Config, Olmo2ForCausalLM

def build_model():
    return Olmo2ForCausalLM(Olmo2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8,
                                        tie_word_embeddings=False, use_cache=False))

def example_batch(batch_size):
    ids = torch.randint(0, 64, (batch_size, 9))
    return {"input_ids": ids[:, :-1]}, ids[:, 1:]

def loss_fn(output, targets):
    return torch.nn.functional.cross_entropy(output.logits.reshape(-1, 64), targets.reshape(-1))
'''
"""HF OLMo-2: its q_norm and k_norm normalize q_proj's and k_proj's whole outputs, every head at once."""

Z_LOSS = '''
import torch
from torch import nn
from torch.nn import functional as F

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 32)
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, idx, targets):
        x = self.embed(idx)
        x = x + self.down(F.gelu(self.up(x)))
        logits = self.head(x)
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        return F.cross_entropy(logits.view(-1, 64), targets.view(-1)) + 1e-4 * z

def build_model():
    return Model()

def example_batch(batch_size):
    ids = torch.randint(0, 64, (batch_size, 9))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return {"idx": x, "targets": y}, y

def loss_fn(output, targets):
    return output
'''
"""A loss inside forward with a z-loss (logsumexp of the logits), which torch's loss_parallel has no rule for."""


def _facts(spec: str, **options):
    return tensor_parallel_facts(profile_only(spec, "cpu", ProfileOptions(measure=False)), **options)


def _linears(layer: str, names: tuple[str, ...]) -> set[str]:
    return {f"{layer}.{name}" for name in names}


def test_qwen3_attention_splits_by_heads_through_its_per_head_qk_norm():
    facts = _facts(str(MODELS / "tiny_qwen3.py"))
    for i in range(2):
        attention = f"model.layers.{i}.self_attn"
        assert {fqn: facts.plan.get(fqn) for fqn in _linears(attention, ("q_proj", "k_proj", "v_proj", "o_proj"))} \
            == {f"{attention}.q_proj": "colwise", f"{attention}.k_proj": "colwise",
                f"{attention}.v_proj": "colwise", f"{attention}.o_proj": "rowwise"}
        # the norms' weights stay whole, replicated on the tensor-parallel ranks (their gradients summed)
        assert facts.plan[f"{attention}.q_norm"] == facts.plan[f"{attention}.k_norm"] == "replicate"
    assert facts.left_whole == () and facts.sequence_parallel_problem == ""
    assert facts.problems(2) == [] and any("2 attention heads" in p for p in facts.problems(4))  # 2 KV heads


@pytest.mark.parametrize("factory", ["build_model", "build_qk_norm"])
def test_torchtitan_llama_attention_splits_through_complex_rotary_embeddings(factory):
    facts = _facts(f"{MODELS / 'titan_llama_tp.py'}:{factory}")
    attention = "layers.1.attention"
    assert [facts.plan.get(f"{attention}.{w}") for w in ("wq", "wk", "wv", "wo")] == \
        ["colwise", "colwise", "colwise", "rowwise"]
    assert (facts.plan.get(f"{attention}.q_norm") == "replicate") == (factory == "build_qk_norm")
    assert facts.left_whole == () and facts.sequence_parallel_problem == ""


def test_a_norm_over_every_head_at_once_splits_with_its_sum_all_reduced(tmp_path):
    """OLMo-2's q/k RMS norms span every head: each rank's mean over its heads' features is its share of the whole
    mean (SUMMED_OPS), all-reduced over the tp ranks (TensorParallelFacts.rank_sums), so the attention splits by
    heads with the norms' weights replicated (before: the attention stayed whole)."""
    model = tmp_path / "olmo2.py"
    model.write_text(OLMO2)
    facts = _facts(str(model))
    attention = "model.layers.0.self_attn"
    assert [facts.plan[f"{attention}.{p}"] for p in ("q_proj", "k_proj", "v_proj", "o_proj")] == \
        ["colwise", "colwise", "colwise", "rowwise"]
    assert facts.plan[f"{attention}.q_norm"] == facts.plan[f"{attention}.k_norm"] == "replicate"
    assert facts.plan["model.layers.0.mlp.down_proj"] == "rowwise"  # the MLP still splits
    assert facts.left_whole == () and len(facts.rank_sums) == 2 * 2  # q and k norms of its 2 layers
    assert facts.sequence_parallel_problem == ""


def test_a_fused_qkv_is_left_whole_with_a_line_and_a_loss_inside_forward_keeps_the_vocabulary_parallel_head():
    facts = _facts(str(MODELS / "nano_gpt_tp.py"), fused_split=False)
    blocks = {m: b for b in facts.left_whole for m in b.modules}
    fused = blocks["transformer.h.0.attn.c_attn"]
    assert fused.op == "aten.split.Tensor" and "fused projection" in fused.reason
    assert "transformer.h.0.attn.c_attn" in blocks["transformer.h.0.attn.c_proj"].reason
    assert facts.plan["transformer.h.0.mlp.c_fc"] == "colwise"
    # forward(idx, targets) computes cross_entropy on the logits: the tied head and embedding split the vocabulary
    assert facts.plan["lm_head"] == "colwise" and facts.plan["transformer.wte"] == "rowwise" and facts.has_head
    assert "lm_head" not in blocks


def test_hf_labels_keep_the_vocabulary_parallel_head_and_sequence_parallelism():
    facts = _facts(str(MODELS / "qwen3_labels.py"))
    assert facts.plan["lm_head"] == "colwise" and facts.plan["model.embed_tokens"] == "rowwise"
    assert facts.sequence_parallel_problem == "" and facts.left_whole == ()


def test_a_loss_inside_forward_that_loss_parallel_cannot_compute_leaves_the_head_whole_with_its_cost(tmp_path):
    model = tmp_path / "z_loss.py"
    model.write_text(Z_LOSS)
    facts = _facts(str(model))
    assert "head" not in facts.plan and facts.plan["up"] == "colwise" and not facts.has_head
    (block,) = [b for b in facts.left_whole if b.modules == ("head",)]
    assert block.op == "aten.logsumexp.default" and "loss it computes inside forward" in block.reason
    assert "all 64 x 32 head weights" in block.reason and "MFLOP per sample" in block.reason


def test_the_plan_lists_the_split_linears_and_the_blocks_left_whole():
    whole = (LeftWhole(("h.0.attn.c_attn",), "aten.split.Tensor", "h.0.attn", "it cuts a fused projection"),
             LeftWhole(("h.1.attn.c_attn",), "aten.split.Tensor", "h.1.attn", "it cuts a fused projection"))
    plan = Plan(**{**make_plan().__dict__, "tensor_parallel_plan": {"h.0.fc": "colwise", "h.1.fc": "colwise",
                                                                    "h.0.proj": "rowwise", "h.1.proj": "rowwise"},
                   "tensor_parallel_left_whole": whole})
    raw = json.loads(plan.to_json())
    assert raw["tensor_parallel_left_whole"][0] == {"modules": ["h.0.attn.c_attn"], "op": "aten.split.Tensor",
                                                    "op_module": "h.0.attn", "reason": "it cuts a fused projection"}
    assert Plan.from_json(plan.to_json()) == plan
    old = {k: v for k, v in raw.items() if k != "tensor_parallel_left_whole"}  # a plan written before the key
    assert Plan.from_dict(old).tensor_parallel_left_whole == ()
    assert split_lines(plan.tensor_parallel_plan) == ["colwise: h.*.fc (2)", "rowwise: h.*.proj (2)"]
    assert left_whole_lines(whole) == ["h.*.attn.c_attn (2x) left whole: aten.split.Tensor in h.*.attn: "
                                       "it cuts a fused projection"]
