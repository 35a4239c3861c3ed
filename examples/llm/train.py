"""Distilling a Hugging Face Llama (docs/llm.md):

  python3 train.py --mode prepare          # the BPE tokenizer (32 000 entries) and the token streams
  python3 train.py --mode teacher          # the teacher (LlamaForCausalLM), alone
  python3 -m torch.distributed.run --nproc-per-node 2 train.py --mode label    # 2 DDP students, labels only
  distill-run --config examples/llm/distill.yaml -- python3 train.py --mode distill
                                           # the same 2 students, taught by the teacher
  distill-run --config examples/llm/distill.yaml --set loss.kind=reverse_kl --set loss.alpha=1 \
      -- python3 train.py --mode onpolicy   # taught on their own samples (docs/onpolicy.md)

The teacher rank of the distill job serves the saved teacher with `distill.serve(session, model)`:
a PreTrainedModel as it is (teacher.kind: self). examples/llm/run.sh runs the four (ONPOLICY=1: and
the on-policy students). Each student run also reports the teacher's mean log-likelihood of the
student's own samples of held-out prompts (sample_teacher_ll).
"""

import argparse
import json
import os
import sys
import time
from typing import Any, TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from llm import Stream, license_files, llama, lr_at, sample_loglik, source_files, tokenize, train_tokenizer

if TYPE_CHECKING:  # distill is imported where used: the label runs need none
    import distill


def options(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["prepare", "teacher", "label", "distill", "onpolicy"], required=True)
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
    p.add_argument("--teacher-pad", type=int, default=0,
                   help="teacher: its vocabulary padded with N ids no text has, as Llama 3's and Qwen2's are "
                        "(the students then need loss.vocab: truncate)")
    p.add_argument("--teacher-steps", type=int, default=200)
    p.add_argument("--teacher-batch", type=int, default=8)
    p.add_argument("--teacher-lr", type=float, default=2e-3)
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--logits", action="store_true",
                   help="distill: the loss on the materialised [tokens, V] logits instead of the fused linear loss")
    p.add_argument("--prompt", type=int, default=64, help="onpolicy: prompt tokens (a training window's start)")
    p.add_argument("--response", type=int, default=64, help="onpolicy: sampled tokens per prompt at most")
    p.add_argument("--group", type=int, default=4, help="onpolicy: samples per prompt (a group)")
    p.add_argument("--lam", type=float, default=1.0, help="onpolicy: the fraction of on-policy micro-batches")
    p.add_argument("--temperature", type=float, default=1.0, help="onpolicy: sampling temperature")
    p.add_argument("--eval-samples", type=int, default=16, help="held-out prompts for sample_teacher_ll")
    p.add_argument("--ids", choices=["token", "topk"], default=None,
                   help="onpolicy: ask the teacher at the sampled tokens (loss.kind sampled_token, "
                        "teacher.request_ids 1) or at the student's top --ids-topk (teacher.request_ids k)")
    p.add_argument("--ids-topk", type=int, default=0, help="onpolicy --ids topk: k")
    p.add_argument("--device", default="cpu",
                   help="where the teacher's training and the students run: cpu or cuda (then bf16 autocast; "
                        "the distilled runs' teacher goes where teacher.device says)")
    p.add_argument("--stop-after", type=int, default=0,
                   help="distill: stop after this step (a checkpoint; the next run resumes), 0: never")
    return p.parse_args(argv)


