"""A byte-level GPT in plain PyTorch and the demo's text, for examples/python/train.py."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, layers: int, heads: int, dim: int, context: int, dropout: float = 0.0, vocab: int = 256):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.size(1), device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


class Text:
    """The file's bytes: the first 1 - val_fraction to train on, the rest held out."""

    def __init__(self, path: str, val_fraction: float, context: int):
        data = torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.uint8).long()
        split = int(len(data) * (1 - val_fraction))
        self.train, self.val, self.context = data[:split], data[split:], context

    def batch(self, size: int, g: torch.Generator):
        """`size` random windows of the training part: (inputs, labels shifted by one)."""
        start = torch.randint(0, len(self.train) - self.context - 1, (size,), generator=g)
        w = torch.stack([self.train[s : s + self.context + 1] for s in start.tolist()])
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    @torch.no_grad()
    def val_loss(self, model: nn.Module, max_tokens: int) -> float:
        """Mean cross-entropy (nats per byte) over consecutive held-out windows."""
        model.eval()
        n = min(max_tokens, len(self.val) - 1) // self.context
        w = self.val[: n * self.context + 1]
        x, y = w[:-1].view(n, self.context), w[1:].view(n, self.context)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item() / y.numel()
        model.train()
        return loss


def lr_at(step: int, base: float, warmup: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to 10 %."""
    if step <= warmup:
        return base * step / warmup
    return base * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))
