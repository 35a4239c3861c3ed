"""The teacher's head for teacher.answer: hidden (docs/teacher.md, "The hidden-state answer"): the
teacher sends the input of its output layer, its final hidden states [B, T, d_t], and publishes the
layer once per node at serve() start; the students make the teacher's logits from both, chunk by
chunk in the loss, so that the [N, V] logits are never sent nor held."""

from typing import Any, NamedTuple, Optional

import torch

__all__ = ["TeacherHead", "head_of", "head_logits"]


class TeacherHead(NamedTuple):
    """A teacher's output layer, for teacher.answer: hidden (docs/teacher.md, "The hidden-state
    answer"): its logits are transform(hidden @ weight.T + bias), where transform multiplies by
    `scale` (1: none), then soft-caps, softcap * tanh(z / softcap) (0: none). Published once per
    node at serve() start; the students make the teacher's logits from it and the hidden states."""

    weight: torch.Tensor  # [V_t, d_t]
    bias: Optional[torch.Tensor] = None  # [V_t], or None
    softcap: float = 0.0
    scale: float = 1.0


def head_of(head: Any) -> TeacherHead:
    """distill.serve's head= argument as a TeacherHead: a TeacherHead, a torch.nn.Linear (its
    weight and bias), a weight tensor [V, d], or a (weight, bias) pair.

    Raises:
        ConfigError: anything else, or a weight that is not [V, d] or a bias that is not [V].
    """
    from . import _C

    if isinstance(head, TeacherHead):
        out = head
    elif isinstance(head, torch.nn.Linear):
        out = TeacherHead(head.weight, head.bias)
    elif isinstance(head, torch.Tensor):
        out = TeacherHead(head)
    elif isinstance(head, (tuple, list)) and len(head) == 2 and isinstance(head[0], torch.Tensor):
        out = TeacherHead(head[0], head[1])
    else:
        raise _C.ConfigError("distill.serve: head must be a distill.TeacherHead, a torch.nn.Linear, a weight "
                             f"tensor [V, d] or a (weight, bias) pair, found {type(head).__name__}")
    w, b = out.weight, out.bias
    if w.dim() != 2 or (b is not None and (not isinstance(b, torch.Tensor) or tuple(b.shape) != (w.size(0),))):
        raise _C.ConfigError(f"distill.serve: the head's weight must be [V, d] and its bias [V] or None; found "
                             f"weight {list(w.shape)}, bias {None if b is None else list(getattr(b, 'shape', []))}")
    return out._replace(softcap=float(out.softcap), scale=float(out.scale))


def head_logits(hidden: torch.Tensor, head: TeacherHead, chunk_tokens: int = 0) -> torch.Tensor:
    """The teacher's logits [..., V_t] from its hidden states [..., d_t] and head, in the head's
    dtype, without gradient: distill::teacherLogits, what the students compute (chunk_tokens rows
    at a time; 0: automatic). distill.serve checks a Hugging Face teacher's head with it.

    Raises:
        UsageError: a head that is not one (shapes, dtypes, softcap, scale).
        ProtocolError: hidden states that do not fit the head.
    """
    from . import _C

    h = head_of(head)
    return _C._teacher_logits(hidden, (h.weight, h.bias, h.softcap, h.scale), int(chunk_tokens))
