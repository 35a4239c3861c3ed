"""Hugging Face `transformers` models with distill (the optional extra: pip install --no-build-isolation '.[hf]').

A `PreTrainedModel` is a teacher in one line, `distill.serve(session, model)`: serve() wraps it in
HFTeacher, which calls it with the request's tensors by name (teacher.inputs: input_ids, and
attention_mask when named), with use_cache=False, and returns only teacher.output (default
"logits") of its ModelOutput; consecutive rows that share a prompt (on-policy groups,
docs/onpolicy.md) have it computed once. An HF student's ModelOutput goes to `distill.Steps.backward` as it
is (its `logits` are taken). Nothing here imports transformers."""

from typing import Any, Dict, List, Optional, Set, Tuple

import torch

__all__ = ["HFTeacher", "is_hf_model", "logits_of"]


def is_hf_model(model: Any) -> bool:
    """A transformers PreTrainedModel (checked by class name: transformers need not be imported)."""
    return any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


def cache_arg(model: Any) -> str:
    """The forward's keyword for a KV cache: `cache` (transformers >= 5.x) or `past_key_values`."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(output: Any) -> Any:
    """The KV cache a forward with use_cache=True returned."""
    return output["cache"] if "cache" in output else output["past_key_values"]


def config_list(text: str) -> List[str]:
    """A list value of session.config ("[input_ids, attention_mask]") as its names."""
    return [v.strip().strip("'\"") for v in text.strip().strip("[]").split(",") if v.strip()]


class _NoSharing(Exception):
    """The model returned no KV cache that batch_repeat_interleave() can expand."""


class HFTeacher(torch.nn.Module):
    """A PreTrainedModel as distill's Python teacher: model(**{teacher.inputs[i]: inputs[i]},
    use_cache=False)[teacher.output]. The cache keys on the model's parameters and buffers.

    Groups (on-policy distillation, docs/onpolicy.md): consecutive rows of a batch whose first
    `share_prefix` or more tokens (and attention_mask values) are equal share their longest common
    prefix. Its keys and values are computed once with use_cache=True, repeated to the group's rows,
    and only the rows' remaining tokens are run against them: the same logits as the unshared
    forward (within float32 rounding: the matmul shapes differ). teacher.output logits, with inputs
    input_ids [and attention_mask] only; share_prefix=0 turns it off. `tokens` counts the token
    positions the model computed, `tokens_unshared` those an unshared forward would have."""

    def __init__(self, model: torch.nn.Module, inputs: List[str], output: str = "logits", share_prefix: int = 16) -> None:
        super().__init__()
        self.model, self.inputs, self.output = model, list(inputs), output
        self.share_prefix = int(share_prefix)
        self.tokens = self.tokens_unshared = 0

    def _call(self, **kw: Any) -> Any:
        out = self.model(**kw, return_dict=True)
        if self.output not in out:
            raise KeyError(f"the Hugging Face model's output has no '{self.output}' (teacher.output); "
                           f"it has: {', '.join(out.keys())}")
        return out

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        named = dict(zip(self.inputs, tensors))
        ids = named.get("input_ids")
        if ids is not None and ids.dim() == 2:
            self.tokens_unshared += ids.numel()
            if (self.share_prefix > 0 and self.output == "logits" and set(named) <= {"input_ids", "attention_mask"}
                    and ids.size(0) > 1):
                groups = find_groups(ids, named.get("attention_mask"), self.share_prefix)
                if groups:
                    before = self.tokens
                    try:
                        return self._grouped(ids, named.get("attention_mask"), groups)
                    except _NoSharing:  # a cache that cannot be repeated: unshared from now on
                        self.tokens, self.share_prefix = before, 0
            self.tokens += ids.numel()
        return self._call(**named, use_cache=False)[self.output]

    def _grouped(self, ids: torch.Tensor, mask: Optional[torch.Tensor], groups: List[tuple]) -> torch.Tensor:
        """Logits [N, T, V] of the rows, each group's shared prefix computed once, written once
        into the answer (the logits are the largest tensors here)."""
        n, t = ids.shape
        out: Optional[torch.Tensor] = None

        def put(rows: Any, cols: slice, logits: torch.Tensor) -> None:
            nonlocal out
            if out is None:
                out = logits.new_empty((n, t) + tuple(logits.shape[2:]))
            out[rows, cols] = logits

        grouped: Set[int] = set()
        by_prefix: Dict[int, List[Tuple[int, int]]] = {}
        for first, count, shared in groups:
            by_prefix.setdefault(shared, []).append((first, count))
            grouped.update(range(first, first + count))
        for shared, members in by_prefix.items():
            firsts = torch.tensor([f for f, _ in members], device=ids.device)
            head = self._call(input_ids=ids[firsts, :shared], use_cache=True,
                              attention_mask=None if mask is None else mask[firsts, :shared])
            for j, (f, c) in enumerate(members):
                put(slice(f, f + c), slice(0, shared), head.logits[j : j + 1])
            self.tokens += len(members) * shared
            if shared == t:
                continue
            counts = torch.tensor([c for _, c in members], device=ids.device)
            rows = torch.cat([torch.arange(f, f + c, device=ids.device) for f, c in members])
            cache: Any = cache_of(head) if "cache" in head or "past_key_values" in head else None
            if not hasattr(cache, "batch_repeat_interleave"):
                raise _NoSharing()
            cache.batch_repeat_interleave(counts)
            tail = self._call(input_ids=ids[rows, shared:], **{cache_arg(self.model): cache}, use_cache=True,
                              attention_mask=None if mask is None else mask[rows]).logits
            at = 0
            for f, c in members:
                put(slice(f, f + c), slice(shared, t), tail[at : at + c])
                at += c
            self.tokens += rows.numel() * (t - shared)
        single = [r for r in range(n) if r not in grouped]
        if single:
            idx = torch.tensor(single, device=ids.device)
            logits = self._call(input_ids=ids[idx], use_cache=False,
                                attention_mask=None if mask is None else mask[idx]).logits
            put(idx, slice(None), logits)
            self.tokens += len(single) * t
        assert out is not None  # groups is not empty: put() ran
        return out


def find_groups(ids: torch.Tensor, mask: Optional[torch.Tensor], min_prefix: int) -> List[tuple]:
    """(first row, rows, shared prefix length) of each run of >= 2 consecutive rows of ids [N, T]
    whose common prefix (tokens and mask values) is at least min_prefix long."""
    same = ids[1:] == ids[:-1]
    if mask is not None:
        same &= mask[1:] == mask[:-1]
    lcp = same.long().cumprod(1).sum(1).tolist()  # common prefix of rows i and i + 1
    groups, first, shared = [], 0, ids.size(1)
    for i, common in enumerate(lcp + [0]):
        if common >= min_prefix:
            shared = min(shared, common)
            continue
        if i > first:
            groups.append((first, i + 1 - first, shared))
        first, shared = i + 1, ids.size(1)
    return groups


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
