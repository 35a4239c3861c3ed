"""bench/fused_linear_gpu.py: the fused linear loss on a GPU, time and peak memory of a forward and
backward, against materialising the [N, V] logits, and against a fused linear cross-entropy.

    PYTHONPATH=build/python python3 bench/fused_linear_gpu.py [--n 8192] [--d 4096] [--v 128256]
        [--topk 64] [--reps 5] [--dtype bfloat16] [--out bench/results/fused_linear_gpu.jsonl]

Variants (the same hidden [N, d], weight [V, d] and labels in each, --dtype; teacher top-k):
  eager_ce          logits = hidden @ weight.T, then F.cross_entropy on float32 logits (what an
                    HF model's loss does): the baseline of the published fused-CE figures
  liger_flce        Liger-Kernel's LigerFusedLinearCrossEntropyLoss (when liger_kernel imports)
  distill_ce_fused  distill.fused_linear_loss with alpha 0 (cross-entropy only)
  eager_distill     logits materialised, then distill.loss (forward KL on the teacher's top-k, alpha 0.5)
  distill_fused     distill.fused_linear_loss, the same loss, the logits never held
Each line: the median milliseconds of forward + backward (CUDA events, after warm-up) and the peak
memory the step allocated above its inputs (torch.cuda.max_memory_allocated). A last line gives the
loss and gradient agreement of distill_fused with eager_distill, and the ratios.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=8192)
    p.add_argument("--d", type=int, default=4096)
    p.add_argument("--v", type=int, default=128256)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--chunk-tokens", type=int, default=0)
    p.add_argument("--out", default="bench/results/fused_linear_gpu.jsonl")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (no memory figures)")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("fused_linear_gpu: no CUDA device visible", file=sys.stderr)
        return 3
    import distill

    dev = torch.device(a.device)
    on_gpu = dev.type == "cuda"
    dt = getattr(torch, a.dtype)
    g = torch.Generator(device=dev).manual_seed(1)
    hidden = (torch.randn(a.n, a.d, device=dev, generator=g) * 0.5).to(dt).requires_grad_()
    weight = (torch.randn(a.v, a.d, device=dev, generator=g) / a.d ** 0.5).to(dt).requires_grad_()
    labels = torch.randint(0, a.v, (a.n,), device=dev, generator=g)
    labels[: a.n // 16] = -100
    with torch.no_grad():  # a teacher's top-k answer: a perturbed student projection, chunked
        vals, idx, lse = [], [], []
        for s in range(0, a.n, 1024):
            t = (hidden[s:s + 1024] @ weight.T).float() + torch.randn(min(1024, a.n - s), a.v, device=dev, generator=g)
            v, i = t.topk(a.topk, -1)
            vals.append(v)
            idx.append(i)
            lse.append(torch.logsumexp(t, -1))
            del t
        teacher = {"topk_values": torch.cat(vals), "topk_indices": torch.cat(idx), "logsumexp": torch.cat(lse)}
    tokens = int((labels != -100).sum())
    machine = {"gpu": torch.cuda.get_device_name() if on_gpu else "none (cpu)", "torch": torch.__version__, "cuda": torch.version.cuda,
               "n": a.n, "d": a.d, "v": a.v, "topk": a.topk, "dtype": a.dtype}

    def eager_ce():
        logits = hidden @ weight.T
        return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100)

    def distill_ce_fused():
        return distill.fused_linear_loss(hidden, weight, None, labels, teacher, tokens, alpha=0.0,
                                         chunk_tokens=a.chunk_tokens).loss

    def eager_distill():
        return distill.loss(hidden @ weight.T, labels, teacher, tokens, alpha=0.5, kind="forward_kl").loss

    def distill_fused():
        return distill.fused_linear_loss(hidden, weight, None, labels, teacher, tokens, alpha=0.5, kind="forward_kl",
                                         chunk_tokens=a.chunk_tokens).loss

    variants = [("eager_ce", eager_ce)]
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        flce = LigerFusedLinearCrossEntropyLoss()
        variants.append(("liger_flce", lambda: flce(weight, hidden, labels)))
    except Exception as e:  # noqa: BLE001 - the bench goes on without it, and says why
        print(json.dumps({"bench": "fused_linear_gpu", "variant": "liger_flce", "skipped": repr(e)[:300]}))
    variants += [("distill_ce_fused", distill_ce_fused), ("eager_distill", eager_distill),
                 ("distill_fused", distill_fused)]

    def run(fn):
        hidden.grad = None
        weight.grad = None
        loss = fn()
        loss.backward()
        return loss

    results, lines = {}, []
    for name, fn in variants:
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        try:
            for _ in range(a.warmup):
                run(fn)
            times = []
            for _ in range(a.reps):
                if on_gpu:
                    torch.cuda.synchronize()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    loss = run(fn)
                    e1.record()
                    torch.cuda.synchronize()
                    times.append(e0.elapsed_time(e1))
                else:
                    t0 = time.perf_counter()
                    loss = run(fn)
                    times.append((time.perf_counter() - t0) * 1e3)
            peak = torch.cuda.max_memory_allocated() - base if on_gpu else 0
            r = {"bench": "fused_linear_gpu", "variant": name, "ms_p50": round(statistics.median(times), 3),
                 "ms_min": round(min(times), 3), "peak_gib": round(peak / 2**30, 3), "loss": loss.item(),
                 "finite": bool(torch.isfinite(loss)), **machine}
            results[name] = (r, hidden.grad.float().clone(), weight.grad.float().clone())
        except torch.OutOfMemoryError as e:
            r = {"bench": "fused_linear_gpu", "variant": name, "error": "out of memory: " + str(e)[:200], **machine}
        except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
            r = {"bench": "fused_linear_gpu", "variant": name, "error": repr(e)[:500], **machine}
        hidden.grad = None
        weight.grad = None
        print(json.dumps(r), flush=True)
        lines.append(r)

    summary = {"bench": "fused_linear_gpu", "summary": True, **machine}
    if "eager_distill" in results and "distill_fused" in results:
        (re_, he, we), (rf, hf, wf) = results["eager_distill"], results["distill_fused"]
        summary["loss_rel_diff"] = abs(rf["loss"] - re_["loss"]) / max(abs(re_["loss"]), 1e-30)
        summary["grad_hidden_rel"] = float((hf - he).norm() / he.norm())
        summary["grad_weight_rel"] = float((wf - we).norm() / we.norm())
        summary["fused_vs_eager_time"] = round(rf["ms_p50"] / re_["ms_p50"], 3)
        summary["fused_vs_eager_peak"] = round(rf["peak_gib"] / max(re_["peak_gib"], 1e-9), 3)
    for a_, b_ in (("distill_ce_fused", "liger_flce"), ("distill_ce_fused", "eager_ce")):
        if a_ in results and b_ in results:
            summary[f"{a_}_vs_{b_}_time"] = round(results[a_][0]["ms_p50"] / results[b_][0]["ms_p50"], 3)
            summary[f"{a_}_vs_{b_}_peak"] = round(results[a_][0]["peak_gib"] / max(results[b_][0]["peak_gib"], 1e-9), 3)
            summary[f"{a_}_vs_{b_}_loss_rel"] = abs(results[a_][0]["loss"] - results[b_][0]["loss"]) / abs(
                results[b_][0]["loss"])
    print(json.dumps(summary), flush=True)
    lines.append(summary)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "a") as f:
        for r in lines:
            f.write(json.dumps(r) + "\n")
    print(f"fused_linear_gpu: {len(lines)} lines appended to {a.out}", file=sys.stderr)
    return 0 if all("error" not in r for r in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
