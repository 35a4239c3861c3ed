"""On-policy distillation: the student samples continuations of prompts from its current weights,
the teacher scores prompt + response, and the loss trains the response tokens only (docs/onpolicy.md).

    mix = distill.onpolicy.Mixer(model, prompts=lambda g: next_prompts(g),    # [B, P] token ids
                                 dataset=lambda g: next_batch(g),              # (inputs, labels)
                                 lam=1.0, max_new_tokens=64, group_size=8, eos_token_id=eos,
                                 seed=session.seed * 1000 + session.rank)
    steps = distill.Steps(session, model, opt, loader_state=mix)   # a resume restores the mix
    for mb in steps.run(mix):                                      # sampled or dataset micro-batches
        steps.backward(model(mb.inputs))                           # loss.kind: reverse_kl, usually
        if steps.step_ends():
            opt.step(); opt.zero_grad()

`sample()` works for any causal LM whose forward maps token ids [N, T] to logits [N, T, V] (a tensor
or an output with `logits`); a Hugging Face model is sampled with its KV cache. The G samples of a
prompt are consecutive rows: the Hugging Face teacher (distill.hf.HFTeacher) finds the shared
prompt and computes it once per group."""

from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional, Tuple

import torch

from . import _C
from .hf import cache_arg, cache_of, is_hf_model, logits_of

__all__ = ["Sample", "sample", "generate", "Mixer"]


class Sample(NamedTuple):
    input_ids: torch.Tensor  # [N, P + R - 1]: prompt + response, the last token dropped (inputs)
    labels: torch.Tensor  # [N, P + R - 1]: the next token; ignore_index on the prompt and the padding
    attention_mask: torch.Tensor  # [N, P + R - 1]: 1 on prompt and response tokens, 0 on the padding
    response_lengths: torch.Tensor  # [N]: response tokens of each row (an EOS included)
    # [N, P + R - 1]: the log-probability of each label under the distribution it was drawn from
    # (temperature and top_p applied), 0 where nothing was sampled; None with temperature 0 (greedy).
    sampling_logprobs: Optional[torch.Tensor] = None
    # [N, P + R - 1, k] (sample(topk=k)): the student's own top-k ids at each response position, from
    # the logits it sampled from (no extra forward); 0 .. k - 1 where nothing was sampled.
    topk_ids: Optional[torch.Tensor] = None

    def token_ids(self) -> torch.Tensor:
        """[N, P + R - 1, 1]: the sampled token at each position (the label; 0 where ignored), the
        ids a request carries for loss.kind sampled_token (docs/onpolicy.md)."""
        return self.labels.clamp_min(0).unsqueeze(-1)


