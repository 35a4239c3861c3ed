"""The public API as tests/python/trainer.py uses it, with every type written out: mypy checks this
file (tests/python/test_typing.py); nothing runs it. An annotation that stops matching what the
package declares is a type error there."""

from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

import distill


def session_and_config(session: distill.Session) -> None:
    rank: int = session.rank
    world: int = session.world_size
    teacher: bool = session.is_teacher
    role: str = session.role
    grad_acc: int = session.grad_acc_steps
    in_flight: int = session.in_flight
    steps: int = session.steps
    trainer_text: Dict[str, str] = session.trainer
    lr: float = session.option("lr", 1e-3)
    cfg: distill.Config = session.config
    topk: int = cfg.teacher.topk
    temperature: float = cfg["loss"]["temperature"]
    alpha: float = cfg.loss.alpha
    inputs: List[str] = cfg.teacher.inputs
    max_bytes: int = cfg.teacher.cache.max_bytes
    cache_mode: str = cfg["teacher"]["cache"]["mode"]
    asynchronous: bool = cfg.checkpoint.async_
    timeout: float = cfg.run.startup_timeout_s
    log_dir: str = cfg["run.log_dir"]  # "section.key": the text, as before
    trainer_keys: Dict[str, str] = cfg.trainer
    flat: Dict[str, Any] = dict(cfg)
    print(rank, world, teacher, role, grad_acc, in_flight, steps, trainer_text, lr, topk, temperature, alpha,
          inputs, max_bytes, cache_mode, asynchronous, timeout, log_dir, trainer_keys, flat)


def lowlevel(session: distill.Session, batches: List[Tuple[torch.Tensor, torch.Tensor]]) -> float:
    handles: List[distill.Handle] = [session.submit(x, 1, i) for i, (x, _) in enumerate(batches)]
    total = 0.0
    for h, (x, y) in zip(handles, batches):
        reply: distill.Reply = session.get(h, view=True)
        logits: torch.Tensor = reply.output["logits"]
        seq: int = reply.handle.seq
        tokens: int = distill.count_tokens(y, session.ignore_index)
        r: distill.LossResult = distill.loss(logits, y, reply, float(tokens), session, temperature=2.0)
        r.loss.backward()
        total += r.kd.item() + seq
        reply.release()
    session.publish_status(1, loss=total)
    wait: float = session.teacher_wait_seconds()
    session.finish()
    return total + wait


def with_steps(session: distill.Session, model: torch.nn.Module,
               loader: List[Tuple[torch.Tensor, torch.Tensor]]) -> int:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: List[Dict[str, Any]] = []
    steps = distill.Steps(session, model, opt, on_step=seen.append, loader_state=None)
    it: Iterator[distill.StepItem] = steps.run(loader)
    for mb in it:
        r: distill.LossResult = steps.backward(model(mb.inputs))
        acc: int = mb.acc_step
        if steps.step_ends():
            opt.step()
            opt.zero_grad()
        print(r.tokens, acc)
    nxt: Optional[distill.StepItem] = steps.next(lambda: None)
    stopped: bool = steps.stopped
    steps.close()
    print(nxt, stopped)
    return steps.step


def teacher(session: distill.Session, model: torch.nn.Module) -> int:
    device: torch.device = session.teacher_device
    stats: Dict[str, Any] = distill.serve(session, model.to(device), fingerprint="")
    return int(stats["requests"])


def errors() -> None:
    try:
        session = distill.init(["trainer.py"], trainer_keys=["lr"])
    except TimeoutError as e:  # distill.TimeoutError is a builtins.TimeoutError
        print(e)
    except distill.Error as e:
        print(e)
    else:
        print(session)
    caught: TimeoutError = distill.TimeoutError("x")
    version: str = distill.__version__
    print(caught, version)
