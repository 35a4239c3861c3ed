"""distill.Steps: the C++ step API (distill::Steps) for a Python model and optimizer."""

import io
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple, Union

import torch

from . import _C
from .hf import logits_of
from .loss import LossResult

if TYPE_CHECKING:
    from .session import Session

__all__ = ["StepItem", "Steps", "Batch", "LmHead"]

# A loader's micro-batch: (inputs, labels), or with the ids to have the teacher's logits at
# ([B, T, k] integer, k <= teacher.request_ids: an ids answer) and, for loss.kind sampled_token,
# the sampling policy's log-probabilities of ids[..., 0] ([B, T]; None: not given).
Batch = Union[Tuple[torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor, torch.Tensor],
              Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]
# Steps.backward's lm_head: a Linear, its weight [V, d], or a (weight, bias) pair.
LmHead = Union[torch.nn.Linear, torch.Tensor, Tuple[torch.Tensor, Optional[torch.Tensor]]]
_LOADER_FORMAT = "distill.Steps loader 2"  # a checkpoint's per-rank extra (0.4: the loader's state alone)


class StepItem(NamedTuple):
    """One micro-batch of Steps.run(): the loader's (inputs, labels) and where it stands."""

    inputs: torch.Tensor
    labels: torch.Tensor
    step: int  # 1-based optimizer step
    acc_step: int  # 0 .. grad_acc_steps - 1


