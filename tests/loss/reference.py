#!/usr/bin/env python3
"""Reference values for tests/loss: straight float64 formulas with torch.nn.functional
and autograd, written from the definitions in loss/include/distill/loss/losses.h,
not from the C++ implementation.

usage: reference.py --seed S --out DIR [--batch B --seq L --vocab V --topk K]
       reference.py --edge --out DIR

Writes DIR/cases.txt (one line per case: name kind temperature jsd_beta alpha mode file)
and one file per case: records of an ASCII header line "name dtype ndim d0 d1 ...\n"
(dtype f64 | i64 | i32) followed by the raw little-endian values. Inputs are made in
float32 and stored as float64, so a float32 run sees exactly the reference's inputs.

--edge writes DIR/edge_cases.txt instead (name kind temperature jsd_beta alpha mode dtype
check file): the edge cases of issue 14 (underflow in the JSD, a teacher tail that cancels
in 1 - sum q, k = V), whose float64 formulas above would themselves give inf or NaN. Their
values come from mpmath at 60 digits, straight from the definitions and the teacher's FULL
logits (the exact bucketed divergence), their gradients from central differences at the
same precision. dtype f64 | f32 says in which precision C++ must reproduce them; check is
exact (to rounding) or bound (finite and at most the exact value: the logsumexp-only
fallback, see losses.h). mpmath comes with torch (through sympy).
"""
import argparse
import math
import os
import struct
import warnings

warnings.filterwarnings("ignore")
import mpmath as mp  # noqa: E402
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
        elif teacher["mode"] == "topk_tail":
            q = F.softmax(torch.cat([v, teacher["log_tail"].unsqueeze(-1)], -1), dim=-1)
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
        if mode in ("topk_lse", "topk_tail"):
            teacher["lse"] = torch.logsumexp(t / T, dim=-1).float().double()
        if mode == "topk_tail":
            tail = (t / T).scatter(-1, idx, float("-inf"))
            teacher["log_tail"] = torch.logsumexp(tail, dim=-1).float().double()
    z.requires_grad_(True)
    kd_sum = kd_per_token(kind, z, labels, T, teacher)[valid].sum()
    ce_sum = F.cross_entropy(z.reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE,
                             reduction="sum")
    loss = (ALPHA * kd_sum + (1 - ALPHA) * ce_sum) / normalizer
    (grad,) = torch.autograd.grad(loss, z)
    with open(path, "wb") as f:
        write(f, "student", z)
        write(f, "labels", labels)
        for name in ("logits", "values", "indices", "lse", "log_tail"):
            if name in teacher:
                write(f, "teacher_" + name, teacher[name])
        write(f, "normalizer", torch.tensor([normalizer], dtype=torch.float64))
        write(f, "ref_loss", loss.detach().reshape(1))
        write(f, "ref_kd", (kd_sum / normalizer).detach().reshape(1))
        write(f, "ref_ce", (ce_sum / normalizer).detach().reshape(1))
        write(f, "ref_grad", grad)


# ---- edge cases, exact (mpmath) -------------------------------------------------

mp.mp.dps = 60
NINF = mp.ninf


def m_logsumexp(xs):
    xs = [x for x in xs if x != NINF]
    if not xs:
        return NINF
    m = max(xs)
    return m + mp.log(mp.fsum(mp.exp(x - m) for x in xs))


def m_term(a, la, lb):
    """a (la - lb) with 0 log 0 = 0."""
    if a == 0:
        return mp.mpf(0)
    return mp.inf if lb == NINF else a * (la - lb)


