"""The exit hazard, closed for jobs under distill.init() (docs/python.md, "Ending a job").

A torch.distributed gloo backend runs collectives on worker threads, and a worker drops its
reference to a finished work's tensors a moment after the caller's wait() returned. A tensor
made in Python needs the GIL for that release; if the interpreter is finalising by then, CPython
ends the worker inside the GIL's acquisition and the process aborts ("terminate called without
an active exception"). DistributedDataParallel keeps the group alive after
destroy_process_group(), and gloo's backend has no shutdown, so destroying does not help.

install() (called by distill.init() in a student) makes the exit wait for those releases: an
atexit hook and torch.distributed.destroy_process_group() first wait, with the GIL released,
until every gloo backend of the groups concerned holds no work (distill._C._drain_gloo).
DISTILL_EXIT_DRAIN=0 turns it off (to see the hazard)."""

import atexit
import functools
import os
import sys
from typing import Any, List, Optional

import torch

from . import _C

DRAIN_S = 10.0  # at most this long per backend: a collective a dead peer never joins is not awaited longer
_installed = False


def _gloo_backends(group: Optional[Any] = None) -> List[Any]:
    """The gloo backends of `group`, or of every registered group (None)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return []
    groups = list(dist.distributed_c10d._world.pg_map) if group is None else [group]
    found = []
    for pg in groups:
        try:
            backend = pg._get_backend(torch.device("cpu"))
        except (AttributeError, RuntimeError, ValueError):  # not a group of this rank, or no CPU backend (NCCL)
            continue
        if type(backend).__name__ == "ProcessGroupGloo":
            found.append(backend)
    return found


def drain(group: Optional[Any] = None) -> None:
    """Waits (GIL released) until the gloo backends of `group` (None: every group) hold no work."""
    for backend in _gloo_backends(group):
        try:
            left = _C._drain_gloo(backend, DRAIN_S)
        except Exception as e:  # a torch whose backend cannot be read: say so, never fail the exit
            print(f"distill: could not wait for torch.distributed's gloo workers: {e}", file=sys.stderr, flush=True)
            return
        if left:
            print(f"distill: {left} torch.distributed gloo work(s) still queued or running after {DRAIN_S:g} s; "
                  "ending without them (the process may abort at exit)", file=sys.stderr, flush=True)


def install() -> None:
    """The atexit hook and the wrapped destroy_process_group (once per process)."""
    global _installed
    if _installed or os.environ.get("DISTILL_EXIT_DRAIN", "1") == "0":
        return
    _installed = True
    atexit.register(drain)  # registered before the trainer's own hooks: runs after them
    import torch.distributed as dist

    if not dist.is_available():
        return
    original = dist.distributed_c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group: Optional[Any] = None) -> None:
        drain(group)  # DDP (or the trainer) may keep the group, and its workers, alive after this
        original(group)

    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group
