"""distill.loss: the C++ fused distillation loss, with autograd, on torch tensors."""

from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Optional, Union

import torch

from . import _C

if TYPE_CHECKING:
    from .session import Session

__all__ = ["LossResult", "loss", "fused_linear_loss"]

Teacher = Union["_C.Reply", Mapping[str, torch.Tensor]]  # the teacher's answer, as loss() takes it


class LossResult(NamedTuple):
    """The loss of a micro-batch and its parts."""

    loss: torch.Tensor  # 0-dim, alpha * kd + (1 - alpha) * ce: the one with a gradient
    kd: torch.Tensor  # 0-dim, detached (NaN when loss.alpha is 0)
    ce: torch.Tensor  # 0-dim, detached (NaN when loss.alpha is 1)
    tokens: int  # non-ignored labels of this call
    # loss.vocab truncate (docs/vocab.md): the teacher probability its ids >= the student's vocabulary
    # held, the most of any non-ignored token and the sum over them; -1 both when nothing was truncated
    truncated_mass_max: float = -1.0
    truncated_mass_sum: float = -1.0


def loss(logits: torch.Tensor, labels: torch.Tensor, teacher: Teacher, normalizer: float,
         session: Optional["Session"] = None, **overrides: Any) -> LossResult:
    """The loss of one micro-batch, as distill::distillLoss computes it (the same kernels).

    teacher: a Reply (session.get) or a dict with "logits", or "topk_values"/"topk_indices"
    (+ "logsumexp"/"log_tail"), and optionally "vocab": the teacher's vocabulary size, checked
    against the student's as loss.vocab says (docs/vocab.md). normalizer: the step's global non-ignored token count (the sum
    of count_tokens over every micro-batch of the step on every student), so that summed
    gradients are the mean over the step's tokens. The options are the session's loss section
    (no session: the config's defaults); keyword arguments override them (temperature=2.0,
    alpha=0.5, kind="jsd", ignore_index=-1, ...), checked as the config's keys are.

    Args:
        logits: the student's logits [..., V].
        labels: the labels [...] (loss.ignore_index masks a position out).
        teacher: the teacher's answer for the same positions.
        normalizer: the step's global non-ignored token count.
        session: the loss options' source (None: the config's defaults).
        overrides: loss options by key name, over the session's.

    Returns:
        The LossResult; its `loss` has the gradient.

    Raises:
        ConfigError: an unknown or out-of-range option, or shapes that do not match.
    """
    c = session._c if session is not None else None
    return LossResult(*_C._loss(logits, labels, teacher, float(normalizer), c, overrides))


def fused_linear_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], labels: torch.Tensor,
                      teacher: Teacher, normalizer: float, session: Optional["Session"] = None, chunk_tokens: int = 0,
                      **overrides: Any) -> LossResult:
    """The loss of one micro-batch from the student's last hidden states [..., d] and its output
    projection (weight [V, d], bias [V] or None), as distill::fusedLinearLoss computes it: the same
    value and gradients as loss(hidden @ weight.T + bias, ...), with the projection chunked together
    with the loss (chunk_tokens tokens at a time; 0: automatic), so the [N, V] logits and their
    gradient are never held. Gradients reach hidden, weight and bias through autograd as usual.
    labels, teacher, normalizer, session and the keyword overrides are those of loss().

    Returns:
        The LossResult, as loss() returns it.

    Raises:
        ConfigError: as loss(); also a weight or bias whose shape does not match hidden.
    """
    c = session._c if session is not None else None
    return LossResult(*_C._fused_linear_loss(hidden, weight, bias, labels, teacher, float(normalizer), c,
                                             int(chunk_tokens), overrides))
