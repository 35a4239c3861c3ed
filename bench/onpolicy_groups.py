"""Prompt groups on the Hugging Face teacher (distill.hf.HFTeacher, docs/onpolicy.md): the teacher
tokens computed per group of G samples of one prompt against G x (P + R), and the teacher's time per
group, shared against unshared scoring (share_prefix=0), in float32 on the CPU. Prints one JSON line.

    PYTHONPATH=build/python python3 bench/onpolicy_groups.py [--prompt 256 --response 64 --group 8]

The rows are what distill.onpolicy.sample submits: prompt + response, the last token dropped
(P + R - 1 wide); the responses are random tokens (the teacher's cost does not depend on them)."""

import argparse
import json
import os
import statistics
import time

import torch

from distill.hf import HFTeacher


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--teacher", default="4,256", help="layers,dim of the Llama teacher (heads of 64)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, dim = (int(v) for v in a.teacher.split(","))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=dim, intermediate_size=(dim * 8 // 3 + 31) // 32 * 32,
                      num_hidden_layers=layers, num_attention_heads=max(1, dim // 64),
                      num_key_value_heads=max(1, dim // 64), max_position_embeddings=a.prompt + a.response)
    model = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, a.vocab, (1, a.prompt), generator=g).repeat(a.group, 1)
    response = torch.randint(0, a.vocab, (a.group, a.response), generator=g)
    ids = torch.cat([prompt, response], 1)[:, :-1].contiguous()
    shared, unshared = HFTeacher(model, ["input_ids"]), HFTeacher(model, ["input_ids"], share_prefix=0)
    times = {"shared": [], "unshared": []}
    cpu = {"shared": [], "unshared": []}  # the process's CPU time: the machine is shared
    with torch.inference_mode():
        want, got = unshared(ids), shared(ids)  # also the warm-up
        diff = (got - want).abs().max().item()
        for _ in range(a.reps):
            for name, t in (("unshared", unshared), ("shared", shared)):
                t0, c0 = time.perf_counter(), time.process_time()
                t(ids)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    computed = shared.tokens // (a.reps + 1)
    full = a.group * (a.prompt + a.response)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    cpu_ms = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
    print(json.dumps({
        "bench": "onpolicy_groups", "prompt": a.prompt, "response": a.response, "group": a.group,
        "teacher": a.teacher, "vocab": a.vocab, "params": sum(p.numel() for p in model.parameters()),
        "row_tokens": ids.size(1), "teacher_tokens_per_group": computed, "g_times_p_plus_r": full,
        "ratio": round(computed / full, 4),
        "ideal_ratio": round((a.prompt + a.group * a.response) / full, 4),
        "ms_per_group": {k: round(v, 1) for k, v in ms.items()},
        "time_ratio": round(ms["shared"] / ms["unshared"], 4),
        "cpu_ms_per_group": {k: round(v, 1) for k, v in cpu_ms.items()},
        "cpu_time_ratio": round(cpu_ms["shared"] / cpu_ms["unshared"], 4), "max_abs_diff": diff,
        "threads": a.threads, "cores": os.cpu_count(), "load": os.getloadavg()[0]}))


if __name__ == "__main__":
    main()
