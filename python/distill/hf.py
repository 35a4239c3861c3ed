"""Hugging Face `transformers` models with distill (the optional extra: pip install --no-build-isolation '.[hf]').

A `PreTrainedModel` is a teacher in one line, `distill.serve(session, model)`: serve() wraps it in
HFTeacher, which calls it with the request's tensors by name (teacher.inputs: input_ids, and
attention_mask when named), with use_cache=False, and returns only teacher.output (default
"logits") of its ModelOutput; consecutive rows that share a prompt (on-policy groups,
docs/onpolicy.md) have it computed once. An HF student's ModelOutput goes to `distill.Steps.backward` as it
is (its `logits` are taken). Nothing here imports transformers."""

from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from .head import TeacherHead, head_logits

__all__ = ["HFTeacher", "hf_head", "hf_layer", "is_hf_model", "logits_of"]


# The final transforms of the logits that Hugging Face models apply after their output layer, by
# config key (transformers' modeling code). final_logit_softcapping is the same soft-capping in every
# model that has it (Gemma 2, 3, ...). The scales differ by model type: Cohere multiplies by
# logit_scale, Granite divides by logits_scaling, HyperCLOVA X multiplies by it.
_SCALES = {
    **{t: ("logit_scale", False) for t in ("cohere", "cohere2", "cohere2_moe")},
    **{t: ("logits_scaling", True) for t in ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid",
                                             "granite_swa", "granitemoe_swa")},
    "hyperclovax": ("logits_scaling", False),
}
# Config keys of other logit transforms (or of one of the above under a model type not listed): a
# model whose config sets one to anything but its neutral value is refused, its head being not only
# a linear layer, a scale and a soft-cap.
_OTHER_TRANSFORMS = {"logit_scale": 1.0, "logits_scaling": 1.0, "lm_head_multiplier": 1.0, "output_multiplier": 1.0,
                     "unpadded_vocab_size": None}


_DECLARE = "distill.serve(session, model, head=distill.TeacherHead(weight, bias, softcap, scale))"


def _refuse(model: Any, what: str, remedy: str = "declare its head: " + _DECLARE) -> "Exception":
    """The ConfigError of a Hugging Face model whose head distill cannot take, naming its type."""
    from . import _C

    kind = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    return _C.ConfigError(f"teacher.answer hidden: the Hugging Face model of type '{kind}' ({type(model).__name__}) "
                          f"{what}; serve its logits (teacher.answer: logits or topk), or {remedy}")


def hf_layer(model: Any) -> torch.nn.Module:
    """The output layer of a PreTrainedModel, model.get_output_embeddings(), whose input (the final
    hidden states, after the final norm) a teacher with teacher.answer hidden sends.

    Raises:
        ConfigError: naming the model type, when it has none.
    """
    layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(layer, torch.nn.Module):
        raise _refuse(model, "has no output layer (get_output_embeddings() is None)",
                      "serve a function that returns its final hidden states, with distill.serve(session, forward, "
                      "fingerprint=..., head=...)")
    return layer


