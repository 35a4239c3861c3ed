"""Hugging Face `transformers` models with distill (the optional extra: pip install .[hf]).

A `PreTrainedModel` is a teacher in one line, `distill.serve(session, model)`: serve() wraps it in
HFTeacher, which calls it with the request's tensors by name (teacher.inputs: input_ids, and
attention_mask when named), with use_cache=False, and returns only teacher.output (default
"logits") of its ModelOutput. An HF student's ModelOutput goes to `distill.Steps.backward` as it
is (its `logits` are taken). Nothing here imports transformers."""

from typing import Any, List

import torch

__all__ = ["HFTeacher", "is_hf_model", "logits_of"]


def is_hf_model(model: Any) -> bool:
    """A transformers PreTrainedModel (checked by class name: transformers need not be imported)."""
    return any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


def config_list(text: str) -> List[str]:
    """A list value of session.config ("[input_ids, attention_mask]") as its names."""
    return [v.strip().strip("'\"") for v in text.strip().strip("[]").split(",") if v.strip()]


class HFTeacher(torch.nn.Module):
    """A PreTrainedModel as distill's Python teacher: model(**{teacher.inputs[i]: inputs[i]},
    use_cache=False)[teacher.output]. The cache keys on the model's parameters and buffers."""

    def __init__(self, model: torch.nn.Module, inputs: List[str], output: str = "logits") -> None:
        super().__init__()
        self.model, self.inputs, self.output = model, list(inputs), output

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        out = self.model(**dict(zip(self.inputs, tensors)), use_cache=False, return_dict=True)
        if self.output not in out:
            raise KeyError(f"the Hugging Face model's output has no '{self.output}' (teacher.output); "
                           f"it has: {', '.join(out.keys())}")
        return out[self.output]


def logits_of(output: Any) -> torch.Tensor:
    """A student's forward result as the loss's logits: a tensor, or a ModelOutput's `logits`.

    Raises:
        TypeError: `output` is neither a tensor nor has a `logits` tensor.
    """
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TypeError("distill.Steps.backward takes the student's logits: a tensor or a model output with "
                    f"a `logits` tensor (a Hugging Face ModelOutput); got {type(output).__name__}")
