"""A tiny GPT with dropout 0.1 where GPT-2 has it (embeddings, attention weights through SDPA's dropout_p, after the
attention projection and after the MLP), four blocks and a tied head: small enough to train hundreds of steps on CPU
processes in seconds, deep enough for two pipeline ranks of two stages each (benchmarks/chaos.py)."""

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, SEQ, DIM, HEADS, LAYERS = 64, 16, 32, 2, 4
DROPOUT = 0.1
ATTENTION_DROPOUT = DROPOUT
"""The attention weights' dropout (SDPA's dropout_p); chaos_gpt_ring.py sets it to 0 for context parallelism, whose
ring attention runs none (the planner refuses cp for a model that drops attention weights)."""


class Attention(nn.Module):
    """Separate query, key and value projections viewed to heads with -1 (torchtitan's way): tensor parallelism
    splits them by heads, and sequence parallelism gathers the sequence before them."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(DIM, DIM) for _ in range(3))
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=ATTENTION_DROPOUT if self.training else 0.0)
        return F.dropout(self.proj(y.transpose(1, 2).contiguous().view(b, t, -1)), DROPOUT, self.training)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, 4 * DIM)
        self.proj = nn.Linear(4 * DIM, DIM)
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.attn = Attention()
        self.ln_2 = nn.LayerNorm(DIM)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ChaosGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(SEQ, DIM)
        self.drop = nn.Dropout(DROPOUT)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model() -> nn.Module:
    return ChaosGPT()


def example_batch(batch_size: int):
    data = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return data[:, :-1], data[:, 1:]
