"""Build-time: a tiny causal LM as TorchScript, served by distill-teacher in the
end-to-end tests. Embedding + one causal self-attention block + linear head;
vocab 64, d 32, fixed seed; method `hidden` answers the head's input. Usage: make_teacher.py OUT.pt"""
import math
import sys

import torch
import torch.nn as nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, context: int = 128):
        super().__init__()
        self.d = d
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return 3.0 * self.head(self.hidden(input_ids))  # sharper than init: a non-trivial target

    @torch.jit.export
    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final hidden states, the head's input (teacher.answer hidden, teacher.method hidden:
        its head is head.weight, head.bias, scale 3)."""
        t = input_ids.size(1)
        x = self.tok(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.d)
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + self.proj(att @ v)
        return self.norm(x)


if __name__ == "__main__":
    torch.manual_seed(1234)
    model = torch.jit.script(TinyLM().eval())
    model.save(sys.argv[1])
