"""A nanoGPT look-alike (our own code after the shape of karpathy/nanoGPT's model.py): one fused c_attn Linear
(3 x n_embd) split into q, k and v, c_proj, a GELU MLP, a head tied to the token embedding, and the loss computed
inside forward when targets are given (forward(idx, targets) -> (logits, loss)). The wrapper part at the bottom
is what a user writes beside it: targets passed as a keyword, the model's own loss returned."""

import math

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, BLOCK, N_EMBD, N_HEAD, N_LAYER = 64, 8, 32, 4, 2


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)
        self.n_head, self.n_embd = N_HEAD, N_EMBD

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(N_EMBD), CausalSelfAttention()
        self.ln_2, self.mlp = nn.LayerNorm(N_EMBD), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, N_EMBD), wpe=nn.Embedding(BLOCK, N_EMBD),
            h=nn.ModuleList([Block() for _ in range(N_LAYER)]), ln_f=nn.LayerNorm(N_EMBD)))
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * N_LAYER))

    def forward(self, idx, targets=None):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


def build_model() -> GPT:
    return GPT()


def example_batch(batch_size: int):
    data = torch.randint(0, VOCAB, (batch_size, BLOCK + 1))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    return {"idx": x, "targets": y}, y


def loss_fn(output, targets):
    return output[1]