def save_result(args, name: str, **fields):
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump(fields, f)
    print(f"{name}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items()))


def autocast(args):
    """bf16 autocast on a GPU (the forward's matrix products in bf16, the parameters float32); nothing on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.device.startswith("cuda"))


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
    # Padded: the head (and the tied embedding) has --teacher-pad rows past the tokenizer's; training
    # pushes their logits down, as it does a real model's.
    model = llama(args.teacher, vocab + args.teacher_pad, args.context).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.teacher_lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed + 7)
    start = time.time()
    for step in range(1, args.teacher_steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.teacher_lr, args.warmup, args.teacher_steps)
        x, y = (t.to(args.device) for t in train.batch(args.teacher_batch, g))
        with autocast(args):
            logits = model(x, use_cache=False).logits
        F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    seconds = time.time() - start
    model.save_pretrained(os.path.join(args.out, "teacher"))  # a local folder: from_pretrained reads it
    save_result(args, "teacher", val_loss=val.loss(model, args.eval_tokens), seconds=seconds,
                tokens=args.teacher_steps * args.teacher_batch * args.context,
                params=sum(p.numel() for p in model.parameters()))


def eos_id(args) -> int:
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(os.path.join(args.out, "tokenizer.json")).token_to_id("<|endoftext|>")
    if eos is None:
        raise SystemExit(f"{args.out}/tokenizer.json has no <|endoftext|> token: run --mode prepare again")
    return eos


def teacher_ll(args, model, val: Stream) -> float:
    """sample_teacher_ll: the saved teacher's mean log-likelihood of this student's samples."""
    from transformers import LlamaForCausalLM

    teacher = LlamaForCausalLM.from_pretrained(os.path.join(args.out, "teacher")).to(args.device)
    prompt = min(args.prompt, args.context // 2)
    return sample_loglik(model, teacher, val, prompt, min(args.response, args.context - prompt), args.eval_samples,
                         eos_id(args), args.seed)


class Batches:
    """This student's micro-batches: random windows drawn by its own generator. Its state is the
    generator's, so a checkpoint keeps where it stands (distill.Steps' loader_state) and a resumed
    run sees the batches the uninterrupted one would have."""

    def __init__(self, train: Stream, args, rank: int):
        self.train, self.size, self.device = train, args.batch, args.device
        self.g = torch.Generator().manual_seed(args.seed * 1000 + rank)  # this student's shard of the data

    def __iter__(self):
        return self

    def __next__(self):
        return tuple(t.to(self.device) for t in self.train.batch(self.size, self.g))

    def state_dict(self):
        return {"generator": self.g.get_state()}

    def load_state_dict(self, state):
        self.g.set_state(state["generator"])


class Body(torch.nn.Module):
    """A LlamaForCausalLM without its output layer: the last hidden states [B, T, d] (after the final
    norm). DDP wraps this, so that the fused linear loss applies lm_head chunk by chunk itself."""

    def __init__(self, lm: Any):  # a LlamaForCausalLM
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm.model(input_ids=input_ids, use_cache=False).last_hidden_state


def student(args, vocab: int, body: bool = False):
    torch.manual_seed(args.seed)
    lm = llama(args.student, vocab, args.context).to(args.device)
    model = DDP(Body(lm) if body else lm)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0), lm


def train_label(args):
    train, val, vocab = streams(args)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    model, opt, _ = student(args, vocab)
    start = time.time()
    for step, (x, y) in zip(range(1, args.steps + 1), Batches(train, args, rank)):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.lr, args.warmup, args.steps)
        with autocast(args):
            logits = model(x, use_cache=False).logits
        F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    seconds = time.time() - start
    if rank == 0:
        save_result(args, "label", val_loss=val.loss(model.module, args.eval_tokens), seconds=seconds,
                    tokens=args.steps * args.batch * args.context * torch.distributed.get_world_size(),
                    params=sum(p.numel() for p in model.parameters()),
                    sample_teacher_ll=teacher_ll(args, model.module, val))
    torch.distributed.destroy_process_group()


def train_distill(args, session: "distill.Session") -> None:
    import distill

    train, val, vocab = streams(args)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    fused = not args.logits
    model, opt, lm = student(args, vocab, body=fused)
    start = time.time()
    loader = Batches(train, args, rank)
    steps = distill.Steps(session, model, opt, loader_state=loader,  # distill: resumes model, optimizer, loader
                          on_step=lambda r: log_step(args, rank, r))
    for mb in steps.run(loader):  # distill: the same micro-batches, through the teacher
        for group in opt.param_groups:
            group["lr"] = lr_at(mb.step, args.lr, args.warmup, args.steps)
        with autocast(args):  # the forward only: the loss casts what it needs (docs/gpu.md)
            out = model(mb.inputs) if fused else model(mb.inputs, use_cache=False)
        if fused:  # distill: the hidden states and lm_head; the [tokens, V] logits are never held
            # (under autocast the final norm's float32 weight makes them float32: as bf16, the fused
            # loss multiplies by lm_head in bf16, as autocast's own linear would)
            steps.backward(out.to(torch.bfloat16) if args.device.startswith("cuda") else out, lm_head=lm.lm_head)
        else:  # distill: the ModelOutput's logits, the loss, backward
            steps.backward(out)
        if steps.step_ends():  # distill: the step's last micro-batch
            opt.step()
            opt.zero_grad()
            if mb.step == args.stop_after:
                session.request_stop()  # the students agree; the checkpoint is saved
    seconds = time.time() - start
    if rank == 0:
        save_result(args, "distill", val_loss=val.loss(lm, args.eval_tokens), seconds=seconds,
                    tokens=steps.step * args.batch * args.context * session.world_size, steps=steps.step,
                    sample_teacher_ll=teacher_ll(args, lm, val))
    torch.distributed.destroy_process_group()


def log_step(args, rank: int, report: dict):
    """Student rank 0 appends each step's losses to OUT/distill_steps.jsonl (a resumed run goes on)."""
    if rank == 0:
        with open(os.path.join(args.out, "distill_steps.jsonl"), "a") as f:
            f.write(json.dumps({k: report[k] for k in ("step", "loss", "kd", "ce")}, allow_nan=False) + "\n")


