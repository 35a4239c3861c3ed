"""The LLM example's pieces (examples/llm/train.py): a byte-level BPE tokenizer trained here with
`tokenizers`, the token streams, Llama models built from a config with `transformers` (random init,
no download), the held-out loss and the learning-rate schedule.

The text: Python's own standard library (its top-level .py files, sorted; every 10th file held
out). The tokenizer also reads /usr/share/common-licenses and the distinct
/usr/share/doc/*/copyright files, so that its vocabulary reaches 32 000 entries."""

import glob
import hashlib
import math
import os
import sysconfig

import torch
import torch.nn.functional as F


def source_files(max_files: int = 0):
    """(train files, held-out files) of the standard library's top-level .py files."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if max_files:
        files = files[:max_files]
    return [f for i, f in enumerate(files) if i % 10 != 9], [f for i, f in enumerate(files) if i % 10 == 9]


def read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def license_files():
    """/usr/share/common-licenses/* and each distinct /usr/share/doc/*/copyright."""
    out, seen = sorted(glob.glob("/usr/share/common-licenses/*")), set()
    for path in sorted(glob.glob("/usr/share/doc/*/copyright")):
        try:
            digest = hashlib.sha1(open(path, "rb").read()).hexdigest()
        except OSError:
            continue
        if digest not in seen:
            seen.add(digest)
            out.append(path)
    return [f for f in out if os.path.isfile(f)]


def train_tokenizer(files, vocab: int, path: str):
    """A byte-level BPE (GPT-2's pre-tokenizer) of `vocab` entries, saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((read(f) for f in files), trainer)
    tok.save(path)
    return tok


def tokenize(tok, files) -> torch.Tensor:
    """The files' tokens, one stream, each file ended by <|endoftext|>."""
    eot = tok.token_to_id("<|endoftext|>")
    ids = []
    for enc in tok.encode_batch([read(f) for f in files]):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.int32)


def llama(shape: str, vocab: int, context: int):
    """A LlamaForCausalLM of `layers,dim` (heads of 64, SwiGLU 8/3 x dim, tied embeddings), random init."""
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, dim = (int(v) for v in shape.split(","))
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=(dim * 8 // 3 + 31) // 32 * 32,
                      num_hidden_layers=layers, num_attention_heads=max(1, dim // 64),
                      num_key_value_heads=max(1, dim // 64), max_position_embeddings=context,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


class Stream:
    """Random windows of a token stream: (inputs, labels shifted by one)."""

    def __init__(self, tokens: torch.Tensor, context: int):
        self.tokens, self.context = tokens.long(), context

    def batch(self, size: int, g: torch.Generator):
        start = torch.randint(0, len(self.tokens) - self.context - 1, (size,), generator=g)
        w = torch.stack([self.tokens[s : s + self.context + 1] for s in start.tolist()])
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    @torch.no_grad()
    def loss(self, model, max_tokens: int, batch: int = 16) -> float:
        """Mean cross-entropy (nats per token) over consecutive windows of the stream."""
        model.eval()
        n = min(max_tokens, len(self.tokens) - 1) // self.context
        w = self.tokens[: n * self.context + 1]
        device = next(model.parameters()).device
        x, y = w[:-1].view(n, self.context).to(device), w[1:].view(n, self.context).to(device)
        total = 0.0
        for i in range(0, n, batch):
            logits = model(x[i : i + batch], use_cache=False).logits
            total += F.cross_entropy(logits.flatten(0, 1).float(), y[i : i + batch].flatten(), reduction="sum").item()
        model.train()
        return total / y.numel()


def lr_at(step: int, base: float, warmup: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to 10 %."""
    if step <= warmup:
        return base * step / warmup
    return base * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


@torch.no_grad()
def sample_loglik(student, teacher, val: Stream, prompt: int, response: int, count: int, eos: int,
                  seed: int = 0) -> float:
    """The teacher's mean log-likelihood (nats per token) of the student's samples: `count` held-out
    prompts of `prompt` tokens, each continued by up to `response` tokens sampled at temperature 1
    (the same prompts and random stream for every student)."""
    from distill.onpolicy import sample

    g = torch.Generator().manual_seed(seed)
    x = val.batch(count, g)[0][:, :prompt].to(next(student.parameters()).device)
    s = sample(student, x, response, eos_token_id=eos, generator=g)
    was = teacher.training
    teacher.eval()
    logp = torch.log_softmax(teacher(s.input_ids, use_cache=False).logits.float(), -1)
    teacher.train(was)
    keep = s.labels != -100
    ll = logp.gather(-1, s.labels.clamp(min=0)[..., None]).squeeze(-1)
    return (ll[keep].sum() / keep.sum()).item()