def exact_kd(kind, z, t, idx, T, beta):
    """T^2-scaled divergence of one token between the student's logits z and the teacher's
    FULL logits t (lists of mpf), over the k+1 buckets of the teacher's top-k idx (None:
    every token is a bucket of its own)."""
    s = [x / T for x in z]
    u = [x / T for x in t]
    ls, lu = m_logsumexp(s), m_logsumexp(u)
    logp = [x - ls for x in s]
    logq = [x - lu for x in u]
    if idx is not None:
        rest = [j for j in range(len(z)) if j not in idx]
        logp = [logp[i] for i in idx] + [m_logsumexp([logp[j] for j in rest])]
        logq = [logq[i] for i in idx] + [m_logsumexp([logq[j] for j in rest])]
    p = [mp.exp(x) for x in logp]
    q = [mp.exp(x) for x in logq]
    if kind == "forward_kl":
        kd = mp.fsum(m_term(q[i], logq[i], logp[i]) for i in range(len(q)))
    elif kind == "reverse_kl":
        kd = mp.fsum(m_term(p[i], logp[i], logq[i]) for i in range(len(q)))
    else:
        logm = [mp.log(beta * q[i] + (1 - beta) * p[i]) for i in range(len(q))]
        kd = (beta * mp.fsum(m_term(q[i], logq[i], logm[i]) for i in range(len(q)))
              + (1 - beta) * mp.fsum(m_term(p[i], logp[i], logm[i]) for i in range(len(q))))
    return kd * T * T


def rounded(x, dtype):
    """x rounded to float64 or float32 (kept as a Python float); -inf stays."""
    x = float(x)
    return x if dtype == "f64" or math.isinf(x) else struct.unpack("<f", struct.pack("<f", x))[0]


def edge_case(out, name, kind, T, mode, dtype, check, z, t, k, beta=BETA):
    """One edge case with alpha = 1 (the divergence alone; ce is then not computed) and no
    ignored token. z, t: rows of student and teacher logits (floats, exact in dtype)."""
    alpha = 1.0
    n, v = len(z), len(z[0])
    zm = [[mp.mpf(x) for x in row] for row in z]
    tm = [[mp.mpf(x) for x in row] for row in t]
    idx = None
    if mode != "dense":  # the teacher's top-k by logit, ties to the lower index
        idx = [sorted(range(v), key=lambda j: (-row[j], j))[:k] for row in t]
    normalizer = float(n)
    Tm, bm = mp.mpf(T), mp.mpf(beta)

    def loss(rows):
        return mp.fsum(exact_kd(kind, rows[r], tm[r], idx and idx[r], Tm, bm) for r in range(n)) / normalizer

    ref = loss(zm)
    h = mp.mpf("1e-20")
    grad = []
    for r in range(n):
        for j in range(v):
            up = [row[:] for row in zm]
            dn = [row[:] for row in zm]
            up[r][j] += h
            dn[r][j] -= h
            grad.append(float((loss(up) - loss(dn)) / (2 * h)))
    path = os.path.join(out, name + ".bin")
    with open(path, "wb") as f:
        write(f, "student", torch.tensor(z, dtype=torch.float64))
        write(f, "labels", torch.zeros(n, dtype=torch.int64))
        if mode == "dense":
            write(f, "teacher_logits", torch.tensor(t, dtype=torch.float64))
        else:
            write(f, "teacher_values", torch.tensor([[t[r][i] for i in idx[r]] for r in range(n)],
                                                    dtype=torch.float64))
            write(f, "teacher_indices", torch.tensor(idx, dtype=torch.int64))
            lse = [rounded(m_logsumexp([x / Tm for x in tm[r]]), dtype) for r in range(n)]
            write(f, "teacher_lse", torch.tensor(lse, dtype=torch.float64))
            if mode == "topk_tail":
                tail = [rounded(m_logsumexp([tm[r][j] / Tm for j in range(v) if j not in idx[r]]), dtype)
                        for r in range(n)]
                write(f, "teacher_log_tail", torch.tensor(tail, dtype=torch.float64))
        write(f, "normalizer", torch.tensor([normalizer], dtype=torch.float64))
        write(f, "ref_loss", torch.tensor([float(ref)], dtype=torch.float64))
        write(f, "ref_kd", torch.tensor([float(ref)], dtype=torch.float64))
        write(f, "ref_ce", torch.tensor([float("nan")], dtype=torch.float64))
        write(f, "ref_grad", torch.tensor(grad, dtype=torch.float64).reshape(n, v))
    return ref, f"{name} {kind} {T} {beta} {alpha} {mode} {dtype} {check} {path}"


