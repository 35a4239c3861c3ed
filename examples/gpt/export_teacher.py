"""The demo's GPT in Python, exported with torch.jit.script as a TorchScript
teacher for distill-teacher (configs/demo-torchscript.yaml).

The module below is the family of examples/gpt/gpt.h with the same parameter
names, so a teacher trained by the C++ trainer loads here unchanged:

  python3 examples/gpt/export_teacher.py --weights logs/demo/teacher/teacher.pt \\
      --out logs/demo/teacher/teacher.ts.pt
      # the C++-trained teacher (distill-gpt train-teacher), exported

  python3 examples/gpt/export_teacher.py --train-steps 300 --out teacher.ts.pt \\
      [--data /usr/share/common-licenses/GPL-3 --layers 4 --heads 4 --dim 128 --context 64]
      # a teacher made and trained in Python alone

Either way the exported module is checked against the eager one before it is
written (same logits on a random batch).
"""
import argparse
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        parts = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(parts[0], parts[1], parts[2], dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))


class Gpt(nn.Module):
    """ids [B, T] int64 -> logits [B, T, vocab]."""

    def __init__(self, vocab=256, context=64, layers=4, heads=4, dim=128, dropout=0.0):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList([Block(dim, heads, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        for name, p in self.named_parameters():
            if "ln" in name:
                continue
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif name.endswith(".proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.size(1)
        x = self.tok(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def load_cpp_weights(path):
    """A Gpt with the parameters of a file written by saveGpt (examples/gpt/gpt.cpp)."""
    archive = torch.jit.load(path, map_location="cpu")
    state = dict(archive.state_dict())
    vocab, context, layers, heads, dim = (int(v) for v in state.pop("gpt_hparams").tolist())
    model = Gpt(vocab, context, layers, heads, dim)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        sys.exit(f"{path}: parameters do not match the Python Gpt: missing {missing}, unexpected {unexpected}")
    print(f"loaded {path}: {layers} layers x {dim} dim, {heads} heads, context {context}")
    return model


def train(args):
    """A teacher trained here: random windows of the first 1 - val_fraction of the file."""
    data = torch.tensor(list(open(args.data, "rb").read()), dtype=torch.long)
    split = int(len(data) * (1 - args.val_fraction))
    train_data, val_data = data[:split], data[split:]
    torch.manual_seed(args.seed)
    model = Gpt(256, args.context, args.layers, args.heads, args.dim, args.dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    for step in range(1, args.train_steps + 1):
        starts = torch.randint(0, len(train_data) - args.context - 1, (args.batch,))
        window = torch.stack([train_data[s:s + args.context + 1] for s in starts.tolist()])
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), window[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.train_steps:
            print(f"step {step}/{args.train_steps} loss {loss.item():.4f}", flush=True)
    model.eval()
    n = (len(val_data) - 1) // args.context
    with torch.no_grad():
        ids = val_data[: n * args.context].view(n, args.context)
        labels = val_data[1: n * args.context + 1].view(n, args.context)
        val = F.cross_entropy(model(ids).reshape(-1, 256), labels.reshape(-1)).item()
    print(f"validation loss {val:.4f} nats/byte")
    return model


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="TorchScript file to write (teacher.path)")
    p.add_argument("--weights", help="a C++ weights file (distill-gpt train-teacher) to export")
    p.add_argument("--train-steps", type=int, default=0, help="train in Python instead, this many steps")
    p.add_argument("--data", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if bool(args.weights) == (args.train_steps > 0):
        p.error("give exactly one of --weights and --train-steps")

    model = load_cpp_weights(args.weights) if args.weights else train(args)
    model.eval()
    scripted = torch.jit.script(model)
    ids = torch.randint(0, 256, (2, model.context), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        diff = (scripted(ids) - model(ids)).abs().max().item()
    if diff > 1e-4:
        sys.exit(f"the scripted module differs from the eager one by {diff}")
    tmp = args.out + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    scripted.save(tmp)
    os.replace(tmp, args.out)
    print(f"wrote {args.out} (TorchScript; max |scripted - eager| = {diff:.2e})")


if __name__ == "__main__":
    main()
