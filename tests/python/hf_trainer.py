"""Hugging Face students and teacher for tests/python/test_hf.py, started by distill-run:

    distill-run --config JOB.yaml -- python3 hf_trainer.py --mode M --out DIR [--precision P]

The teacher rank serves a tiny LlamaForCausalLM (built from a config and a seed, use_cache left at
its default True) with distill.serve(session, model): the model itself, no wrapper. Students write
DIR/rank<r>.json. Modes:
  lowlevel  session.submit({input_ids, attention_mask}) with padded rows (teacher.inputs names
            both): each answer against the in-process forward of the same model with the mask, and
            distill.loss of the reply against that of the forward's logits (teacher.answer hidden:
            the reply's kind is "hidden", its logits made with the teacher's head).
  steps     distill.Steps on a plain HF student, model(x) (a ModelOutput) given to backward() as it
            is, SGD, --precision float32 | bf16 (CPU autocast) | fp16 (CPU autocast and a
            torch.amp.GradScaler given to Steps): the parameters after the run and the losses.
  raw       the teacher serves `lambda *t: model(*t)` (not a PreTrainedModel: no adapter), whose
            ModelOutput carries a cache beside the logits; the students submit once.
  paths     distill.Steps, float32, rank 0 materialised (backward(model(x))), rank 1 fused
            (backward(hidden, lm_head=model.lm_head)); the losses, the answers' kind, the parameters.
--teacher picks the teacher (teacher_model): llama (default), qwen2, gemma2 (final_logit_softcapping),
refused (a Llama whose config declares lm_head_multiplier: teacher.answer hidden refuses it),
qwen2-plain (the qwen2 teacher served as a function returning its base model's last hidden state,
its head given as distill.serve(..., head=model.lm_head)).
"""

import argparse
import json
import os

import torch

import distill
from distill.head import head_logits
from distill.hf import hf_head

VOCAB, SEQ, BATCH, STEPS, LR = 96, 12, 3, 3, 0.5


def tiny_llama(seed: int, layers: int = 2, dim: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)
    return LlamaForCausalLM(cfg)


def teacher_model(kind: str = "llama"):
    """The teacher: a tiny model of `kind` (the module docstring's --teacher), seed 0."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, max_position_embeddings=SEQ)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shape))
    if kind == "gemma2":  # soft-capped at 2: the cap shapes these logits (a default init's reach about 1.5)
        return Gemma2ForCausalLM(Gemma2Config(**shape, head_dim=24, final_logit_softcapping=2.0))
    model = tiny_llama(0, layers=2, dim=48)
    if kind == "refused":
        model.config.lm_head_multiplier = 2.0
    return model


def student_model():
    return tiny_llama(1, layers=1, dim=32)


def micro_batches(rank: int, count: int):
    """Student `rank`'s micro-batches: (input_ids, labels, attention_mask with padded row ends)."""
    g = torch.Generator().manual_seed(2000 + rank)
    out = []
    for _ in range(count):
        x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[0, SEQ - 4 :] = 0  # a right-padded row
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous(), mask))
    return out


