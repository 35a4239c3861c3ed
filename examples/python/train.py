"""A small GPT trainer in plain PyTorch, three ways (docs/python.md, "Python trainers", the example):

  python3 train.py --mode teacher                                  # the teacher, alone
  python3 -m torch.distributed.run --nproc-per-node 2 train.py --mode label     # 2 DDP students, labels only
  distill-run --config examples/python/distill.yaml -- python3 train.py --mode distill
                                                                   # the same 2 students, taught by the teacher

The label and distill loops differ only in the lines marked `distill:` (run.sh runs all three and
prints the held-out losses). The teacher rank of the distill job serves teacher.pt from Python
(teacher.kind: self).
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

from gpt import GPT, Text, lr_at

if TYPE_CHECKING:  # distill is imported where used: the label runs need none
    import distill


def options(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["teacher", "label", "distill"], required=True)
    p.add_argument("--data", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--out", default="logs/python")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="sequences per student per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--student", default="2,4,64", help="layers,heads,dim")
    p.add_argument("--teacher", default="4,4,128", help="layers,heads,dim")
    p.add_argument("--teacher-steps", type=int, default=600)
    p.add_argument("--teacher-batch", type=int, default=32)
    p.add_argument("--teacher-lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--stop-after", type=int, default=0,
                   help="distill: ask for the agreed stop (as Ctrl-C does) after this step; a rerun resumes")
    return p.parse_args(argv)


def make(shape: str, context: int, dropout: float = 0.0) -> GPT:
    layers, heads, dim = (int(v) for v in shape.split(","))
    return GPT(layers, heads, dim, context, dropout)


def save_result(args, name: str, **fields):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(fields, f)
    print(f"{name}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items()))


def train_teacher(args, text: Text):
    torch.manual_seed(args.seed)
    model = make(args.teacher, args.context, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.teacher_lr)
    g = torch.Generator().manual_seed(args.seed)
    start = time.time()
    for step in range(1, args.teacher_steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.teacher_lr, args.warmup, args.teacher_steps)
        x, y = text.batch(args.teacher_batch, g)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    os.makedirs(args.out, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(args.out, "teacher.pt"))
    save_result(args, "teacher", val_loss=text.val_loss(model, 1 << 20), seconds=time.time() - start)


class Batches:
    """This student's micro-batches: random windows drawn by its own generator. Its state is the
    generator's, so a checkpoint can keep where it stands (distill.Steps' loader_state)."""

    def __init__(self, text: Text, args, rank: int):
        self.text, self.size = text, args.batch
        self.g = torch.Generator().manual_seed(args.seed * 1000 + rank)  # this student's shard of the data

    def __iter__(self):
        return self

    def __next__(self):
        return self.text.batch(self.size, self.g)

    def state_dict(self):
        return {"generator": self.g.get_state()}

    def load_state_dict(self, state):
        self.g.set_state(state["generator"])


def train_label(args, text: Text):
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(args.seed)
    model = DDP(make(args.student, args.context))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = time.time()
    loader = Batches(text, args, rank)
    for step, (x, y) in zip(range(1, args.steps + 1), loader):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.lr, args.warmup, args.steps)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    if rank == 0:
        save_result(args, "label", val_loss=text.val_loss(model.module, 1 << 20), seconds=time.time() - start)
    torch.distributed.destroy_process_group()


def train_distill(args, text: Text, session: "distill.Session") -> None:
    import distill

    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(args.seed)
    model = DDP(make(args.student, args.context))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = time.time()
    loader = Batches(text, args, rank)
    steps = distill.Steps(session, model, opt, loader_state=loader,  # distill: resumes model, optimizer, loader
                          on_step=lambda r: log_step(args, rank, r))
    for mb in steps.run(loader):  # distill: the same micro-batches, through the teacher
        for group in opt.param_groups:
            group["lr"] = lr_at(mb.step, args.lr, args.warmup, args.steps)
        steps.backward(model(mb.inputs))  # distill: teacher's answer, loss, backward
        if steps.step_ends():  # distill: the step's last micro-batch
            opt.step()
            opt.zero_grad()
            if mb.step == args.stop_after:
                session.request_stop()  # the students agree; the checkpoint is saved
    if rank == 0:
        save_result(args, "distill", val_loss=text.val_loss(model.module, 1 << 20), seconds=time.time() - start,
                    steps=steps.step)
    torch.distributed.destroy_process_group()


def log_step(args, rank: int, report: dict):
    """Student rank 0 appends each step's loss to OUT/distill_steps.jsonl (a resumed run goes on)."""
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "distill_steps.jsonl"), "a") as f:
            f.write(json.dumps({"step": report["step"], "loss": report["loss"]}) + "\n")


def serve_teacher(args, session: "distill.Session") -> None:
    import distill

    teacher = make(args.teacher, args.context)
    teacher.load_state_dict(torch.load(os.path.join(args.out, "teacher.pt"), weights_only=True))
    stats = distill.serve(session, teacher.to(session.teacher_device))
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
    if session is not None and session.is_teacher:
        return serve_teacher(args, session)  # distill: teacher.kind self
    text = Text(args.data, 0.1, args.context)
    if session is not None:
        return train_distill(args, text, session)
    {"teacher": train_teacher, "label": train_label}[args.mode](args, text)


if __name__ == "__main__":
    main()
