"""GPT as Megatron-LM ran it in Narayanan et al. (SC21): pre-norm blocks, attention computed
explicitly as Megatron's CoreAttention did before FlashAttention (one baddbmm for the scaled, masked
scores QK^T / sqrt(d), softmax, dropout 0.1 on the probabilities, one bmm with V), hidden dropout 0.1 after
each residual branch, GeLU MLP of 4h, learned position embeddings and an LM head tied to the word
embedding. The published runs in shared/reference/runs.csv were measured on this program shape.

Sizes are module constants so benchmarks can set them before build_model().
"""

import math

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 51200
SEQ_LEN = 2048
N_LAYER = 24
N_HEAD = 24
N_EMBD = 2304
DROPOUT = 0.1
FUSED_QKV = True
"""One Linear for q, k and v, as Megatron-LM holds them. Megatron-LM interleaves that weight so each tensor-
parallel rank holds whole heads; torch's ColwiseParallel would split the fused rows as they are, so a program
that torch runs (autoplan's) keeps tensor parallelism off such a split. False: three Linears, the same math
and FLOPs, which torch's tensor parallelism splits by heads as Megatron-LM does."""


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        if FUSED_QKV:
            self.qkv = nn.Linear(n_embd, 3 * n_embd)
        else:
            self.q, self.k, self.v = (nn.Linear(n_embd, n_embd) for _ in range(3))
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h, d = self.n_head, c // self.n_head
        q, k, v = self.qkv(x).split(c, dim=2) if FUSED_QKV else (self.q(x), self.k(x), self.v(x))
        q, k, v = (z.view(b, t, h, d).transpose(1, 2).reshape(b * h, t, d) for z in (q, k, v))
        # Megatron's CoreAttention: one GEMM for the scaled, masked scores, softmax, dropout, one GEMM
        causal = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        scores = torch.baddbmm(causal.expand(b * h, t, t), q, k.transpose(1, 2), alpha=1 / math.sqrt(d))
        probs = self.dropout(torch.softmax(scores, dim=-1))
        y = torch.bmm(probs, v).view(b, h, t, d).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = Attention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_1(x)))
        return x + self.dropout(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    def __init__(self, vocab=None, seq_len=None, n_layer=None, n_head=None, n_embd=None) -> None:
        super().__init__()
        vocab, seq_len = vocab or VOCAB, seq_len or SEQ_LEN
        n_layer, n_head, n_embd = n_layer or N_LAYER, n_head or N_HEAD, n_embd or N_EMBD
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model() -> nn.Module:
    return GPT()


def example_batch(batch_size: int):
    idx = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return idx[:, :-1], idx[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
