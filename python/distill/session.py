"""distill.init() and the Session: who this process is, the job's config, the low-level client."""

import os
import signal
import sys
from typing import Dict, List, Optional

import torch

from . import _C
from ._cli import find_program


class Session:
    """One process of a distill job: a student (a client of its node's teacher) or the teacher.

    Made by distill.init(). Students: submit()/get() are the low-level API (distill.Steps is the
    step API over the same client); the teacher calls distill.serve(session, model).
    """

    def __init__(self, c: "_C.Session"):
        self._c = c
        self._torch_store = None  # student rank 0: the TCPStore of torch.distributed's student world

    # --- who ---
    is_teacher = property(lambda self: self._c.is_teacher)
    role = property(lambda self: self._c.role)
    rank = property(lambda self: self._c.rank, doc="student rank (-1 for the teacher)")
    world_size = property(lambda self: self._c.world_size, doc="number of students in the job")
    local_rank = property(lambda self: self._c.local_rank)
    local_world_size = property(lambda self: self._c.local_world_size)
    node_rank = property(lambda self: self._c.node_rank)
    teacher_index = property(lambda self: self._c.teacher_index)
    teacher_device = property(lambda self: self._c.teacher_device)

    # --- the config ---
    @property
    def config(self) -> Dict[str, str]:
        """Every key of the job's config, "section.key" -> its value as text (trainer keys too)."""
        return self._c.config

    @property
    def trainer(self) -> Dict[str, str]:
        """The trainer's own section (the keys distill passes through), key -> text."""
        return self._c.trainer

    def option(self, key: str, default=None):
        """trainer.<key> converted to the type of `default` (str when None); `default` when unset."""
        text = self._c.trainer.get(key)
        if text is None:
            if default is None:
                raise _C.ConfigError(f"trainer.{key} is required and not set in the config")
            return default
        if isinstance(default, bool):
            low = text.strip().lower()
            if low not in ("true", "false", "yes", "no", "on", "off"):
                raise _C.ConfigError(f"trainer.{key}: '{text}' is not a boolean")
            return low in ("true", "yes", "on")
        if default is None:
            return text.strip('"')
        try:
            return type(default)(text.strip('"') if isinstance(default, str) else text)
        except ValueError:
            raise _C.ConfigError(f"trainer.{key}: '{text}' is not a {type(default).__name__}") from None

    def _int(self, key: str) -> int:
        return int(self._c.config[key])

    grad_acc_steps = property(lambda self: self._int("student.grad_acc_steps"))
    in_flight = property(lambda self: self._int("student.in_flight"))
    steps = property(lambda self: self._int("run.steps"), doc="run.steps (0: until the loader runs dry)")
    seed = property(lambda self: self._int("run.seed"))
    ignore_index = property(lambda self: self._int("loss.ignore_index"))

    # --- the low-level student API (the C++ Client) ---
    def submit(self, inputs, step: int, acc_step: int) -> "_C.Handle":
        """Sends a micro-batch (a tensor: teacher.inputs[0]; or {name: tensor}); returns at once
        unless student.in_flight requests are outstanding."""
        return _C._submit(self._c, inputs, step, acc_step)

    def get(self, handle: "_C.Handle", view: bool = False) -> "_C.Reply":
        """Waits for the teacher's answer to `handle` (answers come in request order; the tag is
        checked). view=True: zero-copy tensors in the ring's slot, freed when the last of them is
        gone or at reply.release()."""
        return _C._get(self._c, handle, view)

    def finish(self) -> None:
        """Tells the teacher this student is done (distill.Steps does it at the end)."""
        _C._finish(self._c)

    def stop_requested(self) -> bool:
        """True once distill-run was asked to stop, or Ctrl-C reached this student."""
        return _C._stop_requested(self._c)

    def request_stop(self) -> None:
        """Stop after the current step, agreed with the other students (what Ctrl-C does)."""
        _C._request_stop(self._c)

    def publish_status(self, step: int, **fields) -> None:
        """The status line's fields (loss, kd, ce, tokens_per_s, teacher_wait_share) to distill-run."""
        _C._publish_status(self._c, step, **fields)

    def teacher_wait_seconds(self) -> float:
        return _C._teacher_wait_seconds(self._c)

    def teacher_cache_hit_share(self) -> float:
        return _C._teacher_cache_hit_share(self._c)

    def barrier(self) -> None:
        """A barrier of the students (distill's own group)."""
        self._c.barrier()

    def __repr__(self) -> str:
        return f"distill.Session({self._c.describe})"


def _student_world(session: Session) -> None:
    """torch.distributed.init_process_group() (env://) after this gives the students' world.

    Under distill-run, RANK/WORLD_SIZE/LOCAL_RANK already describe the students, but MASTER_PORT
    is distill's own store: student rank 0 starts a torch TCPStore on a free port, every student
    learns the port through distill's group, and torch is told to connect to it as a client
    (TORCHELASTIC_USE_AGENT_STORE, as under torchrun). Under torchrun, RANK/WORLD_SIZE describe
    every process, the teacher too: they are rewritten to the students' world.
    """
    c = session._c
    os.environ["RANK"] = str(c.rank)
    os.environ["WORLD_SIZE"] = str(c.world_size)
    os.environ["LOCAL_RANK"] = str(c.local_rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(c.local_world_size)
    if c.torchrun:
        return  # torchrun's agent store serves torch.distributed; the teacher never joins it
    port = 0
    if c.rank == 0:
        session._torch_store = torch.distributed.TCPStore(
            c.master_addr, 0, c.world_size, is_master=True, wait_for_workers=False
        )
        port = session._torch_store.port
    port = c._broadcast_int(port)
    os.environ["MASTER_ADDR"] = c.master_addr
    os.environ["MASTER_PORT"] = str(port)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    os.environ.setdefault("TORCHELASTIC_RESTART_COUNT", "0")


def _install_sigint(session: Session) -> None:
    """Ctrl-C: the first asks for the agreed stop (after this step, checkpoint saved), the second
    interrupts as Python does."""
    if not hasattr(signal, "SIGINT") or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return  # the trainer installed its own handler: leave it

    def on_sigint(signum, frame):
        if session.stop_requested():
            raise KeyboardInterrupt
        print(f"[distill] student {session.rank}: Ctrl-C: stopping after this step "
              "(the students agree; Ctrl-C again interrupts)", file=sys.stderr, flush=True)
        session.request_stop()

    signal.signal(signal.SIGINT, on_sigint)


def init(argv: Optional[List[str]] = None, trainer_keys: Optional[List[str]] = None) -> Session:
    """Reads the environment and the config (--config / --set / DISTILL_CONFIG / DISTILL_SET),
    joins the job as distill::init does in C++, and returns the session. Call it first, before
    torch.distributed.init_process_group(). `argv`: default sys.argv, whose distill options are
    removed. `trainer_keys`: the trainer section's keys this trainer knows (any other is a
    ConfigError naming it)."""
    args = sys.argv if argv is None else argv
    teacher = find_program("distill-teacher")
    if teacher and not os.environ.get("DISTILL_TEACHER_BIN"):
        os.environ["DISTILL_TEACHER_BIN"] = teacher  # torchrun's teacher slot becomes it
    c = _C._init(list(args), trainer_keys)
    args[:] = c.argv
    session = Session(c)
    if not session.is_teacher:
        _student_world(session)
        _install_sigint(session)
    return session