def _pick(logits: torch.Tensor, temperature: float, top_p: float,
          g: Optional[torch.Generator]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One token per row of logits [N, V] and its log-probability under the distribution drawn
    from: greedy at temperature 0 (no log-probability), else top-p sampling."""
    if temperature == 0:
        return logits.argmax(-1), None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p  # the smallest prefix whose mass reaches top_p stays
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    if g is not None and g.device != probs.device:
        # A CPU generator (Mixer's, whose state a checkpoint keeps) and a model on a GPU: the GPU draws
        # from a generator seeded by it, so the CPU generator still decides every sample.
        g = torch.Generator(device=probs.device).manual_seed(int(torch.randint(0, 2**62, (), generator=g)))
    tok = torch.multinomial(probs, 1, generator=g)
    return tok.squeeze(-1), probs.gather(-1, tok).squeeze(-1).log()


def _check(prompts: torch.Tensor, max_new_tokens: int, group_size: int, temperature: float, top_p: float) -> None:
    if not isinstance(prompts, torch.Tensor) or prompts.dim() != 2 or prompts.size(1) < 1:
        got = tuple(prompts.shape) if isinstance(prompts, torch.Tensor) else type(prompts).__name__
        raise _C.ConfigError(f"distill.onpolicy.sample: prompts must be token ids [batch, prompt_len >= 1], got {got}")
    bad = max_new_tokens < 0 or prompts.size(1) + max_new_tokens < 2 or group_size < 1
    if bad or temperature < 0 or not 0 < top_p <= 1:
        raise _C.ConfigError(f"distill.onpolicy.sample: max_new_tokens={max_new_tokens} (>= 0; prompt + response "
                             f">= 2 tokens), group_size={group_size} (>= 1), temperature={temperature} (>= 0), "
                             f"top_p={top_p} (in (0, 1])")


@torch.no_grad()
def generate(model: Any, prompts: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
             eos_token_id: Optional[int] = None, pad_token_id: int = 0,
             generator: Optional[torch.Generator] = None) -> tuple:
    """(sequences [N, P + max_new_tokens], response lengths [N]): each row of prompts continued by
    up to max_new_tokens sampled tokens, stopped after eos_token_id, padded with pad_token_id."""
    seq, lengths, _, _ = _generate(model, prompts, max_new_tokens, temperature, top_p, eos_token_id, pad_token_id,
                                   generator, 0)
    return seq, lengths


def _generate(model: Any, prompts: torch.Tensor, max_new_tokens: int, temperature: float, top_p: float,
              eos_token_id: Optional[int], pad_token_id: int, generator: Optional[torch.Generator],
              topk: int) -> tuple:
    """generate()'s (sequences, lengths) and, per new token [N, max_new_tokens], its sampling
    log-probability (None when greedy) and, with topk > 0, the top-k ids of the logits it was drawn
    from [N, max_new_tokens, k] (0 .. k - 1 after a row ended)."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    training = inner.training if isinstance(inner, torch.nn.Module) else False
    if training:
        inner.eval()
    try:
        seq, n = prompts, prompts.size(0)
        done = torch.zeros(n, dtype=torch.bool, device=prompts.device)
        lengths = torch.zeros(n, dtype=torch.long, device=prompts.device)
        cache, step_in = None, prompts
        logps: list = []
        tops: list = []
        for _ in range(max_new_tokens):
            if is_hf_model(inner):  # the KV cache: one new token per call after the prompt
                out = inner(input_ids=step_in, **{cache_arg(inner): cache}, use_cache=True)
                cache, logits = cache_of(out), out.logits[:, -1]
            else:  # any causal LM: the whole sequence again
                logits = logits_of(inner(seq))[:, -1]
            tok, logp = _pick(logits, temperature, top_p, generator)
            if logp is not None:
                logps.append(torch.where(done, torch.zeros_like(logp), logp))
            if topk > 0:
                top = logits.topk(topk, dim=-1).indices
                tops.append(torch.where(done[:, None], torch.arange(topk, device=top.device)[None, :], top))
            tok = torch.where(done, torch.full_like(tok, pad_token_id), tok)
            lengths += (~done).long()
            if eos_token_id is not None:
                done = done | (tok == eos_token_id)
            seq, step_in = torch.cat([seq, tok[:, None]], 1), tok[:, None]
            if bool(done.all()):
                pad = torch.full((n, max_new_tokens - (seq.size(1) - prompts.size(1))), pad_token_id,
                                 dtype=seq.dtype, device=seq.device)
                seq = torch.cat([seq, pad], 1)
                break
        width = seq.size(1) - prompts.size(1)
        logp_out = _padded(logps, n, width, seq.device, None) if logps else None
        top_out = _padded(tops, n, width, seq.device, topk) if topk > 0 else None
        return seq, lengths, logp_out, top_out
    finally:
        if training:
            inner.train()


def _padded(steps: list, n: int, width: int, device: torch.device, topk: Optional[int]) -> torch.Tensor:
    """The per-step tensors stacked along dim 1 and filled up to `width` steps (0, or 0 .. k - 1)."""
    out = torch.stack(steps, 1) if steps else torch.zeros(n, 0, *([topk] if topk else []), device=device)
    if out.size(1) < width:
        fill = (torch.arange(topk, device=device).expand(n, width - out.size(1), topk) if topk
                else torch.zeros(n, width - out.size(1), device=device, dtype=out.dtype))
        out = torch.cat([out, fill.to(out.dtype)], 1)
    return out


def sample(model: Any, prompts: torch.Tensor, max_new_tokens: int, group_size: int = 1, temperature: float = 1.0,
           top_p: float = 1.0, eos_token_id: Optional[int] = None, pad_token_id: int = 0,
           generator: Optional[torch.Generator] = None, ignore_index: int = -100, topk: int = 0) -> Sample:
    """The student's samples as a micro-batch: each prompt row ([B, P] token ids, equal lengths)
    repeated group_size times (consecutive rows: a group) and continued by model; inputs and labels
    shifted by one, labels = ignore_index on the prompt and after the response. Every row is
    P + max_new_tokens - 1 wide. Reproducible from `generator` (its state and the weights).
    Recorded on the way, at no extra forward: each sampled token's log-probability under the
    distribution it was drawn from, and with topk > 0 the student's top-k ids at each position
    (the ids a request carries for an ids answer, docs/onpolicy.md)."""
    _check(prompts, max_new_tokens, group_size, temperature, top_p)
    if topk < 0:
        raise _C.ConfigError(f"distill.onpolicy.sample: topk={topk} must be >= 0")
    device = next((p.device for p in model.parameters()), prompts.device) if isinstance(model, torch.nn.Module) \
        else prompts.device
    rows = prompts.to(device).repeat_interleave(group_size, 0)
    seq, lengths, logps, tops = _generate(model, rows, max_new_tokens, temperature, top_p, eos_token_id,
                                          pad_token_id, generator, topk)
    p = prompts.size(1)
    pos = torch.arange(1, seq.size(1), device=seq.device)[None, :]  # the position of each label's token
    response = (pos >= p) & (pos < p + lengths[:, None])
    labels = torch.where(response, seq[:, 1:], torch.full_like(seq[:, 1:], ignore_index))
    mask = (pos - 1 < p + lengths[:, None]).long()
    # The token drawn at generation step i is the label at position p - 1 + i.
    n = seq.size(0)
    logp_rows = None
    if logps is not None:
        logp_rows = torch.cat([torch.zeros(n, p - 1, device=seq.device, dtype=logps.dtype), logps], 1)
    top_rows = None
    if tops is not None:
        head = torch.arange(topk, device=seq.device).expand(n, p - 1, topk)
        top_rows = torch.cat([head.to(tops.dtype), tops], 1).contiguous()
    return Sample(seq[:, :-1].contiguous(), labels.contiguous(), mask, lengths, logp_rows, top_rows)


class Mixer:
    """The micro-batches of GKD (Agarwal et al., 2024): with probability `lam` an on-policy batch
    (prompts(g) sampled by the model's current weights), else the dataset's own batch (dataset(g)).
    `prompts` and `dataset` take the mixer's torch.Generator, so that state_dict() (the generator's
    state and the counts) is the whole loader state: give the mixer to distill.Steps as
    loader_state and a resume draws what the uninterrupted run would have drawn.

    `ids` says what the micro-batches ask the teacher (docs/onpolicy.md, "Signals: the sampled-token
    recipe and the student's top-k"): None, its configured answer ((inputs, labels)); "token", its
    log-probability of each sampled token for loss.kind sampled_token ((inputs, labels, token ids,
    sampling log-probabilities); a dataset batch asks at its labels, without log-probabilities);
    "topk", its logits at the student's own top `topk` ids ((inputs, labels, top-k ids); a dataset
    batch gets the configured answer). Both need teacher.request_ids (1, or topk)."""

    def __init__(self, model: Any, prompts: Callable[[torch.Generator], torch.Tensor],
                 dataset: Optional[Callable[[torch.Generator], tuple]] = None, lam: float = 1.0,
                 max_new_tokens: int = 64, group_size: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                 eos_token_id: Optional[int] = None, pad_token_id: int = 0, ignore_index: int = -100,
                 seed: int = 0, ids: Optional[str] = None, topk: int = 0) -> None:
        if not 0.0 <= lam <= 1.0 or (lam < 1.0 and dataset is None):
            raise _C.ConfigError(f"distill.onpolicy.Mixer: lam={lam} must be in [0, 1], and below 1 needs a dataset")
        if ids not in (None, "token", "topk") or (ids == "topk") != (topk > 0):
            raise _C.ConfigError(f"distill.onpolicy.Mixer: ids={ids!r} must be None, 'token' or 'topk', and "
                                 f"topk={topk} > 0 exactly with 'topk'")
        self.model, self.prompts, self.dataset, self.lam, self.ids = model, prompts, dataset, lam, ids
        self.kwargs: Dict[str, Any] = dict(max_new_tokens=max_new_tokens, group_size=group_size,
                                           temperature=temperature, top_p=top_p, eos_token_id=eos_token_id,
                                           pad_token_id=pad_token_id, ignore_index=ignore_index, topk=topk)
        self.generator = torch.Generator().manual_seed(seed)
        self.counts = {"onpolicy": 0, "dataset": 0, "response_tokens": 0}
        self.last: Optional[Sample] = None  # the last on-policy sample

    def next(self) -> tuple:
        """The next micro-batch: (inputs, labels), and the ids `ids` asks for (see the class)."""
        if self.lam >= 1.0 or torch.rand((), generator=self.generator).item() < self.lam:
            s = sample(self.model, self.prompts(self.generator), generator=self.generator, **self.kwargs)
            self.last = s
            self.counts["onpolicy"] += 1
            self.counts["response_tokens"] += int(s.response_lengths.sum())
            if self.ids == "token":
                return s.input_ids, s.labels, s.token_ids(), s.sampling_logprobs
            if self.ids == "topk":
                return s.input_ids, s.labels, s.topk_ids
            return s.input_ids, s.labels
        self.counts["dataset"] += 1
        assert self.dataset is not None  # lam < 1 needs one (checked in __init__)
        inputs, labels = self.dataset(self.generator)[:2]
        if self.ids == "token":
            return inputs, labels, labels.clamp_min(0).unsqueeze(-1), None
        return inputs, labels

    def __iter__(self) -> Iterator[tuple]:
        while True:
            yield self.next()

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.counts = dict(state["counts"])