def edge_cases(out):
    lines = []

    def add(*a, **kw):
        ref, line = edge_case(out, *a, **kw)
        lines.append(line)
        return ref

    # 1. JSD where student and teacher both underflow in probability space: exactly 0.
    for mode, k in (("dense", None), ("topk_tail", 1)):
        ref = add(f"jsd_underflow_{mode}_f64", "jsd", 1.0, mode, "f64", "exact", [[0.0, -745.0]],
                  [[0.0, -745.0]], k)
        assert abs(ref) < 1e-50, ref
    ref = add("jsd_underflow_dense_f32", "jsd", 1.0, "dense", "f32", "exact", [[0.0, -103.5]],
              [[0.0, -103.5]], None)
    assert abs(ref) < 1e-50, ref
    # 2. Reverse KL with a teacher tail that cancels in 1 - sum q. Closed form, teacher
    # [a, 0, 0] with k = 1 and a uniform student: P = (1/3, 2/3), q_1 = 1 / (1 + 2 e^-a),
    # q_tail = 2 e^-a / (1 + 2 e^-a).
    for a, dtype in ((40.0, "f64"), (17.0, "f32")):
        for mode, check in (("topk_tail", "exact"), ("topk_lse", "bound")):
            ref = add(f"reverse_tail_{mode}_{dtype}", "reverse_kl", 1.0, mode, dtype, check,
                      [[0.0, 0.0, 0.0]], [[a, 0.0, 0.0]], 1)
            e = 2 * mp.exp(-a)
            closed = (mp.mpf(1) / 3 * mp.log(mp.mpf(1) / 3 * (1 + e))
                      + mp.mpf(2) / 3 * mp.log(mp.mpf(2) / 3 * (1 + e) / e))
            assert abs(ref - closed) < mp.mpf("1e-50"), (ref, closed)
    closed40 = float(mp.mpf(1) / 3 * mp.log((1 + 2 * mp.exp(-40)) / 3)
                     + mp.mpf(2) / 3 * mp.log((1 + 2 * mp.exp(-40)) / (3 * mp.exp(-40))))
    assert abs(closed40 - 25.57) < 5e-3, closed40  # the figure
    # 3. Forward KL with k = V, and with every non-top-k logit -inf (student and teacher):
    # the bucketed loss is the dense one.
    g = torch.Generator().manual_seed(14)
    z = (torch.randn(2, 6, generator=g) * 2).float().double().tolist()
    t = (torch.randn(2, 6, generator=g) * 3).float().double().tolist()
    zi = [row[:3] + [float("-inf")] * 3 for row in z]
    ti = [[x + 5 for x in row[:3]] + [float("-inf")] * 3 for row in t]
    for mode in ("topk_tail", "topk_lse"):
        for dtype in ("f64", "f32"):
            ref = add(f"forward_kV_{mode}_{dtype}", "forward_kl", 2.0, mode, dtype, "exact", z, t, 6)
            dense = sum(exact_kd("forward_kl", [mp.mpf(x) for x in z[r]], [mp.mpf(x) for x in t[r]],
                                 None, mp.mpf(2), mp.mpf(BETA)) for r in range(2)) / 2
            assert abs(ref - dense) < mp.mpf("1e-50")
        add(f"forward_ninf_{mode}_f64", "forward_kl", 1.0, mode, "f64", "exact", zi, ti, 3)
    with open(os.path.join(out, "edge_cases.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--edge", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=19)
    ap.add_argument("--vocab", type=int, default=101)
    ap.add_argument("--topk", type=int, default=8)
    a = ap.parse_args()
    torch.set_default_dtype(torch.float64)
    os.makedirs(a.out, exist_ok=True)
    if a.edge:
        edge_cases(a.out)
        return
    lines = []
    i = 0
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        for T in (1.0, 2.5):
            for mode in ("dense", "topk", "topk_lse", "topk_tail"):
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