def train_onpolicy(args, session):
    """The students sample continuations of training-window prompts (--group per prompt, up to
    --response tokens) and learn the teacher's answer on their own tokens; --lam < 1 mixes in the
    dataset's windows (GKD). Prompts per micro-batch: batch x context / (group x response), so a
    step trains (at most) the tokens of a label-only or distill step."""
    import distill

    if args.prompt < 1 or args.response < 1 or args.prompt + args.response > args.context:
        raise SystemExit(f"--prompt {args.prompt} + --response {args.response} must be at most --context "
                         f"{args.context} (the models' positions), each at least 1")
    train, val, vocab = streams(args)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    model, opt, _ = student(args, vocab)
    prompts = max(1, args.batch * args.context // (args.group * args.response))
    dev = args.device
    mix = distill.onpolicy.Mixer(model, lambda g: train.batch(prompts, g)[0][:, : args.prompt].to(dev),  # distill: prompts
                                 lambda g: tuple(t.to(dev) for t in train.batch(args.batch, g)), lam=args.lam, max_new_tokens=args.response,
                                 group_size=args.group, temperature=args.temperature, eos_token_id=eos_id(args),
                                 seed=args.seed * 1000 + rank, ids=args.ids, topk=args.ids_topk)
    # The teacher's log-likelihood of the untrained student's samples (rank 0; the same weights on every rank).
    before = teacher_ll(args, model.module, val) if rank == 0 else 0.0
    start = time.time()
    steps = distill.Steps(session, model, opt, loader_state=mix)  # distill: a resume restores the mix
    trained = 0
    for mb in steps.run(mix):  # distill: the students' samples (and dataset windows), through the teacher
        for group in opt.param_groups:
            group["lr"] = lr_at(mb.step, args.lr, args.warmup, args.steps)
        with autocast(args):
            out = model(mb.inputs, use_cache=False)
        steps.backward(out)  # distill: the response tokens only
        trained += int((mb.labels != -100).sum())
        if steps.step_ends():
            opt.step()
            opt.zero_grad()
    seconds = time.time() - start
    counts = torch.tensor([trained, mix.counts["onpolicy"], mix.counts["dataset"]])
    session.all_reduce(counts)  # distill: the last collective before exit (docs/python.md, "Ending a job")
    if rank == 0:
        save_result(args, "onpolicy", val_loss=val.loss(model.module, args.eval_tokens), seconds=seconds,
                    tokens=int(counts[0]), onpolicy_batches=int(counts[1]), dataset_batches=int(counts[2]),
                    steps=steps.step, lam=args.lam, group=args.group, prompt=args.prompt, response=args.response,
                    ids=args.ids or "none", sample_teacher_ll_before=before,
                    sample_teacher_ll=teacher_ll(args, model.module, val))
    torch.distributed.destroy_process_group()


def serve_teacher(args, session: "distill.Session") -> None:
    import distill
    from transformers import LlamaForCausalLM

    teacher = LlamaForCausalLM.from_pretrained(os.path.join(args.out, "teacher"))
    stats = distill.serve(session, teacher.to(session.teacher_device))  # distill: a PreTrainedModel as it is
    print(f"teacher: {stats['requests']} requests in {stats['batches']} batches, "
          f"forward {stats['forward_seconds']:.1f} s of {stats['wall_seconds']:.1f} s, "
          f"{stats['teacher_tokens']} of {stats['teacher_tokens_unshared']} tokens computed (prompt groups shared)")


def main():
    torch.set_num_threads(1)  # 3 processes on 2 cores
    session = None
    if "--mode" in sys.argv and sys.argv[sys.argv.index("--mode") + 1] in ("distill", "onpolicy"):
        import distill

        session = distill.init()  # distill: takes --config/--set out of sys.argv
    args = options(sys.argv[1:])
    if session is not None:
        args.steps = session.steps  # run.steps bounds distill.Steps: the schedule follows it
        if session.is_teacher:
            return serve_teacher(args, session)  # distill: teacher.kind self
        return (train_onpolicy if args.mode == "onpolicy" else train_distill)(args, session)
    {"prepare": prepare, "teacher": train_teacher, "label": train_label}[args.mode](args)


if __name__ == "__main__":
    main()
