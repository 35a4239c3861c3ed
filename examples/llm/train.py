"""Distilling a Hugging Face Llama (README "An LLM with Hugging Face transformers", docs/llm.md):

  python3 train.py --mode prepare          # the BPE tokenizer (32 000 entries) and the token streams
  python3 train.py --mode teacher          # the teacher (LlamaForCausalLM), alone
  python3 -m torch.distributed.run --nproc-per-node 2 train.py --mode label    # 2 DDP students, labels only
  distill-run --config examples/llm/distill.yaml -- python3 train.py --mode distill
                                           # the same 2 students, taught by the teacher

The teacher rank of the distill job serves the saved teacher with `distill.serve(session, model)`:
a PreTrainedModel as it is (teacher.kind: self). examples/llm/run.sh runs the four.
"""

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from llm import Stream, license_files, llama, lr_at, source_files, tokenize, train_tokenizer

if TYPE_CHECKING:  # distill is imported where used: the label runs need none
    import distill


def options(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["prepare", "teacher", "label", "distill"], required=True)
    p.add_argument("--out", default="logs/llm")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--max-files", type=int, default=0, help="the first N stdlib files only (0: all)")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=4, help="sequences per student per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--student", default="2,192", help="layers,dim")
    p.add_argument("--teacher", default="4,256", help="layers,dim")
    p.add_argument("--teacher-steps", type=int, default=200)
    p.add_argument("--teacher-batch", type=int, default=8)
    p.add_argument("--teacher-lr", type=float, default=2e-3)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


def save_result(args, name: str, **fields):
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(fields, f)
    print(f"{name}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items()))


def prepare(args):
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    train, held_out = source_files(args.max_files)
    tok = train_tokenizer(train + license_files() if not args.max_files else train, args.vocab,
                          os.path.join(args.out, "tokenizer.json"))
    torch.save({"train": tokenize(tok, train), "val": tokenize(tok, held_out), "vocab": tok.get_vocab_size()},
               os.path.join(args.out, "tokens.pt"))
    d = torch.load(os.path.join(args.out, "tokens.pt"))
    save_result(args, "prepare", vocab=d["vocab"], train_tokens=len(d["train"]), val_tokens=len(d["val"]),
                train_files=len(train), val_files=len(held_out), seconds=time.time() - start)


def streams(args):
    d = torch.load(os.path.join(args.out, "tokens.pt"))
    return Stream(d["train"], args.context), Stream(d["val"], args.context), d["vocab"]


def train_teacher(args):
    train, val, vocab = streams(args)
    torch.manual_seed(args.seed)
    model = llama(args.teacher, vocab, args.context)
    opt = torch.optim.AdamW(model.parameters(), lr=args.teacher_lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed + 7)
    start = time.time()
    for step in range(1, args.teacher_steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.teacher_lr, args.warmup, args.teacher_steps)
        x, y = train.batch(args.teacher_batch, g)
        F.cross_entropy(model(x, use_cache=False).logits.flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    seconds = time.time() - start
    model.save_pretrained(os.path.join(args.out, "teacher"))  # a local folder: from_pretrained reads it
    save_result(args, "teacher", val_loss=val.loss(model, args.eval_tokens), seconds=seconds,
                tokens=args.teacher_steps * args.teacher_batch * args.context,
                params=sum(p.numel() for p in model.parameters()))


def batches(train: Stream, args, rank: int):
    g = torch.Generator().manual_seed(args.seed * 1000 + rank)  # this student's shard of the data
    while True:
        yield train.batch(args.batch, g)


def student(args, vocab: int):
    torch.manual_seed(args.seed)
    model = DDP(llama(args.student, vocab, args.context))
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)


def train_label(args):
    train, val, vocab = streams(args)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    model, opt = student(args, vocab)
    start = time.time()
    for step, (x, y) in zip(range(1, args.steps + 1), batches(train, args, rank)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.lr, args.warmup, args.steps)
        F.cross_entropy(model(x, use_cache=False).logits.flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    seconds = time.time() - start
    if rank == 0:
        save_result(args, "label", val_loss=val.loss(model.module, args.eval_tokens), seconds=seconds,
                    tokens=args.steps * args.batch * args.context * torch.distributed.get_world_size(),
                    params=sum(p.numel() for p in model.parameters()))
    torch.distributed.destroy_process_group()


def train_distill(args, session: "distill.Session") -> None:
    import distill

    train, val, vocab = streams(args)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    model, opt = student(args, vocab)
    start = time.time()
    steps = distill.Steps(session, model, opt)  # distill: resumes from the latest checkpoint
    for mb in steps.run(batches(train, args, rank)):  # distill: the same micro-batches, through the teacher
        for group in opt.param_groups:
            group["lr"] = lr_at(mb.step, args.lr, args.warmup, args.steps)
        steps.backward(model(mb.inputs, use_cache=False))  # distill: the ModelOutput's logits, the loss, backward
        if steps.step_ends():  # distill: the step's last micro-batch
            opt.step()
            opt.zero_grad()
    seconds = time.time() - start
    if rank == 0:
        save_result(args, "distill", val_loss=val.loss(model.module, args.eval_tokens), seconds=seconds,
                    tokens=steps.step * args.batch * args.context * session.world_size, steps=steps.step)
    torch.distributed.destroy_process_group()


def serve_teacher(args, session: "distill.Session") -> None:
    import distill
    from transformers import LlamaForCausalLM

    teacher = LlamaForCausalLM.from_pretrained(os.path.join(args.out, "teacher"))
    stats = distill.serve(session, teacher.to(session.teacher_device))  # distill: a PreTrainedModel as it is
    print(f"teacher: {stats['requests']} requests in {stats['batches']} batches, "
          f"forward {stats['forward_seconds']:.1f} s of {stats['wall_seconds']:.1f} s")


def main():
    torch.set_num_threads(1)  # 3 processes on 2 cores
    session = None
    if "--mode" in sys.argv and sys.argv[sys.argv.index("--mode") + 1] == "distill":
        import distill

        session = distill.init()  # distill: takes --config/--set out of sys.argv
    args = options(sys.argv[1:])
    if session is not None:
        args.steps = session.steps  # run.steps bounds distill.Steps: the schedule follows it
        if session.is_teacher:
            return serve_teacher(args, session)  # distill: teacher.kind self
        return train_distill(args, session)
    {"prepare": prepare, "teacher": train_teacher, "label": train_label}[args.mode](args)


if __name__ == "__main__":
    main()