def lowlevel(session, out, kind="llama"):
    """With teacher.answer hidden the reply is of kind "hidden": its logits through the teacher's
    head, and distill.loss of the reply (the node's mapped head), against the in-process forward."""
    teacher = teacher_model(kind).eval()
    report = {"max_logit_diff": 0.0, "answers": 0, "masked_rows_differ": 0.0, "max_loss_diff": 0.0}
    g = torch.Generator().manual_seed(3000 + session.rank)
    for i, (x, y, mask) in enumerate(micro_batches(session.rank, 3)):
        h = session.submit({"input_ids": x, "attention_mask": mask}, i + 1, 0)
        reply = session.get(h)
        report["kind"] = reply.kind
        with torch.no_grad():
            if reply.kind == "hidden":
                hidden = reply.output["hidden"]
                report["hidden_shape"] = list(hidden.shape)
                got = head_logits(hidden, hf_head(teacher))
            else:
                got = reply.output["logits"]
            want = teacher(input_ids=x, attention_mask=mask, use_cache=False).logits
            unmasked = teacher(input_ids=x, use_cache=False).logits
            student = torch.randn(x.shape + (VOCAB,), generator=g)
            a = distill.loss(student, y, reply, float(y.numel()), session).loss.item()
            b = distill.loss(student, y, {"logits": want}, float(y.numel()), session).loss.item()
            if reply.kind == "hidden":  # a dict of hidden states: the session's mapped head
                c = distill.loss(student, y, {"hidden": hidden}, float(y.numel()), session).loss.item()
                a = max(a, c, key=lambda v: abs(v - b))
                try:
                    distill.loss(student, y, {"hidden": hidden}, float(y.numel()))
                    report["no_head_error"] = ""
                except distill.UsageError as e:
                    report["no_head_error"] = str(e)
        report["max_loss_diff"] = max(report["max_loss_diff"], abs(a - b))
        report["max_logit_diff"] = max(report["max_logit_diff"], (got - want).abs().max().item())
        # the mask reached the model: the padded row's answer is not the unmasked forward's
        report["masked_rows_differ"] = max(report["masked_rows_differ"], (got[0] - unmasked[0]).abs().max().item())
        report["answers"] += 1
    session.finish()
    return report


def steps(session, out, precision):
    model = student_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    s = distill.Steps(session, model, opt, scaler=scaler)
    losses, scales = [], []
    for mb in s.run((x, y) for x, y, _ in micro_batches(session.rank, STEPS * session.grad_acc_steps)):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            output = model(mb.inputs)  # a ModelOutput, use_cache at its default
        losses.append(s.backward(output).loss.item())
        if s.step_ends():
            if scaler is not None:
                scales.append(scaler.get_scale())
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
    done = s.step
    s.close()
    params = {n: p.detach().tolist() for n, p in model.named_parameters()}
    return {"losses": losses, "scales": scales, "params": params, "steps": done}


def paths(session):
    """Steps in float32: rank 0 gives backward() the materialised logits, rank 1 the last hidden
    states and lm_head (the fused loss)."""
    dev = torch.device(session.trainer.get("device", "cpu"))  # trainer.device cuda: the students on the GPU
    model = student_model().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    s = distill.Steps(session, model, opt)
    losses = []
    batches = micro_batches(session.rank, STEPS * session.grad_acc_steps)
    for mb in s.run((x.to(dev), y.to(dev)) for x, y, _ in batches):
        if session.rank == 0:
            r = s.backward(model(mb.inputs))
        else:
            r = s.backward(model.model(mb.inputs).last_hidden_state, lm_head=model.lm_head)
        losses.append([r.loss.item(), r.kd.item(), r.ce.item()])
        if s.step_ends():
            opt.step()
            opt.zero_grad()
    done = s.step
    s.close()
    params = {n: p.detach().tolist() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "steps": done}


def main():
    session = distill.init()
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["lowlevel", "steps", "raw", "paths"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--precision", default="float32", choices=["float32", "bf16", "fp16"])
    p.add_argument("--teacher", default="llama", choices=["llama", "qwen2", "gemma2", "refused", "qwen2-plain"])
    args = p.parse_args()
    torch.set_num_threads(1)
    if session.is_teacher:
        if args.teacher == "qwen2-plain":  # no adapter: a function of the base model, its head declared
            model = teacher_model("qwen2").eval()
            stats = distill.serve(session, lambda ids: model.model(input_ids=ids).last_hidden_state,
                                  fingerprint="qwen2 seed 0", head=model.lm_head)
            print(f"teacher served {stats['requests']} requests", flush=True)
            return
        model = teacher_model(args.teacher).to(session.teacher_device)
        stats = distill.serve(session, (lambda *t: model(*t)) if args.mode == "raw" else model)
        print(f"teacher served {stats['requests']} requests", flush=True)
        return
    if args.mode == "raw":
        session.get(session.submit(micro_batches(session.rank, 1)[0][0], 1, 0))
        return
    if args.mode == "paths":
        report = paths(session)
    elif args.mode == "lowlevel":
        report = lowlevel(session, args.out, args.teacher)
    else:
        report = steps(session, args.out, args.precision)
    with open(os.path.join(args.out, f"rank{session.rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
