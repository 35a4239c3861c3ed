"""distill for Python trainers: the C++ engine's rings, teacher and step protocol.

    import distill
    session = distill.init()                       # before torch.distributed.init_process_group()
    if session.is_teacher:                         # teacher.kind: self
        distill.serve(session, teacher_model)
    else:
        torch.distributed.init_process_group("gloo")   # the students' world: the teacher is not in it
        model = DDP(model)
        steps = distill.Steps(session, model, optimizer)
        for mb in steps.run(loader):               # loader yields (inputs, labels) micro-batches
            steps.backward(model(mb.inputs))
            if steps.step_ends():
                optimizer.step(); optimizer.zero_grad()

docs/python.md, "Python trainers" says the rest.
"""

import torch  # noqa: F401  (loads libtorch before the extension links to it)

from . import _C
from ._C import (  # noqa: F401
    CheckpointError,
    ConfigError,
    Error,
    Handle,
    InternalError,
    IpcError,
    NumericError,
    PeerLostError,
    ProtocolError,
    Reply,
    TimeoutError,
    UsageError,
    count_tokens,
)
from .config import Config  # noqa: F401
from .head import TeacherHead  # noqa: F401
from .loss import LossResult, fused_linear_loss, loss  # noqa: F401
from .session import Session, init  # noqa: F401
from .steps import StepItem, Steps  # noqa: F401
from . import onpolicy  # noqa: F401
from .teacher import serve  # noqa: F401

__version__: str = _C.__version__  # CMakeLists.txt's project(VERSION), compiled in

__all__ = [
    "init",
    "Session",
    "Config",
    "Steps",
    "StepItem",
    "serve",
    "TeacherHead",
    "loss",
    "fused_linear_loss",
    "LossResult",
    "onpolicy",
    "count_tokens",
    "Handle",
    "Reply",
    "Error",
    "ConfigError",
    "IpcError",
    "TimeoutError",
    "PeerLostError",
    "ProtocolError",
    "CheckpointError",
    "NumericError",
    "InternalError",
    "UsageError",
    "__version__",
]