def hf_head(model: Any) -> TeacherHead:
    """The head of a PreTrainedModel: its output layer (hf_layer: a torch.nn.Linear, its weight and
    bias) and the final transforms its config declares (final_logit_softcapping: softcap; Cohere's
    logit_scale: scale; Granite's logits_scaling: scale 1 / value).

    Raises:
        ConfigError: naming the model type, for an output layer that is missing or not a
            torch.nn.Linear, or a config with a logit transform that is none of these.
    """
    layer = hf_layer(model)
    if not isinstance(layer, torch.nn.Linear) or layer.weight.dim() != 2:
        raise _refuse(model, f"has an output layer of type {type(layer).__name__}, not a torch.nn.Linear")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kind = getattr(cfg, "model_type", "") or getattr(model.config, "model_type", "")
    softcap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)
    scale = 1.0
    if kind in _SCALES:
        key, divide = _SCALES[kind]
        value = getattr(cfg, key, None)
        value = 1.0 if value is None else float(value)
        if not value > 0 or value != value or value == float("inf"):
            raise _refuse(model, f"has {key} = {value}, not a positive finite scale")
        scale = 1.0 / value if divide else value
    for key, neutral in _OTHER_TRANSFORMS.items():
        value = getattr(cfg, key, neutral)
        if (kind not in _SCALES or _SCALES[kind][0] != key) and value is not None and value != neutral:
            raise _refuse(model, f"transforms its logits by {key} = {value}, which distill's head does not "
                                 "compute (it knows final_logit_softcapping, and logit_scale / logits_scaling "
                                 f"of {', '.join(sorted(_SCALES))})")
    return TeacherHead(layer.weight, layer.bias, softcap, scale)


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

    def __init__(self, model: torch.nn.Module, inputs: List[str], output: str = "logits", share_prefix: int = 16,
                 hidden: bool = False, head: Optional[TeacherHead] = None) -> None:
        super().__init__()
        self.model, self.inputs, self.output = model, list(inputs), output
        self.share_prefix = int(share_prefix)
        self.tokens = self.tokens_unshared = 0
        # teacher.answer hidden: the answer is the input of the model's output layer (what its forward
        # pre-hook sees: after the final norm and any scaling before the layer), the head published:
        # `head` when given (not checked against the model), else the one hf_head() finds.
        self.head: Optional[TeacherHead] = None
        self._layer: Optional[torch.nn.Module] = None
        self._given = head is not None
        if hidden:
            self._layer = hf_layer(model)
            self.head = head if head is not None else hf_head(model)

    def _call(self, **kw: Any) -> Any:
        if self._layer is not None:
            return self._call_hidden(**kw)
        out = self.model(**kw, return_dict=True)
        if self.output not in out:
            raise KeyError(f"the Hugging Face model's output has no '{self.output}' (teacher.output); "
                           f"it has: {', '.join(out.keys())}")
        return out

    def _call_hidden(self, **kw: Any) -> Any:
        """The forward with the output layer's input taken by a forward pre-hook, which gives the layer
        no positions instead ([..., 0, d]): the [B, T, V] logits are never computed. The ModelOutput
        (with its KV cache, if asked for) gets the hidden states as its `hidden_answer`."""
        seen: List[torch.Tensor] = []

        def take(module: torch.nn.Module, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
            seen.append(args[0])
            return (args[0][..., :0, :],) + tuple(args[1:])

        assert self._layer is not None
        hook = self._layer.register_forward_pre_hook(take)
        try:
            out = self.model(**kw, return_dict=True)
        finally:
            hook.remove()
        if len(seen) != 1:
            raise _refuse(self.model, f"called its output layer {len(seen)} times in one forward, not once")
        out.hidden_answer = seen[0]
        return out

    def _answer(self, out: Any) -> torch.Tensor:
        """The tensor the teacher answers with, of a _call()'s output."""
        return out.hidden_answer if self._layer is not None else out[self.output]

    def check_head(self) -> None:
        """At start-up (answer hidden): the head found must give the model's own logits from the
        hidden states it sends, on a short probe (4 tokens); a model whose head is more than a linear
        layer, a scale and a soft-cap is refused here, naming its type, not trained on wrong logits.

        Raises:
            ConfigError: the head's logits differ from the model's.
        """
        if self.head is None or self._given:
            return

        p = next(self.model.parameters())
        ids = torch.arange(4, device=p.device).unsqueeze(0) % max(1, self.head.weight.size(0))
        with torch.inference_mode():
            hidden = self._call(input_ids=ids, use_cache=False).hidden_answer
            want = self.model(input_ids=ids, use_cache=False, return_dict=True).logits
            got = head_logits(hidden, self.head)
        if got.shape != want.shape:
            raise _refuse(self.model, f"gives logits of shape {list(want.shape)} where its output layer gives "
                                      f"{list(got.shape)}")
        err = (got.float() - want.float()).abs().max().item()
        tol = (1e-4 if want.dtype == torch.float32 else 3e-2) * (1.0 + want.float().abs().max().item())
        if not err <= tol:
            raise _refuse(self.model, f"computes logits that its output layer and the declared transforms "
                                      f"(softcap {self.head.softcap}, scale {self.head.scale}) do not reproduce "
                                      f"(largest difference {err:.3g} on a probe of 4 tokens)")

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        named = dict(zip(self.inputs, tensors))
        ids = named.get("input_ids")
        if ids is not None and ids.dim() == 2:
            self.tokens_unshared += ids.numel()
            if (self.share_prefix > 0 and (self.output == "logits" or self._layer is not None)
                    and set(named) <= {"input_ids", "attention_mask"} and ids.size(0) > 1):
                groups = find_groups(ids, named.get("attention_mask"), self.share_prefix)
                if groups:
                    before = self.tokens
                    try:
                        return self._grouped(ids, named.get("attention_mask"), groups)
                    except _NoSharing:  # a cache that cannot be repeated: unshared from now on
                        self.tokens, self.share_prefix = before, 0
            self.tokens += ids.numel()
        return self._answer(self._call(**named, use_cache=False))

    def _grouped(self, ids: torch.Tensor, mask: Optional[torch.Tensor], groups: List[tuple]) -> torch.Tensor:
        """The answer [N, T, V] (logits; or [N, T, d] hidden states) of the rows, each group's shared
        prefix computed once, written once into the answer (the largest tensor here)."""
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
                put(slice(f, f + c), slice(0, shared), self._answer(head)[j : j + 1])
            self.tokens += len(members) * shared
            if shared == t:
                continue
            counts = torch.tensor([c for _, c in members], device=ids.device)
            rows = torch.cat([torch.arange(f, f + c, device=ids.device) for f, c in members])
            cache: Any = cache_of(head) if "cache" in head or "past_key_values" in head else None
            if not hasattr(cache, "batch_repeat_interleave"):
                raise _NoSharing()
            cache.batch_repeat_interleave(counts)
            tail = self._answer(self._call(input_ids=ids[rows, shared:], **{cache_arg(self.model): cache}, use_cache=True,
                              attention_mask=None if mask is None else mask[rows]))
            at = 0
            for f, c in members:
                put(slice(f, f + c), slice(shared, t), tail[at : at + c])
                at += c
            self.tokens += rows.numel() * (t - shared)
        single = [r for r in range(n) if r not in grouped]
        if single:
            idx = torch.tensor(single, device=ids.device)
            logits = self._answer(self._call(input_ids=ids[idx], use_cache=False,
                                             attention_mask=None if mask is None else mask[idx]))
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
