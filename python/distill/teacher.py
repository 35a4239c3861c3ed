"""distill.serve: a Python teacher (teacher.kind: self). The serving loop is C++; the forward is
the module's, called with the request's tensors (teacher.inputs order) under inference mode."""

import contextlib
import signal
import sys
import threading
from typing import Dict

import torch

from . import _C
from .hf import HFTeacher, config_list, is_hf_model


@contextlib.contextmanager
def _sigint_while_serving(session):
    """Ctrl-C reaches every rank of a distill-run job: the students stop after the current step
    and tell the teacher, which then returns. So the teacher's first Ctrl-C only says so (it
    serves the students' last step); a second interrupts it (KeyboardInterrupt, the job fails
    naming the teacher). A handler the trainer installed is left alone."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    seen = []

    def on_sigint(signum, frame):
        if seen:
            raise KeyboardInterrupt
        seen.append(signum)
        print(f"[distill] teacher {session.teacher_index}: Ctrl-C: serving until the students stop (they stop "
              "after this step); Ctrl-C again interrupts", file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def serve(session, model: torch.nn.Module, fingerprint: str = "") -> Dict[str, object]:
    """Answers every request of this teacher's students until they have all finished; returns
    the counts (requests, errors, batches, forward_seconds, wall_seconds, per_student).

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
    taken (distill.hf.HFTeacher)."""
    if is_hf_model(model):
        output = session.config["teacher.output"].strip("\"'")
        model = HFTeacher(model, config_list(session.config["teacher.inputs"]), output)
    if isinstance(model, torch.nn.Module):
        model.eval()
    with _sigint_while_serving(session):
        return _C._serve(session._c, model, fingerprint)
