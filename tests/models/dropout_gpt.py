"""A small GPT with dropout 0.1 everywhere GPT-2 has it: on the embeddings (nn.Dropout), on the
attention weights (scaled_dot_product_attention's dropout_p, in training only, as Hugging Face passes
it), after the attention projection (F.dropout) and after the MLP (nn.Dropout). Tied head."""

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, SEQ, DIM, HEADS, LAYERS = 64, 16, 32, 2, 2
DROPOUT = 0.1


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.ln_2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM), nn.Dropout(DROPOUT))

    def attention(self, x):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, HEADS, c // HEADS).transpose(1, 2) for y in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=DROPOUT if self.training else 0.0)
        return F.dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)), DROPOUT, self.training)

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class DropoutGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(SEQ, DIM)
        self.drop = nn.Dropout(DROPOUT)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model():
    return DropoutGPT()


def example_batch(batch_size):
    data = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return data[:, :-1], data[:, 1:]
