"""distill.serve: a Python teacher (teacher.kind: self). The serving loop is C++; the forward is
the module's, called with the request's tensors (teacher.inputs order) under inference mode."""

import contextlib
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Optional, Union

import torch

from . import _C
from .head import TeacherHead, head_of
from .hf import HFTeacher, is_hf_model

if TYPE_CHECKING:
    from .session import Session

__all__ = ["serve"]


@contextlib.contextmanager
def _sigint_while_serving(session: "Session") -> Iterator[None]:
    """distill-run's Ctrl-C reaches every rank of a job: the students stop after the current step
    and tell the teacher, which then returns. So the teacher's first Ctrl-C only says what it does
    (it serves on until its students finish: it cannot stop them, and a Ctrl-C to the teacher
    alone leaves them training); a second interrupts it (KeyboardInterrupt, the job fails naming
    the teacher). A handler the trainer installed is left alone."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    seen: "list[int]" = []

    def on_sigint(signum: int, frame: Any) -> None:
        if seen:
            raise KeyboardInterrupt
        seen.append(signum)
        # The teacher cannot stop its students: only a Ctrl-C that reached them (distill-run's reaches
        # every rank) does. Say so, rather than promise a stop that a Ctrl-C to this rank alone is not.
        print(f"[distill] teacher {session.teacher_index}: Ctrl-C: serving until the students finish; a Ctrl-C "
              "to distill-run stops them after their current step, one to this teacher alone does not; Ctrl-C "
              "again interrupts this teacher (the job then fails, naming it)", file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _declared_head(session: "Session", model: Any, hf: Optional[HFTeacher], head: Any) -> Optional[TeacherHead]:
    """teacher.answer hidden: the head serve() publishes. `head` when given; a Hugging Face model's own
    (HFTeacher, checked on a probe); else None: teacher.head.weight and .bias name parameters or buffers
    of the module (ConfigError here, in Python's words, when it has none of that name)."""
    t = session.config.teacher
    if hf is not None:
        assert hf.head is not None
        if head is None:
            hf.check_head()
            found = hf.head
            if (t.head.softcap, t.head.scale) not in ((0.0, 1.0), (found.softcap, found.scale)):
                raise _C.ConfigError(
                    f"teacher.head: softcap {t.head.softcap} and scale {t.head.scale} differ from what the Hugging "
                    f"Face model (type '{getattr(model.config, 'model_type', '?')}') declares, softcap "
                    f"{found.softcap} and scale {found.scale}: leave them out (its own are used), or pass the "
                    "head to distill.serve(session, model, head=distill.TeacherHead(...))")
        return hf.head
    if head is not None:
        return head_of(head)
    names: "set[str]" = set()
    if isinstance(model, torch.nn.Module):
        names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    if t.head.weight not in names:
        raise _C.ConfigError(
            f"teacher.answer hidden: the Python teacher (a {type(model).__qualname__}) has no parameter or buffer "
            f"'{t.head.weight}' (teacher.head.weight) to publish as its output layer: pass the head to "
            "distill.serve(session, model, head=...) (a torch.nn.Linear, its weight, a (weight, bias) pair or a "
            "distill.TeacherHead), or name it with teacher.head.weight and teacher.head.bias")
    return None


def serve(session: "Session", model: Union[torch.nn.Module, Callable[..., Any]], fingerprint: str = "",
          share_prefix: int = 16, head: Any = None) -> Dict[str, Any]:
    """Answers every request of this teacher's students until they have all finished; returns
    the counts (requests, errors, masked, batches, forward_seconds, wall_seconds, per_student).

    model(*inputs) returns the output tensor (teacher.output), a tuple whose first element is
    it, or a dict of named tensors. Put it on session.teacher_device first. The teacher-output
    cache (teacher.cache) keys on its parameters and buffers and on `fingerprint` (a model
    without parameters, e.g. a function, needs one). An exception of the forward ends serve()
    with it: the teacher fails, and distill-run names it.

    With teacher.autocast (bfloat16 or float16), the forward runs under torch.autocast of the
    teacher's device type ("cpu" or "cuda") and that dtype, as if wrapped in `with
    torch.autocast(...)`; its logits or top-k values then travel in that dtype
    (teacher.payload_dtype: auto).

    A Hugging Face PreTrainedModel is served as it is: called with the request's tensors by name
    (teacher.inputs: input_ids, attention_mask), use_cache=False, its ModelOutput's teacher.output
    taken (distill.hf.HFTeacher). Consecutive rows sharing a prefix of share_prefix tokens or more
    (the G samples of a prompt, docs/onpolicy.md) have it computed once (0: never); the counts
    then include teacher_tokens (token positions computed) and teacher_tokens_unshared.

    teacher.answer hidden (docs/teacher.md, "The hidden-state answer"): the teacher answers with the
    input of its output layer, [B, T, d_t], and publishes the layer (its head) once per node at
    start-up; the students make its logits from both. A Hugging Face model needs nothing more: the
    hidden states are what its get_output_embeddings() layer receives (a forward pre-hook, which
    also gives that layer no positions, so the [B, T, V] logits are not computed), its head is that
    torch.nn.Linear's weight and bias with the transforms its config declares (Gemma 2's
    final_logit_softcapping, Cohere's logit_scale, Granite's logits_scaling), checked at start-up
    against its own logits on a 4-token probe; a head that is none of these is refused, naming the
    model type. Any other model's forward returns the hidden states itself, and its head is
    `head` (a torch.nn.Linear, its weight [V, d], a (weight, bias) pair, or a distill.TeacherHead
    with softcap and scale), or else the parameters teacher.head.weight and teacher.head.bias name.

    Args:
        session: the teacher's session (session.is_teacher).
        model: a torch.nn.Module, a PreTrainedModel, or a function of the request's tensors.
        fingerprint: identifies the model in the teacher-output cache (required without parameters).
        share_prefix: a Hugging Face model's shortest shared prefix computed once per group (0: off).
        head: teacher.answer hidden: the output layer to publish (a Hugging Face model's own when None).

    Returns:
        The counts: requests, errors, batches, forward_seconds, wall_seconds, per_student
        (and teacher_tokens, teacher_tokens_unshared for a Hugging Face model).

    Raises:
        ConfigError: this process is a student, or a model without parameters and no fingerprint
            while teacher.cache is on; teacher.answer hidden with a head refused (naming the model
            type) or not declared.
        Exception: what the model's forward raised.
    """
    hf = None
    hidden = session.is_teacher and session.config.teacher.answer == "hidden"
    if isinstance(model, torch.nn.Module):
        model.eval()
    if isinstance(model, torch.nn.Module) and is_hf_model(model):
        given = head_of(head) if head is not None else None
        model = hf = HFTeacher(model, session.config.teacher.inputs, session.config.teacher.output, share_prefix,
                               hidden=hidden, head=given)
    declared = _declared_head(session, model if hf is None else hf.model, hf, head) if hidden else None
    spec = None if declared is None else (declared.weight, declared.bias, declared.softcap, declared.scale)
    with _sigint_while_serving(session):
        stats = _C._serve(session._c, model, fingerprint, spec)
    if hf is not None:
        stats["teacher_tokens"], stats["teacher_tokens_unshared"] = hf.tokens, hf.tokens_unshared
    return stats
