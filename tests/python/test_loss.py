"""distill.loss in-process: its value and gradient (autograd through the C++ kernels) against the
loss written out in torch, in float64, full and top-k teacher outputs."""

import math

import pytest
import torch

import distill


def reference(logits, labels, t_logits, alpha, T, kind, normalizer):
    mask = labels != -100
    log_s, log_t = torch.log_softmax(logits / T, -1), torch.log_softmax(t_logits / T, -1)
    if kind == "forward_kl":
        div = (log_t.exp() * (log_t - log_s)).sum(-1)
    else:  # reverse_kl
        div = (log_s.exp() * (log_s - log_t)).sum(-1)
    kd = T * T * div[mask].sum() / normalizer
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                           reduction="sum") / normalizer
    return alpha * kd + (1 - alpha) * ce, kd, ce


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl"])
@pytest.mark.parametrize("T", [1.0, 2.0])
def test_loss_and_gradient_equal_the_written_out_loss(kind, T):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    t_logits = 3 * torch.randn(3, 5, 11, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    labels[0, :2] = -100
    n = distill.count_tokens(labels, -100) + 4  # the step's count: other micro-batches' tokens too
    got = distill.loss(logits, labels, {"logits": t_logits}, n, alpha=0.3, temperature=T, kind=kind)
    got.loss.backward()
    g_got = logits.grad.clone()
    logits.grad = None
    want, kd, ce = reference(logits, labels, t_logits, 0.3, T, kind, n)
    want.backward()
    assert got.tokens == 13
    assert math.isclose(got.loss.item(), want.item(), rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(got.kd.item(), kd.item(), rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(got.ce.item(), ce.item(), rel_tol=1e-9, abs_tol=1e-12)
    assert torch.allclose(g_got, logits.grad, rtol=1e-9, atol=1e-12)


def test_topk_with_the_whole_vocabulary_equals_full_logits():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 9, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn(4, 9, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 9, (4,), generator=g)
    full = distill.loss(logits, labels, {"logits": t}, 4)
    v, i = t.topk(9, -1)
    topk = distill.loss(logits, labels, {"topk_values": v, "topk_indices": i}, 4)
    assert math.isclose(full.loss.item(), topk.loss.item(), rel_tol=1e-9)


def test_a_bad_override_is_a_config_error():
    x = torch.zeros(2, 3)
    with pytest.raises(distill.ConfigError, match="temperature"):
        distill.loss(x, torch.zeros(2, dtype=torch.long), {"logits": x}, 2, temperature=-1)