def _autocast_operands(hidden: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """lm_head's weight and bias in the hidden states' 16-bit dtype when the forward ran under
    autocast (bf16 or fp16 hidden states, a float32 lm_head), as autocast's own linear casts them:
    the fused linear loss takes one dtype, and the gradient flows back to the float32 parameters."""
    if hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == torch.float32:
        weight = weight.to(hidden.dtype)
        if bias is not None:
            bias = bias.to(hidden.dtype)
    return weight, bias


class Steps:
    """Owns the per-step protocol, as distill::Steps does for a C++ trainer:

        steps = distill.Steps(session, model, optimizer)    # resumes from the checkpoint
        for mb in steps.run(loader):                        # (inputs, labels) micro-batches
            steps.backward(model(mb.inputs))                # teacher's answer, loss, backward
            if steps.step_ends():
                optimizer.step(); optimizer.zero_grad()
                                                            # saved, published, finished

    It reads the loader ahead (grad_acc_steps micro-batches of a step for its token count, and
    student.in_flight requests kept with the teacher), tags and checks every answer, computes
    the loss with the step's global token count, agrees on stopping (distill-run's stop, Ctrl-C,
    a loader run dry) with the other students, reports the status to distill-run and saves
    checkpoints (checkpoint.* of the config) of model.state_dict() and optimizer.state_dict().

    `loader_state`: an object with state_dict() and load_state_dict() (the loader, or its
    sampler). Steps reads the loader ahead of the step it trains, so each checkpoint keeps, in
    this rank's file, the loader's state after its latest read and the micro-batches read after
    the saved step's last one; a resume loads the state and hands those micro-batches out first,
    so the resumed run trains on what the uninterrupted one did, even where a micro-batch depends
    on the weights it was read under (on-policy samples).

    Gradients: a model wrapped in DistributedDataParallel syncs its own (DDP averages them: Steps
    backpropagates the loss times the student world size, so the average is the step's
    token-mean gradient, and turns DDP's sync off on the accumulation micro-batches, as
    no_sync() does). A plain module: Steps sums the gradients over the students itself (GradientSync,
    overlapped with the step's last backward). Either way, .grad after step_ends() is the gradient of the mean
    loss over every token of the step on every student.

    Mixed precision: run the forward under torch.autocast (bf16 needs nothing else). fp16 with a
    torch.amp.GradScaler: pass it as `scaler`; backward() multiplies the loss by its scale, and the
    trainer calls scaler.step(optimizer); scaler.update() instead of optimizer.step() (the reported
    losses are unscaled).

    `on_step(report)`: after each optimizer step, a dict with step, loss, kd, ce (a term of weight 0,
    kd at loss.alpha 0 or ce at 1, is not computed and says 0, never NaN), tokens, seconds,
    masked_tokens (teacher.on_nonfinite mask), skipped and skipped_steps (loss.on_nonfinite skip_step),
    tokens_per_s, teacher_wait_share, stop, and with loss.vocab truncate truncated_mass_max and
    truncated_mass_mean (the teacher probability dropped at ids >= the student's vocabulary: the
    most of any token and the mean over the step's tokens, all students; docs/vocab.md).
    """

    def __init__(
        self,
        session: "Session",
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        on_step: Optional[Callable[[Dict[str, Any]], None]] = None,
        fingerprint: str = "",
        loader_state: Any = None,
        scaler: Optional[torch.amp.GradScaler] = None,
    ) -> None:
        """Args:
            session: the student's session (distill.init()).
            model: the student, plain or wrapped in DistributedDataParallel.
            optimizer: its optimizer (checkpointed with it).
            on_step: called after each step with its figures (step, loss, kd, ce, tokens, ...).
            fingerprint: a text that identifies the trainer's setup in the checkpoint.
            loader_state: an object with state_dict() and load_state_dict(), checkpointed per rank.
            scaler: a torch.amp.GradScaler (fp16).

        Raises:
            ConfigError: an FSDP (DTensor) model, or this process is the teacher.
            CheckpointError: the checkpoint to resume from cannot be read.
        """
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        inner: torch.nn.Module = model.module if ddp else model  # type: ignore[assignment]
        if any(type(p).__name__ == "DTensor" for p in inner.parameters()):
            raise _C.ConfigError(
                "distill.Steps takes a plain module or one wrapped in DistributedDataParallel; this one has "
                "DTensor parameters (FSDP): use the low-level API (session.submit/get, distill.loss with "
                "normalizer = step tokens / world size), docs/python.md, \"The low-level API\"")
        self._model, self._inner, self._ddp = model, inner, ddp
        self._optimizer = optimizer
        self._scaler = scaler  # a torch.amp.GradScaler: backward() scales the loss by its scale
        self._grad_acc = session.grad_acc_steps
        params = list(inner.parameters())
        buffers = list(inner.buffers())
        cuda = any(p.is_cuda for p in params)
        device = params[0].device if params else torch.device("cpu")

        def save_state() -> Tuple[bytes, bytes]:
            m, o = io.BytesIO(), io.BytesIO()
            torch.save(inner.state_dict(), m)
            torch.save(optimizer.state_dict(), o)
            return (m.getvalue(), o.getvalue())

        def load_state(model_bytes: bytes, optimizer_bytes: bytes) -> None:
            inner.load_state_dict(torch.load(io.BytesIO(model_bytes), map_location=device, weights_only=True))
            optimizer.load_state_dict(torch.load(io.BytesIO(optimizer_bytes), map_location=device, weights_only=True))

        self._loader_state = loader_state
        self._reads = 0  # micro-batches handed to the C++ Steps by this object (replayed ones included)
        self._latest = b""  # loader_state's torch.save bytes right after the latest read
        self._items: Dict[int, Batch] = {}  # reads -> that micro-batch (the last few)
        self._replay: List[Batch] = []  # read ahead before the checkpoint: handed out before the loader's own
        self._keep = 2 * self._grad_acc + session.in_flight + 8
        # Through a weak reference: the C++ Steps holding this object would be a cycle that no
        # collector sees, and the session (the process's detach from the job) would never end.
        me = weakref.ref(self)
        rank_extra = (lambda step: me()._loader_snapshot(step)) if loader_state is not None else None  # type: ignore
        self._c = _C._steps(session._c, params, buffers, ddp, cuda, save_state, load_state, on_step, fingerprint,
                            rank_extra)
        if loader_state is not None:
            self._load_loader_state()

    def _load_loader_state(self) -> None:
        """At resume: the loader's state and the micro-batches the saved run had read ahead, so
        that the resumed run goes on exactly as the saved one would have."""
        extra = self._c.resumed_rank_extra
        saved = torch.load(io.BytesIO(extra), weights_only=True) if extra else None
        if isinstance(saved, dict) and saved.get("format") == _LOADER_FORMAT:
            self._loader_state.load_state_dict(saved["loader"])
            self._replay = [tuple(b) for b in saved["ahead"]]  # (inputs, labels[, ids[, sampling_logprobs]])
        elif saved is not None:  # 0.4: the loader's state alone, after the step's last read
            self._loader_state.load_state_dict(saved)
        elif self._c.resumed_step > 0:
            warnings.warn(f"distill.Steps: the checkpoint of step {self._c.resumed_step} holds no loader state "
                          "(saved without loader_state): the loader starts from its own beginning", stacklevel=3)

    def _loader_snapshot(self, step: int) -> bytes:
        """This rank's loader part of the checkpoint of `step` (taken after its optimizer step): the
        loader's state after its latest read, and the micro-batches read after the step's last one
        (read ahead; an on-policy one was sampled from older weights than a resume has)."""
        last = (step - self._c.resumed_step) * self._grad_acc  # the step's last micro-batch
        ahead = list(range(last + 1, self._reads + 1))
        if last > self._reads or any(r not in self._items for r in ahead):
            raise _C.InternalError(f"distill.Steps: the micro-batches read after step {step} (reads {last + 1}.."
                                   f"{self._reads}) are not all recorded: {sorted(self._items)}")
        loader = torch.load(io.BytesIO(self._latest), weights_only=True) if self._latest else \
            self._loader_state.state_dict()
        buf = io.BytesIO()
        torch.save({"format": _LOADER_FORMAT, "loader": loader,
                    "ahead": [self._items[r] for r in ahead] + self._replay}, buf)
        return buf.getvalue()

    def _read(self, loader: Callable[[], Optional[Batch]]) -> Optional[Batch]:
        item = self._replay.pop(0) if self._replay else loader()
        if item is not None and self._loader_state is not None:
            self._reads += 1
            buf = io.BytesIO()
            torch.save(self._loader_state.state_dict(), buf)
            self._latest = buf.getvalue()
            self._items[self._reads] = item
            # Steps reads at most a step and student.in_flight requests ahead of the one it trains.
            self._items.pop(self._reads - self._keep, None)
        return item

    def next(self, loader: Callable[[], Optional[Batch]]) -> Optional[StepItem]:
        """The next micro-batch, or None when training is over.

        Args:
            loader: returns (inputs, labels), or None when it has no more.

        Raises:
            TimeoutError: the students' agreement on the step passed run.collective_timeout_s.
            PeerLostError: another student or the teacher died.
        """
        item = self._c.next(lambda: self._read(loader))
        if item is None:
            return None
        item = StepItem(*item)
        # DDP's no_sync(): all-reduce only on the step's last micro-batch
        if isinstance(self._model, torch.nn.parallel.DistributedDataParallel):
            self._model.require_backward_grad_sync = item.acc_step + 1 == self._grad_acc
        return item

    def run(self, loader: Iterable[Batch]) -> Iterator[StepItem]:
        """Iterates the micro-batches of `loader` (any iterable of (inputs, labels)) as next() does."""
        it = iter(loader)
        fetch = lambda: next(it, None)  # noqa: E731
        while True:
            item = self.next(fetch)
            if item is None:
                return
            yield item

    def backward(self, logits: Any, lm_head: Optional[LmHead] = None, chunk_tokens: int = 0) -> LossResult:
        """The teacher's answer for the current micro-batch, the loss, backward; after the step's
        last micro-batch the students' gradients are summed. `logits`: a tensor, or a model output
        with a `logits` tensor (a Hugging Face ModelOutput). With a scaler, the backward is of the
        loss times the scaler's scale.

        With lm_head (the model's output projection: a torch.nn.Linear, or its weight [V, d], or a
        (weight, bias) pair), the first argument is the last hidden states [..., d] and the loss is
        distill.fused_linear_loss (chunk_tokens tokens at a time, 0: automatic): the same value and
        gradients as on lm_head(hidden), without the [N, V] logits in memory.

        A teacher answering with its hidden states (teacher.answer hidden) needs nothing more: its
        logits are made from them and the head it published, mapped once per node, chunk by chunk
        beside the student's in the fused loss (so neither [N, V] is held).

        Returns:
            The micro-batch's LossResult (unscaled).

        Raises:
            ConfigError: a bad lm_head, or logits whose shape does not match the labels.
            TimeoutError: the teacher's answer did not come before the deadline.
            PeerLostError: the teacher or another student died.
        """
        logits = logits_of(logits)
        if self._scaler is not None and self._scaler.is_enabled():
            self._c.set_loss_scale(self._scaler.scale(torch.ones((), device=logits.device)))
        if lm_head is None:
            return LossResult(*self._c.backward(logits))
        bias: Optional[torch.Tensor]
        if isinstance(lm_head, torch.nn.Linear):
            weight, bias = lm_head.weight, lm_head.bias
        elif isinstance(lm_head, torch.Tensor):
            weight, bias = lm_head, None
        elif isinstance(lm_head, (tuple, list)) and len(lm_head) == 2:
            weight, bias = lm_head
        else:
            raise _C.ConfigError(f"distill.Steps.backward: lm_head must be a torch.nn.Linear, a weight tensor or "
                                 f"a (weight, bias) pair, found {type(lm_head).__name__}")
        weight, bias = _autocast_operands(logits, weight, bias)
        return LossResult(*self._c.backward_linear(logits, weight, bias, int(chunk_tokens)))

    def step_ends(self) -> bool:
        """True after backward() of the step's last micro-batch: step the optimizer."""
        return self._c.step_ends()

    @property
    def step(self) -> int:
        """The current step."""
        return self._c.step

    @property
    def step_tokens(self) -> int:
        """The current step's global token count."""
        return self._c.step_tokens

    @property
    def resumed_step(self) -> int:
        """The checkpoint's step (0: a clean start)."""
        return self._c.resumed_step

    @property
    def stopped(self) -> bool:
        """Ended before run.steps (a stop, a dry loader)."""
        return self._c.stopped

    @property
    def saved(self) -> bool:
        """The last save and its publication succeeded."""
        return self._c.saved

    def close(self) -> None:
        """Waits for the checkpoint writer (also done when the object is freed)."""
        self._c.close()
