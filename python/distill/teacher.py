"""distill.serve: a Python teacher (teacher.kind: self). The serving loop is C++; the forward is
the module's, called with the request's tensors (teacher.inputs order) under inference mode."""

import contextlib
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Union

import torch

from . import _C
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


def serve(session: "Session", model: Union[torch.nn.Module, Callable[..., Any]], fingerprint: str = "",
          share_prefix: int = 16) -> Dict[str, Any]:
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

    Args:
        session: the teacher's session (session.is_teacher).
        model: a torch.nn.Module, a PreTrainedModel, or a function of the request's tensors.
        fingerprint: identifies the model in the teacher-output cache (required without parameters).
        share_prefix: a Hugging Face model's shortest shared prefix computed once per group (0: off).

    Returns:
        The counts: requests, errors, batches, forward_seconds, wall_seconds, per_student
        (and teacher_tokens, teacher_tokens_unshared for a Hugging Face model).

    Raises:
        ConfigError: this process is a student, or a model without parameters and no fingerprint
            while teacher.cache is on.
        Exception: what the model's forward raised.
    """
    hf = None
    if isinstance(model, torch.nn.Module) and is_hf_model(model):
        model = hf = HFTeacher(model, session.config.teacher.inputs, session.config.teacher.output, share_prefix)
    if isinstance(model, torch.nn.Module):
        model.eval()
    with _sigint_while_serving(session):
        stats = _C._serve(session._c, model, fingerprint)
    if hf is not None:
        stats["teacher_tokens"], stats["teacher_tokens_unshared"] = hf.tokens, hf.tokens_unshared
    return stats
