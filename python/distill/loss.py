"""distill.loss: the C++ fused distillation loss, with autograd, on torch tensors."""

from typing import NamedTuple

import torch

from . import _C


class LossResult(NamedTuple):
    loss: torch.Tensor  # 0-dim, alpha * kd + (1 - alpha) * ce: the one with a gradient
    kd: torch.Tensor  # 0-dim, detached (NaN when loss.alpha is 0)
    ce: torch.Tensor  # 0-dim, detached (NaN when loss.alpha is 1)
    tokens: int  # non-ignored labels of this call
    # loss.vocab truncate (docs/vocab.md): the teacher probability its ids >= the student's vocabulary
    # held, the most of any non-ignored token and the sum over them; -1 both when nothing was truncated
    truncated_mass_max: float = -1.0
    truncated_mass_sum: float = -1.0


def loss(logits, labels, teacher, normalizer: float, session=None, **overrides) -> LossResult:
    """The loss of one micro-batch, as distill::distillLoss computes it (the same kernels).

    teacher: a Reply (session.get) or a dict with "logits", or "topk_values"/"topk_indices"
    (+ "logsumexp"/"log_tail"), and optionally "vocab": the teacher's vocabulary size, checked
    against the student's as loss.vocab says (docs/vocab.md). normalizer: the step's global non-ignored token count (the sum
    of count_tokens over every micro-batch of the step on every student), so that summed
    gradients are the mean over the step's tokens. The options are the session's loss section
    (no session: the config's defaults); keyword arguments override them (temperature=2.0,
    alpha=0.5, kind="jsd", ignore_index=-1, ...), checked as the config's keys are."""
    c = session._c if session is not None else None
    return LossResult(*_C._loss(logits, labels, teacher, float(normalizer), c, overrides))


def fused_linear_loss(hidden, weight, bias, labels, teacher, normalizer: float, session=None, chunk_tokens: int = 0,
                      **overrides) -> LossResult:
    """The loss of one micro-batch from the student's last hidden states [..., d] and its output
    projection (weight [V, d], bias [V] or None), as distill::fusedLinearLoss computes it: the same
    value and gradients as loss(hidden @ weight.T + bias, ...), with the projection chunked together
    with the loss (chunk_tokens tokens at a time; 0: automatic), so the [N, V] logits and their
    gradient are never held. Gradients reach hidden, weight and bias through autograd as usual.
    labels, teacher, normalizer, session and the keyword overrides are those of loss()."""
    c = session._c if session is not None else None
    return LossResult(*_C._fused_linear_loss(hidden, weight, bias, labels, teacher, float(normalizer), c,
                                             int(chunk_tokens), overrides))
