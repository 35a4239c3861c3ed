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


def test_a_bad_argument_is_a_usage_error():
    # An argument of the call, not a config key: UsageError, in Python as in C++.
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(4, 3, generator=g), torch.randn(9, 3, generator=g)
    labels = torch.randint(0, 9, (4,), generator=g)
    t = {"logits": torch.randn(4, 9, generator=g)}
    with pytest.raises(distill.UsageError, match="chunk_tokens must be >= 0"):
        distill.fused_linear_loss(h, w, None, labels, t, 4, chunk_tokens=-1)
    with pytest.raises(distill.UsageError, match="normalizer"):
        distill.loss(h @ w.T, labels, t, -1)
    assert not issubclass(distill.UsageError, distill.ConfigError)


def _teacher(t, form, T):
    if form == "full":
        return {"logits": t}
    v, i = t.topk(5, -1)
    return {"topk_values": v, "topk_indices": i, "logsumexp": torch.logsumexp(t / T, -1)}


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("form", ["full", "topk"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fused_linear_loss_equals_the_loss_on_materialised_logits(kind, form, with_bias):
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(3, 7, 6, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(6, 23, bias=with_bias, dtype=torch.float64)
    t = 2 * torch.randn(3, 7, 23, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 23, (3, 7), generator=g)
    labels[0, :] = -100  # with chunk_tokens=4 tokens 0..6 would hold a chunk without a valid token
    labels[2, 3] = -100
    teacher = _teacher(t.reshape(21, 23), form, 1.5)
    opts = dict(alpha=0.4, temperature=1.5, kind=kind)
    want = distill.loss(head(hidden), labels, teacher, 19, **opts)
    want.loss.backward()
    params = [hidden] + list(head.parameters())
    wants = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    got = distill.fused_linear_loss(hidden, head.weight, head.bias, labels, teacher, 19, chunk_tokens=4, **opts)
    got.loss.backward()
    assert got.tokens == want.tokens == 13
    assert math.isclose(got.loss.item(), want.loss.item(), rel_tol=1e-6)
    assert math.isclose(got.kd.item(), want.kd.item(), rel_tol=1e-6)
    for p, w in zip(params, wants):
        assert (p.grad - w).abs().max().item() <= 1e-6 * w.abs().max().item()


def test_an_autocast_forward_meets_a_float32_lm_head():
    """Steps.backward(hidden, lm_head=...) after a bf16 autocast forward: lm_head's float32 weight is
    cast to the hidden states' dtype (as autocast's linear does) and its gradient reaches the float32
    parameter, equal to the loss on the materialised bf16 logits."""
    from distill.steps import _autocast_operands

    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(12, 8, generator=g).to(torch.bfloat16).requires_grad_()
    lm = torch.nn.Linear(8, 40)
    labels = torch.randint(0, 40, (12,), generator=g)
    teacher = {"logits": torch.randn(12, 40, generator=g)}
    w, b = _autocast_operands(hidden, lm.weight, lm.bias)
    assert w.dtype == b.dtype == torch.bfloat16
    distill.fused_linear_loss(hidden, w, b, labels, teacher, 12).loss.backward()
    assert lm.weight.grad is not None and lm.weight.grad.dtype == torch.float32
    got = lm.weight.grad.clone()
    lm.weight.grad = None
    logits = torch.nn.functional.linear(hidden.detach(), lm.weight.to(torch.bfloat16), lm.bias.to(torch.bfloat16))
    distill.loss(logits, labels, teacher, 12).loss.backward()
    assert torch.allclose(got, lm.weight.grad, rtol=2e-2, atol=1e-3)
    assert _autocast_operands(hidden.float(), lm.weight, lm.bias)[0] is lm.weight  # float32: unchanged
