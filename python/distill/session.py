"""distill.init() and the Session: who this process is, the job's config, the low-level client."""

import os
import signal
import sys
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch

from . import _C, _exit
from ._cli import find_program
from .config import Config

__all__ = ["Session", "init"]


class Session:
    """One process of a distill job: a student (a client of its node's teacher) or the teacher.

    Made by distill.init(). Students: submit()/get() are the low-level API (distill.Steps is the
    step API over the same client); the teacher calls distill.serve(session, model).
    """

    def __init__(self, c: "_C.Session"):
        self._c = c
        self._torch_store: Any = None  # students: the store of torch.distributed's student world
        self._config: Optional[Config] = None  # session.config, made at its first use

    # --- who ---
    @property
    def is_teacher(self) -> bool:
        """True in the teacher process (teacher.kind: self), False in a student."""
        return self._c.is_teacher

    @property
    def role(self) -> str:
        """"student" or "teacher"."""
        return self._c.role

    @property
    def rank(self) -> int:
        """Student rank (-1 for the teacher)."""
        return self._c.rank

    @property
    def world_size(self) -> int:
        """Number of students in the job."""
        return self._c.world_size

    @property
    def local_rank(self) -> int:
        """This student's rank on its node (-1 for the teacher)."""
        return self._c.local_rank

    @property
    def local_world_size(self) -> int:
        """Number of students on this node."""
        return self._c.local_world_size

    @property
    def node_rank(self) -> int:
        """This node's index in the job."""
        return self._c.node_rank

    @property
    def teacher_index(self) -> int:
        """This teacher's index among its node's teachers (students: the teacher that serves them)."""
        return self._c.teacher_index

    @property
    def teacher_device(self) -> torch.device:
        """The device the teacher's model goes on (teacher.device / teacher.devices).

        Raises:
            ConfigError: this process is a student.
        """
        return self._c.teacher_device

    # --- the config ---
    @property
    def config(self) -> Config:
        """The job's config, by section with typed values (config.teacher.topk, config["loss"]["temperature"]);
        as a mapping, "section.key" -> its value as text (trainer keys too). See distill.config.Config."""
        if self._config is None:
            self._config = Config(self._c.config)
        return self._config

    @property
    def trainer(self) -> Dict[str, str]:
        """The trainer's own section (the keys distill passes through), key -> text."""
        return self._c.trainer

    def option(self, key: str, default: Any = None) -> Any:
        """trainer.<key> converted to the type of `default`.

        Args:
            key: the key in the config's trainer section.
            default: the value when unset; its type (bool, int, float, str) is the value's. None: the
                key is required and its value is a str.

        Returns:
            The value, converted; `default` when the key is unset.

        Raises:
            ConfigError: the key is unset and required, or its text does not convert.
        """
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

    @property
    def grad_acc_steps(self) -> int:
        """student.grad_acc_steps: micro-batches per optimizer step."""
        return self.config.student.grad_acc_steps

    @property
    def in_flight(self) -> int:
        """student.in_flight: requests outstanding per student."""
        return self.config.student.in_flight

    @property
    def steps(self) -> int:
        """run.steps (0: until the loader runs dry)."""
        return self.config.run.steps

    @property
    def seed(self) -> int:
        """run.seed: torch's RNG seed, the same on every student."""
        return self.config.run.seed

    @property
    def ignore_index(self) -> int:
        """loss.ignore_index: the label value masked out of every term."""
        return self.config.loss.ignore_index

    # --- the low-level student API (the C++ Client) ---
    def submit(self, inputs: Union[torch.Tensor, Mapping[str, torch.Tensor]], step: int,
               acc_step: int) -> "_C.Handle":
        """Sends a micro-batch to the teacher; returns at once unless student.in_flight requests
        are outstanding.

        Args:
            inputs: a tensor (teacher.inputs[0]), or {name: tensor} for every teacher.inputs name.
            step: the 1-based optimizer step the micro-batch belongs to.
            acc_step: its index in the step, 0 .. student.grad_acc_steps - 1.

        Returns:
            The request's Handle, for get().

        Raises:
            ConfigError: the inputs do not match teacher.inputs, or this process is the teacher.
            TimeoutError: no slot freed up before the deadline.
            PeerLostError: the teacher died.
        """
        return _C._submit(self._c, inputs, step, acc_step)

    def get(self, handle: "_C.Handle", view: bool = False) -> "_C.Reply":
        """Waits for the teacher's answer to `handle` (answers come in request order; the tag is
        checked).

        Args:
            handle: what submit() returned, the oldest request not yet answered.
            view: True: zero-copy tensors in the ring's slot, freed when the last of them is gone
                or at reply.release(); False: copies.

        Returns:
            The teacher's Reply (reply.output: {name: tensor}).

        Raises:
            ProtocolError: the answer's tag is not the handle's.
            TimeoutError: no answer before the deadline.
            PeerLostError: the teacher died.
        """
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

    def publish_status(self, step: int, **fields: float) -> None:
        """The status line's fields to distill-run.

        Args:
            step: the step the fields describe.
            fields: loss, kd, ce, tokens_per_s, teacher_wait_share, truncated_mass (each optional).
        """
        _C._publish_status(self._c, step, **fields)

    def teacher_wait_seconds(self) -> float:
        """Seconds this student has waited for the teacher's answers so far."""
        return _C._teacher_wait_seconds(self._c)

    def teacher_cache_hit_share(self) -> float:
        """The share of this student's answers served from the teacher-output cache (0 .. 1)."""
        return _C._teacher_cache_hit_share(self._c)

    def barrier(self) -> None:
        """A barrier of the students (distill's own group)."""
        self._c.barrier()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduces `tensor` over the students, in place, on distill's own group (gloo for CPU
        tensors; CUDA tensors as student.backend says). Unlike torch.distributed.all_reduce on a
        gloo group, it is safe as the last collective before the process exits
        (docs/python.md, "Ending a job").

        Args:
            tensor: the tensor to reduce; every student passes one of the same shape and dtype.
            op: "sum", "max" or "min" (a mean: the sum divided by world_size).

        Returns:
            `tensor`, holding the result.

        Raises:
            UsageError: an unknown op, tensors that differ between the students (shape, dtype or
                device: each student's error names its own), or called on the teacher.
            TimeoutError: a student did not enter it within the collective timeout.
            PeerLostError: a student died.
        """
        self._c.all_reduce(tensor, op)
        return tensor

    def __repr__(self) -> str:
        return f"distill.Session({self._c.describe})"


def _student_world(session: Session) -> None:
    """torch.distributed.init_process_group() (env://) after this gives the students' world.

    Under distill-run, RANK/WORLD_SIZE/LOCAL_RANK already describe the students; the world's
    store is distill's own (the students' authenticated rendezvous store, its keys under their
    own prefix): env:// rendezvous is handed that store instead of opening a TCPStore, so no
    second, unauthenticated port is served. Under torchrun, RANK/WORLD_SIZE describe every
    process, the teacher too: they are rewritten to the students' world, and torch uses the
    agent's store as usual.
    """
    c = session._c
    os.environ["RANK"] = str(c.rank)
    os.environ["WORLD_SIZE"] = str(c.world_size)
    os.environ["LOCAL_RANK"] = str(c.local_rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(c.local_world_size)
    if c.torchrun:
        return  # torchrun's agent store serves torch.distributed; the teacher never joins it
    session._torch_store = c._torch_store()
    _route_env_rendezvous(session)
    if not os.environ.get("GLOO_SOCKET_IFNAME") and _is_loopback(c.master_addr):
        # As distill's own group: gloo's listeners on the loopback, not the hostname's address.
        name = _loopback_interface()
        if name:
            os.environ["GLOO_SOCKET_IFNAME"] = name


def _is_loopback(addr: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def _loopback_interface() -> Optional[str]:
    """The name of the loopback network interface ("lo"), or None."""
    import fcntl
    import socket
    import struct

    SIOCGIFFLAGS, IFF_LOOPBACK = 0x8913, 0x8
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, struct.pack("16sH", name.encode()[:15], 0))
            except OSError:
                continue
            if struct.unpack("16sH", req[:18])[1] & IFF_LOOPBACK:
                return name
    return None


_env_handler = None  # torch's env:// rendezvous handler, before distill's


def _route_env_rendezvous(session: Session) -> None:
    """env:// (init_process_group's default) yields the session's store, rank and world size.

    A rank or world size other than the session's (the URL's or the environment's) goes to
    torch's handler as before."""
    global _env_handler
    import importlib
    from urllib.parse import urlparse

    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module (a function shadows it)

    if _env_handler is None:
        _env_handler = rdzv._rendezvous_handlers["env"]

    def handler(url: str, **kwargs: Any) -> Iterator[Tuple[Any, int, int]]:
        query = rdzv._query_to_dict(urlparse(url).query)
        rank = int(query.get("rank", os.environ.get("RANK", "-1")))
        world = int(query.get("world_size", os.environ.get("WORLD_SIZE", "-1")))
        if (rank, world) != (session.rank, session.world_size):
            yield from _env_handler(url, **kwargs)
            return
        yield (session._torch_store, rank, world)
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")

    rdzv._rendezvous_handlers["env"] = handler


def _install_sigint(session: Session) -> None:
    """Ctrl-C: the first asks for the agreed stop (after this step, checkpoint saved), the second
    interrupts as Python does."""
    if not hasattr(signal, "SIGINT") or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return  # the trainer installed its own handler: leave it

    # This process's own Ctrl-Cs are counted, not session.stop_requested(): a terminal's Ctrl-C
    # reaches distill-run too, which may have set the job's stop flag before this handler runs.
    presses: List[int] = []

    def on_sigint(signum: int, frame: Any) -> None:
        if presses:
            raise KeyboardInterrupt
        presses.append(signum)
        print(f"[distill] student {session.rank}: Ctrl-C: stopping after this step "
              "(the students agree; Ctrl-C again interrupts)", file=sys.stderr, flush=True)
        session.request_stop()

    signal.signal(signal.SIGINT, on_sigint)


def init(argv: Optional[List[str]] = None, trainer_keys: Optional[List[str]] = None) -> Session:
    """Reads the environment and the config (--config / --set / DISTILL_CONFIG / DISTILL_SET),
    joins the job as distill::init does in C++, and returns the session. Call it first, before
    torch.distributed.init_process_group().

    Args:
        argv: the command line (default sys.argv); its distill options are removed from it.
        trainer_keys: the trainer section's keys this trainer knows (any other is a ConfigError
            naming it); None: any.

    Returns:
        This process's Session (a student, or the teacher of teacher.kind: self).

    Raises:
        ConfigError: a bad config or environment (not started by distill-run or torchrun).
        TimeoutError: admission (students <-> teacher, the student group) passed
            run.startup_timeout_s.
        IpcError: the node's shared memory could not be opened.
    """
    args = sys.argv if argv is None else argv
    # A peer that died must surface as an error naming it (PeerLostError), never as this rank's
    # death by SIGPIPE when it writes to the peer's reset socket (gloo, the store). CPython
    # ignores SIGPIPE at start-up (its writes see EPIPE); an embedding interpreter, or a trainer
    # that restored the default, gets it ignored here (a handler of its own is kept).
    if hasattr(signal, "SIGPIPE") and signal.getsignal(signal.SIGPIPE) == signal.SIG_DFL:
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    teacher = find_program("distill-teacher")
    if teacher and not os.environ.get("DISTILL_TEACHER_BIN"):
        os.environ["DISTILL_TEACHER_BIN"] = teacher  # torchrun's teacher slot becomes it
    c = _C._init(list(args), trainer_keys)
    args[:] = c.argv
    session = Session(c)
    if not session.is_teacher:
        _student_world(session)
        _install_sigint(session)
        _exit.install()  # the exit waits for torch.distributed's gloo workers (docs/python.md, "Ending a job")
    return session
