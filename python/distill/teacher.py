"""distill.serve: a Python teacher (teacher.kind: self). The serving loop is C++; the forward is
the module's, called with the request's tensors (teacher.inputs order) under inference mode."""

from typing import Dict

import torch

from . import _C
from .hf import HFTeacher, config_list, is_hf_model


def serve(session, model: torch.nn.Module, fingerprint: str = "") -> Dict[str, object]:
    """Answers every request of this teacher's students until they have all finished; returns
    the counts (requests, errors, batches, forward_seconds, wall_seconds, per_student).

    model(*inputs) returns the output tensor (teacher.output), a tuple whose first element is
    it, or a dict of named tensors. Put it on session.teacher_device first. The teacher-output
    cache (teacher.cache) keys on its parameters and buffers and on `fingerprint`.

    A Hugging Face PreTrainedModel is served as it is: called with the request's tensors by name
    (teacher.inputs: input_ids, attention_mask), use_cache=False, its ModelOutput's teacher.output
    taken (distill.hf.HFTeacher)."""
    if is_hf_model(model):
        output = session.config["teacher.output"].strip("\"'")
        model = HFTeacher(model, config_list(session.config["teacher.inputs"]), output)
    if isinstance(model, torch.nn.Module):
        model.eval()
    return _C._serve(session._c, model, fingerprint)
