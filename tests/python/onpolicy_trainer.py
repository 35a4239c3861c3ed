"""On-policy students and their Hugging Face teacher for tests/python/test_onpolicy.py, started by
distill-run:

    distill-run --config JOB.yaml -- python3 onpolicy_trainer.py --mode M --out DIR

The teacher rank serves a tiny LlamaForCausalLM with distill.serve(session, model) (prompt groups
shared) and prints its token counts. Students write DIR/rank<r>.json. Modes:
  group  distill.onpolicy.sample of G = 4 rows for each of 2 prompts, row 1's response cut to
         length 0; the group request, then each row alone (one request in flight: an unshared
         forward each); both against the in-process unshared forward.
  big    one sampled request of G = 16 rows (more bytes than the job's request slot).
  steps  distill.Steps over a distill.onpolicy.Mixer (trainer.lam, 0.5 by default; G = 4,
         reverse_kl), a checkpoint every step; trainer.stop_at_read = K: student 0 sends itself
         SIGINT in the middle of the generation of its K-th on-policy micro-batch;
         trainer.stop_after_step = K: in step K (the job stops after it); trainer.lr (SGD, 0.5),
         trainer.dropout (the student's attention dropout, 0), trainer.ids (the Mixer's ids: token for
         loss.kind sampled_token, topk with trainer.topk).
"""

import argparse
import json
import os
import signal

import torch

import distill

VOCAB, P, R, G, PROMPTS, EOS = 96, 16, 8, 4, 2, 3


def tiny_llama(seed: int, layers: int, dim: int, dropout: float = 0.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      attention_dropout=dropout)
    return LlamaForCausalLM(cfg)


def teacher_model():
    return tiny_llama(0, 2, 48)


def student_model(dropout: float = 0.0):
    return tiny_llama(1, 1, 32, dropout)


def prompts(g: torch.Generator) -> torch.Tensor:
    return torch.randint(4, VOCAB, (PROMPTS, P), generator=g)


def dataset(g: torch.Generator) -> tuple:
    w = torch.randint(4, VOCAB, (PROMPTS * G, P + R), generator=g)
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def group(session):
    teacher, student = teacher_model().eval(), student_model()
    s = distill.onpolicy.sample(student, prompts(torch.Generator().manual_seed(5)), R, group_size=G,
                                eos_token_id=EOS, generator=torch.Generator().manual_seed(6 + session.rank))
    ids, labels = s.input_ids.clone(), s.labels.clone()
    ids[1, P:] = 0  # row 1: a response of length 0 (the prompt, then padding)
    labels[1, :] = -100
    got = session.get(session.submit(ids, 1, 0)).output["logits"]
    singles = [session.get(session.submit(ids[i : i + 1], 2 + i, 0)).output["logits"] for i in range(ids.size(0))]
    with torch.no_grad():
        want = teacher(input_ids=ids, use_cache=False).logits
    session.finish()
    return {"rows": ids.size(0), "width": ids.size(1), "group_vs_unshared": (got - want).abs().max().item(),
            "group_vs_singles": (got - torch.cat(singles)).abs().max().item(),
            "response_tokens": int((labels != -100).sum()), "lengths": s.response_lengths.tolist()}


def big(session):
    s = distill.onpolicy.sample(student_model(), prompts(torch.Generator().manual_seed(5))[:1], R, group_size=16,
                                generator=torch.Generator().manual_seed(6))
    session.get(session.submit(s.input_ids, 1, 0))
    return {}


def steps(session):
    torch.distributed.init_process_group("gloo")
    model = student_model(session.option("dropout", 0.0))
    opt = torch.optim.SGD(model.parameters(), lr=session.option("lr", 0.5))
    stop_at, stop_after = session.option("stop_at_read", 0), session.option("stop_after_step", 0)
    mix = distill.onpolicy.Mixer(model, prompts, dataset, lam=session.option("lam", 0.5), max_new_tokens=R,
                                 group_size=G, eos_token_id=EOS, seed=session.seed * 1000 + session.rank,
                                 ids=session.option("ids", "") or None, topk=session.option("topk", 0))
    calls = [0]

    def in_generation(module, args):  # student 0: Ctrl-C at its 3rd token of on-policy micro-batch K
        if not module.training and session.rank == 0 and mix.counts["onpolicy"] + 1 == stop_at:
            calls[0] += 1
            if calls[0] == 3:
                os.kill(os.getpid(), signal.SIGINT)

    if stop_at:
        model.register_forward_pre_hook(in_generation)
    s = distill.Steps(session, model, opt, loader_state=mix)
    kinds = []
    for mb in s.run(mix):
        kinds.append([mb.step, int((mb.labels != -100).sum()), mb.inputs.tolist()])  # the whole sample
        if mb.step == stop_after and mb.acc_step == 0 and session.rank == 0:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: the job stops after this step
        s.backward(model(mb.inputs))
        if s.step_ends():
            opt.step()
            opt.zero_grad()
    report = {"steps": s.step, "resumed": s.resumed_step, "stopped": s.stopped, "seen": kinds,
              "counts": mix.counts, "params": {n: p.detach().tolist() for n, p in model.named_parameters()}}
    s.close()
    torch.distributed.destroy_process_group()
    return report


def main():
    session = distill.init()
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["group", "big", "steps"], required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    if session.is_teacher:
        stats = distill.serve(session, teacher_model())
        print(f"teacher tokens {stats['teacher_tokens']} of {stats['teacher_tokens_unshared']} in "
              f"{stats['batches']} batches", flush=True)
        return
    report = {"group": group, "big": big, "steps": steps}[args.mode](session)
    with open(os.path.join(args.out, f"rank{session.rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
