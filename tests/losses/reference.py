#!/usr/bin/env python3
"""Reference values for tests/losses: straight float64 formulas with torch.nn.functional
and autograd, written from the definitions in student/include/distill/student/losses.h,
not from the C++ implementation.

usage: reference.py --seed S --out DIR [--batch B --seq L --vocab V --topk K]

Writes DIR/cases.txt (one line per case: name kind temperature jsd_beta alpha mode file)
and one file per case: records of an ASCII header line "name dtype ndim d0 d1 ...\n"
(dtype f64 | i64 | i32) followed by the raw little-endian values. Inputs are made in
float32 and stored as float64, so a float32 run sees exactly the reference's inputs.
"""
import argparse
import os
import struct
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

IGNORE = -100
ALPHA = 0.7
BETA = 0.3


def write(f, name, t):
    t = t.detach().contiguous().cpu()
    code, fmt = {torch.float64: ("f64", "d"), torch.int64: ("i64", "q"),
                 torch.int32: ("i32", "i")}[t.dtype]
    f.write(f"{name} {code} {t.dim()} {' '.join(str(d) for d in t.shape)}\n".encode())
    vals = t.flatten().tolist()
    f.write(struct.pack(f"<{len(vals)}{fmt}", *vals))


def kd_per_token(kind, z, labels, T, teacher):
    """T^2-scaled divergence per token, from full softmaxes or k+1 buckets."""
    logp = F.log_softmax(z / T, dim=-1)
    if teacher["mode"] == "dense":
        logq = F.log_softmax(teacher["logits"] / T, dim=-1)
        if kind == "forward_kl":
            kd = F.kl_div(logp, logq, log_target=True, reduction="none").sum(-1)
        elif kind == "reverse_kl":
            kd = F.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)
        else:
            logm = torch.log(BETA * logq.exp() + (1 - BETA) * logp.exp())
            kd = (BETA * F.kl_div(logm, logq, log_target=True, reduction="none").sum(-1)
                  + (1 - BETA) * F.kl_div(logm, logp, log_target=True, reduction="none").sum(-1))
    else:
        p = logp.exp()
        pk = p.gather(-1, teacher["indices"].long())
        P = torch.cat([pk, (1 - pk.sum(-1)).unsqueeze(-1)], -1)  # tail by subtraction, in float64
        v = teacher["values"] / T
        if teacher["mode"] == "topk":
            qk = F.softmax(v, dim=-1)
            q = torch.cat([qk, torch.zeros_like(qk[..., :1])], -1)
        else:
            qk = torch.exp(v - teacher["lse"].unsqueeze(-1))
            q = torch.cat([qk, (1 - qk.sum(-1)).unsqueeze(-1)], -1)
        if kind == "forward_kl":
            kd = (torch.xlogy(q, q) - q * torch.log(P)).sum(-1)
        elif kind == "reverse_kl":
            kd = (torch.xlogy(P, P) - P * torch.log(q)).sum(-1)
        else:
            m = BETA * q + (1 - BETA) * P
            kd = (BETA * (torch.xlogy(q, q) - q * torch.log(m))
                  + (1 - BETA) * (torch.xlogy(P, P) - P * torch.log(m))).sum(-1)
    return kd * T * T


def make_case(path, seed, kind, T, mode, B, L, V, K):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(B, L, V, generator=g) * 2.0).float().double()
    t = (torch.randn(B, L, V, generator=g) * 3.0 + 0.5).float().double()
    labels = torch.randint(0, V, (B, L), generator=g)
    labels[torch.rand(B, L, generator=g) < 0.3] = IGNORE
    labels[0, :3] = IGNORE
    valid = labels != IGNORE
    normalizer = float(valid.sum().item() + 5)  # any global count: the step's, not this call's
    teacher = {"mode": mode}
    if mode == "dense":
        teacher["logits"] = t
    else:
        vals, idx = t.topk(K, dim=-1)
        perm = torch.argsort(torch.rand(B, L, K, generator=g), dim=-1)  # order must not matter
        teacher["values"], teacher["indices"] = vals.gather(-1, perm), idx.gather(-1, perm)
        if seed % 2:
            teacher["indices"] = teacher["indices"].int()
        if mode == "topk_lse":
            teacher["lse"] = torch.logsumexp(t / T, dim=-1).float().double()
    z.requires_grad_(True)
    kd_sum = kd_per_token(kind, z, labels, T, teacher)[valid].sum()
    ce_sum = F.cross_entropy(z.reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE,
                             reduction="sum")
    loss = (ALPHA * kd_sum + (1 - ALPHA) * ce_sum) / normalizer
    (grad,) = torch.autograd.grad(loss, z)
    with open(path, "wb") as f:
        write(f, "student", z)
        write(f, "labels", labels)
        for name in ("logits", "values", "indices", "lse"):
            if name in teacher:
                write(f, "teacher_" + name, teacher[name])
        write(f, "normalizer", torch.tensor([normalizer], dtype=torch.float64))
        write(f, "ref_loss", loss.detach().reshape(1))
        write(f, "ref_kd", (kd_sum / normalizer).detach().reshape(1))
        write(f, "ref_ce", (ce_sum / normalizer).detach().reshape(1))
        write(f, "ref_grad", grad)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=19)
    ap.add_argument("--vocab", type=int, default=101)
    ap.add_argument("--topk", type=int, default=8)
    a = ap.parse_args()
    torch.set_default_dtype(torch.float64)
    os.makedirs(a.out, exist_ok=True)
    lines = []
    i = 0
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        for T in (1.0, 2.5):
            for mode in ("dense", "topk", "topk_lse"):
                if kind == "reverse_kl" and mode == "topk":
                    continue  # infinite by definition; the C++ side must refuse it
                name = f"{kind}_T{T}_{mode}"
                path = os.path.join(a.out, name + ".bin")
                make_case(path, a.seed + i, kind, T, mode, a.batch, a.seq, a.vocab, a.topk)
                lines.append(f"{name} {kind} {T} {BETA} {ALPHA} {mode} {path}")
                i += 1
    with open(os.path.join(a.out, "cases.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
