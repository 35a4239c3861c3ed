"""Teacher and student logits of really trained models on held-out text, for
`bench_loss --signals --teacher-logits FILE` (bench/signals.cpp).

The LLM example's pieces (examples/llm/llm.py), nothing downloaded: a byte-level BPE tokenizer of
--vocab entries trained on Python's standard library (its top-level .py files, every 10th held
out), a Llama teacher (--teacher layers,dim) trained on the training files, and a smaller,
less-trained Llama student (--student, --student-steps) trained on the same text from labels.
Both read --positions held-out positions (--windows windows of --context tokens, consecutive from
the held-out stream's start); their logits there are saved with torch.save as a dict:

  teacher  [N, V] float32   the teacher's logits
  student  [N, V] float32   the student's logits
  labels   [N] int64        the held-out next tokens

with the models' held-out losses printed and written beside it (FILE.json).

  python3 bench/signals_logits.py --out logs/signals-logits      (about 4 min on 2 cores)
  build/bin/bench_loss --signals --teacher-logits logs/signals-logits/logits.pt
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "llm"))
from llm import Stream, llama, lr_at, source_files, tokenize, train_tokenizer  # noqa: E402


def options(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="logs/signals-logits")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--teacher", default="4,256", help="layers,dim")
    p.add_argument("--teacher-steps", type=int, default=300)
    p.add_argument("--student", default="2,128", help="layers,dim")
    p.add_argument("--student-steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--windows", type=int, default=4, help="held-out windows of --context tokens read")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


def train(shape, steps, args, vocab, stream):
    torch.manual_seed(args.seed)
    model = llama(shape, vocab, args.context)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed + 7)
    warmup = max(1, steps // 10)
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.lr, warmup, steps)
        x, y = stream.batch(args.batch, g)
        F.cross_entropy(model(x, use_cache=False).logits.flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def main(argv=None):
    args = options(argv)
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    start = time.time()
    train_files, held_out = source_files()
    tok = train_tokenizer(train_files, args.vocab, os.path.join(args.out, "tokenizer.json"))
    vocab = tok.get_vocab_size()
    trainset, val = Stream(tokenize(tok, train_files), args.context), Stream(tokenize(tok, held_out), args.context)
    print(f"tokenizer: {vocab} entries, {len(trainset.tokens)} training tokens ({time.time() - start:.0f} s)", flush=True)
    t0 = time.time()
    teacher = train(args.teacher, args.teacher_steps, args, vocab, trainset)
    print(f"teacher {args.teacher}: {args.teacher_steps} steps x {args.batch} x {args.context} ({time.time() - t0:.0f} s)",
          flush=True)
    t0 = time.time()
    student = train(args.student, args.student_steps, args, vocab, trainset)
    print(f"student {args.student}: {args.student_steps} steps ({time.time() - t0:.0f} s)", flush=True)
    w = val.tokens[: args.windows * args.context + 1]
    x, y = w[:-1].view(args.windows, args.context), w[1:].reshape(-1)
    with torch.no_grad():
        t = teacher(x, use_cache=False).logits.flatten(0, 1).float().contiguous()
        z = student(x, use_cache=False).logits.flatten(0, 1).float().contiguous()
    path = os.path.join(args.out, "logits.pt")
    torch.save({"teacher": t, "student": z, "labels": y.long().contiguous()}, path)
    q = F.log_softmax(t, 1)
    meta = {
        "file": path, "n": t.shape[0], "v": vocab, "teacher": args.teacher, "teacher_steps": args.teacher_steps,
        "student": args.student, "student_steps": args.student_steps,
        "teacher_loss_here": F.cross_entropy(t, y.long()).item(),
        "student_loss_here": F.cross_entropy(z, y.long()).item(),
        "teacher_val_loss": val.loss(teacher, 16384), "student_val_loss": val.loss(student, 16384),
        "teacher_entropy_nats": -(q.exp() * q).sum(1).mean().item(),
        "kl_teacher_student_nats": (q.exp() * (q - F.log_softmax(z, 1))).sum(1).mean().item(),
        "seconds": time.time() - start,
    }
    with open(path + ".json", "w") as f:
        json.dump(meta, f)
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
