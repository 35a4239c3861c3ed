"""A Python trainer for the pytest suite, started by distill-run (one process per rank).

    distill-run --config JOB.yaml -- python3 trainer.py --mode M --out DIR [--teacher PT]

Students write DIR/rank<r>.json with what the tests check; the teacher (teacher.kind self)
serves the TorchScript tiny LM of tests/teacher/make_teacher.py from Python.
Modes:
  lowlevel  session.submit/get with student.in_flight requests ahead: every answer's tag and
            tensor against the request and an in-process forward of the same teacher; the
            loss against the same loss on the in-process answer.
  steps     distill.Steps on a DDP-wrapped student: the first step's gradients and the
            micro-batches seen, for a one-process comparison.
  kill_student  like steps; student rank 1 SIGKILLs itself at step 2.
  sigint    like steps; student rank 1 sends itself SIGINT (Ctrl-C) at step 2.
  sigint_job  like steps; at step 2 student rank 1 sends SIGINT to distill-run and every rank, as
            a scheduler's signal to every task (or a terminal's Ctrl-C under torchrun) does.
  steps_plain  like steps without DDP: distill.Steps sums the gradients itself.
  ids       the low-level API: each micro-batch asked twice, plainly (full logits) and with
            request_ids (5 distinct random ids per position): the ids answer against a gather
            from the full answer, and its logsumexp; distill.loss on the ids answer (reverse KL
            on those ids + tail) against the same loss on a dict built from the full answer.
  fsdp      the low-level API under FSDP2 (fully_shard over the students' world): one step
            of two micro-batches per student, normaliser step tokens / world size (FSDP
            averages); the full parameters after the SGD step.
Options read from the config's trainer section (self teacher): kill_teacher_after (SIGKILL
itself at that forward call of its first incarnation), gil_busy_s (its 3rd forward spins in Python, holding the GIL,
this long), interrupt_teacher_at (SIGINT itself twice at that forward call),
fingerprints ("a,b": the self teacher's fingerprint, and a restarted incarnation's),
raise_teacher_at (raises RuntimeError at that forward call of its first incarnation; with
raise_teacher_always: 1 at every call from then on, and at every call of a restarted incarnation),
teacher (module: the TorchScript module; function: a plain function calling it;
last_position: a function answering the last position only, [B, 1, V]),
pad_vocab (its logits get this many more columns: a padded vocabulary, logits -1e4) and
pad_mass (1: those columns carry most of the probability instead), device (cuda: the students'
model and micro-batches, and the self teacher, on session.student_device / teacher_device).
Environment: TRAINER_SIGPIPE_DEFAULT=1 restores SIGPIPE's default before distill.init().
"""

import argparse
import json
import os
import signal
import socket
import sys
import time

import torch

import distill

VOCAB, SEQ, BATCH = 64, 16, 4
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "teacher"))
from make_teacher import TinyLM  # noqa: E402


def micro_batches(rank: int, count: int):
    """The micro-batches of student `rank` (the tests recompute them)."""
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(count):
        x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        labels = x[:, 1:].clone()
        labels[0, :3] = -100  # some ignored tokens
        out.append((x[:, :-1].contiguous(), labels))
    return out


def _address(hex_addr: str) -> str:
    """/proc/net/tcp{,6}'s "0100007F:1F90" as "127.0.0.1" (the port dropped)."""
    host = hex_addr.split(":")[0]
    raw = b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def listening():
    """The addresses this process listens on (TCP), from /proc/net/tcp{,6} and its descriptors."""
    by_inode = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(path) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    by_inode[fields[9]] = _address(fields[1])
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in by_inode:
            out.append(by_inode[link[8:-1]])
    return sorted(out)


def stranger_reads() -> str:
    """What a plain torch TCPStore client (no job secret) reads from MASTER_ADDR:MASTER_PORT, the
    students' world's rendezvous: "" when it is refused."""
    from datetime import timedelta

    try:
        store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                           is_master=False, timeout=timedelta(seconds=3))
        return f"{store.num_keys()} keys"
    except Exception:  # noqa: BLE001  (refused: any error will do)
        return ""


def ctrl_c_to_the_job():
    """SIGINT to distill-run (this process's parent) and to every rank it started, this one last:
    what a scheduler's signal to every task does (distill-run's ranks run in sessions of their
    own, so a terminal's Ctrl-C reaches distill-run alone; under torchrun it reaches every rank)."""
    parent = os.getppid()
    ranks = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == parent and int(pid) != os.getpid():
                    ranks.append(int(pid))
        except (OSError, ValueError, IndexError):
            continue
    for pid in [parent, *ranks, os.getpid()]:
        os.kill(pid, signal.SIGINT)


def serve(session, args):
    teacher = torch.jit.load(args.teacher)
    kill_after = int(session.trainer.get("kill_teacher_after", "0"))
    busy_s = float(session.trainer.get("gil_busy_s", "0"))
    interrupt_at = int(session.trainer.get("interrupt_teacher_at", "0"))
    raise_at = int(session.trainer.get("raise_teacher_at", "0"))
    raise_always = session.trainer.get("raise_teacher_always", "0") == "1"
    restarted = os.environ.get("DISTILL_TEACHER_RESTART") is not None
    how = session.trainer.get("teacher", "module")
    pad = int(session.trainer.get("pad_vocab", "0"))
    pad_mass = session.trainer.get("pad_mass", "0") == "1"
    nonfinite = session.trainer.get("nonfinite", "")  # nan | inf: one value of one token, whenever computed
    poisoned = micro_batches(0, 1)[0][0][1].to(session.teacher_device)  # student 0's first row 1
    calls = [0]

    def forward(ids):
        calls[0] += 1
        if kill_after and calls[0] >= kill_after and not restarted:
            os.kill(os.getpid(), signal.SIGKILL)
        if busy_s and calls[0] == 3:  # a long pure-Python call holding the GIL
            end = time.monotonic() + busy_s
            while time.monotonic() < end:
                pass
        if raise_at and (calls[0] == raise_at and not restarted or raise_always and (calls[0] >= raise_at or restarted)):
            raise RuntimeError(f"planted teacher failure in forward {calls[0]}")
        if calls[0] == interrupt_at:  # Ctrl-C twice: the first is noted, the second interrupts
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        if calls[0] == 1 and how == "autocast_probe":  # what teacher.autocast turned on around the forward
            print(f"forward autocast cpu={torch.is_autocast_enabled('cpu')} "
                  f"dtype={torch.get_autocast_dtype('cpu')}", flush=True)
        out = teacher(ids)
        if nonfinite:  # position 3 of that row, wherever it is in the batch: the same bytes cached or not
            out = out.clone()
            for b in range(ids.shape[0]):
                if torch.equal(ids[b], poisoned):
                    out[b, 3, 5] = float(nonfinite)
        if pad:  # a padded vocabulary (rows that never win), or extra rows that carry mass
            extra = out.amax(-1, keepdim=True) + 2 if pad_mass else torch.full_like(out[..., :1], -1e4)
            out = torch.cat([out, extra.expand(*out.shape[:-1], pad)], -1)
        return out[:, -1:, :] if how == "last_position" else out  # nanoGPT's forward(idx), no targets

    teacher.to(session.teacher_device)
    if session.trainer.get("device", "cpu") != "cpu":
        print(f"teacher module on {next(teacher.parameters()).device.type}", flush=True)
    names = session.trainer.get("fingerprints", "")
    plain = not (kill_after or busy_s or interrupt_at or raise_at or pad or nonfinite or names or how != "module")
    # A function has no weights for teacher.cache to key on: the nonfinite tests name the teacher.
    # trainer.fingerprints "a,b": the first incarnation's fingerprint and a restarted one's (other weights).
    named = names.split(",")[1 if restarted else 0] if names else ""
    stats = distill.serve(session, teacher if plain else forward, fingerprint="tiny_lm" if nonfinite else named)
    print(f"teacher served {stats['requests']} requests in {stats['batches']} batches", flush=True)


def lowlevel(session, args):
    teacher = torch.jit.load(args.teacher)
    acc = session.grad_acc_steps
    mbs = micro_batches(session.rank, 3 * acc)
    tags = [(1 + i // acc, i % acc) for i in range(len(mbs))]
    handles, report = [], {"tags": [], "max_logit_diff": 0.0, "max_loss_diff": 0.0, "losses": []}
    dev = torch.device(session.trainer.get("device", "cpu"))
    mbs = [(x.to(dev), labels.to(dev)) for x, labels in mbs]
    ahead = session.in_flight
    for i in range(min(ahead, len(mbs))):
        handles.append(session.submit(mbs[i][0], *tags[i]))
    for i, (x, labels) in enumerate(mbs):
        reply = session.get(handles[i], view=(i % 2 == 0))  # both modes
        if i + ahead < len(mbs):
            handles.append(session.submit(mbs[i + ahead][0], *tags[i + ahead]))
        h = reply.handle
        report["tags"].append([h.seq, h.step, h.acc_step, *tags[i]])
        with torch.no_grad():
            expect = teacher(x.cpu()).to(dev)
        got = reply.output["logits"]
        report["logits_dtype"] = str(got.dtype)
        report["logits_device"] = str(got.device)
        got = got.float()
        report["max_logit_diff"] = max(report["max_logit_diff"], (got - expect).abs().max().item())
        student_logits = torch.randn(BATCH, SEQ, VOCAB, generator=torch.Generator().manual_seed(i)).to(dev)
        n = distill.count_tokens(labels, session.ignore_index)
        a = distill.loss(student_logits, labels, reply, n, session)
        b = distill.loss(student_logits, labels, {"logits": expect}, n, session)
        report["losses"].append([a.loss.item(), a.kd.item(), a.ce.item()])
        report["max_loss_diff"] = max(report["max_loss_diff"], abs(a.loss.item() - b.loss.item()))
        reply.release()
    session.finish()
    # session.all_reduce: in place over the students, on distill's group (docs/python.md, "Ending a job").
    t = torch.tensor([session.rank + 1.0, 10.0 * (session.rank + 1)])
    strided = (torch.arange(6.0).reshape(2, 3) * (session.rank + 1)).t()  # not contiguous
    report["all_reduce"] = {"same": session.all_reduce(t) is t, "sum": t.tolist(),
                            "max": session.all_reduce(torch.tensor([session.rank]), "max").tolist(),
                            "min": session.all_reduce(torch.tensor([session.rank + 5]), op="min").tolist(),
                            "strided": session.all_reduce(strided).tolist()}
    try:
        session.all_reduce(t, "mean")
        report["all_reduce"]["bad_op"] = "no error"
    except distill.UsageError as e:
        report["all_reduce"]["bad_op"] = str(e)
    try:  # a shape that differs between the students: refused on every one, the group still usable
        session.all_reduce(torch.ones(2 + session.rank))
        report["all_reduce"]["mismatch"] = "no error"
    except distill.UsageError as e:
        report["all_reduce"]["mismatch"] = str(e)
    report["all_reduce"]["after"] = session.all_reduce(torch.ones(2)).tolist()
    return report


def ids(session, args):
    mbs = micro_batches(session.rank, 3)
    g = torch.Generator().manual_seed(7 + session.rank)
    temperature = session.config.loss.temperature
    report = {"kinds": [], "gather_equal": [], "lse_diff": 0.0, "tail_diff": 0.0, "loss_diff": 0.0}
    for i, (x, labels) in enumerate(mbs):
        full = session.get(session.submit(x, i + 1, 0)).output["logits"]
        want = torch.rand(BATCH, SEQ, VOCAB, generator=g).argsort(-1)[..., :5]  # distinct per position
        reply = session.get(session.submit({"input_ids": x, "request_ids": want}, i + 1, 1))
        out = reply.output
        report["kinds"].append(reply.kind)
        report["gather_equal"].append(torch.equal(out["ids_values"], full.gather(-1, want)))
        report["ids_back"] = torch.equal(out["request_ids"].long(), want)
        scaled = full.double() / temperature
        lse = torch.logsumexp(scaled, -1)
        tail = torch.logsumexp(scaled.scatter(-1, want, float("-inf")), -1)
        report["lse_diff"] = max(report["lse_diff"], (out["logsumexp"].double() - lse).abs().max().item())
        report["tail_diff"] = max(report["tail_diff"], (out["log_tail"].double() - tail).abs().max().item())
        student = torch.randn(BATCH, SEQ, VOCAB, generator=g)
        n = distill.count_tokens(labels, session.ignore_index)
        a = distill.loss(student, labels, reply, n, session)
        b = distill.loss(student, labels, {"ids_values": full.gather(-1, want), "logsumexp": out["logsumexp"],
                                           "log_tail": out["log_tail"], "request_ids": want}, n, session)
        report["loss_diff"] = max(report["loss_diff"], abs(a.loss.item() - b.loss.item()))
        report["loss"] = a.kd.item()
    try:  # more ids than teacher.request_ids: refused at the student, naming the key
        session.submit({"input_ids": mbs[0][0], "request_ids": torch.zeros(BATCH, SEQ, 9, dtype=torch.long)}, 9, 0)
        report["too_many"] = "no error"
    except distill.UsageError as e:
        report["too_many"] = str(e)
    session.finish()
    return report


def steps(session, args):
    torch.distributed.init_process_group("gloo")
    report = {"dist_rank": torch.distributed.get_rank(), "dist_world": torch.distributed.get_world_size()}
    torch.manual_seed(session.rank)  # different on purpose: Steps broadcasts student rank 0's
    dev = torch.device(session.trainer.get("device", "cpu"))
    model = TinyLM().to(dev)
    # steps_plain: no DDP; distill.Steps sums the gradients itself (GradientSync's hooks).
    ddp = model if args.mode == "steps_plain" else torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    truncated = []  # loss.vocab truncate: the step reports' dropped teacher mass
    nonfinite = []  # the step reports' masked_tokens, skipped, skipped_steps, and the weights after the step

    def on_step(r):
        truncated.append(r.get("truncated_mass_max"))
        weights = float(sum(p.detach().double().sum() for p in model.parameters()))
        nonfinite.append([r["masked_tokens"], r["skipped"], r["skipped_steps"], weights, r["loss"]])

    s = distill.Steps(session, ddp, opt, on_step=on_step)
    report["truncated"], report["nonfinite"] = truncated, nonfinite
    nan_step = int(session.trainer.get("student_nan_step", "0"))  # rank 1's logits NaN at (step, acc_step 0)
    report["listening"] = listening()  # the students' world is up: every socket it serves
    if session.rank == 1 and args.mode == "steps":
        report["stranger"] = stranger_reads()
    if session.rank == 0:
        initial = {k: v.clone() for k, v in model.state_dict().items()}
    seen, losses = [], []
    for mb in s.run(micro_batches(session.rank, 100)):
        if args.mode == "kill_student" and session.rank == 1 and mb.step == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.mode == "sigint" and session.rank == 1 and (mb.step, mb.acc_step) == (2, 0):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in one student: all stop after step 2
        if args.mode == "sigint_job" and session.rank == 1 and (mb.step, mb.acc_step) == (2, 0):
            ctrl_c_to_the_job()
        if mb.step == 1:
            seen.append(mb.inputs.tolist())
        logits = ddp(mb.inputs.to(dev))
        if session.rank == 1 and (mb.step, mb.acc_step) == (nan_step, 0):
            logits = logits * float("nan")
        r = s.backward(logits)
        if s.step_ends():
            if s.step == 1:
                report["grads"] = {n: p.grad.tolist() for n, p in model.named_parameters()}
                report["step_tokens"] = s.step_tokens
            losses.append(r.loss.item())
            opt.step()
            opt.zero_grad()
    report["seen"] = seen
    report["steps"] = s.step
    report["resumed"] = s.resumed_step
    report["stopped"] = s.stopped
    report["saved"] = s.saved
    s.close()  # after close(): the counters read their final values, a call is an error naming close()
    report["after_close"] = {"step": s.step, "stopped": s.stopped}
    try:
        s.step_ends()
        report["after_close"]["call"] = "no error"
    except distill.UsageError as e:
        report["after_close"]["call"] = str(e)
    report["weights_after"] = float(sum(p.detach().double().sum() for p in model.parameters()))
    if session.rank == 0:
        report["initial"] = {k: v.tolist() for k, v in initial.items()}
    # torch.distributed.checkpoint: collective over the students' world only (the teacher is not in it).
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(args.out, "dcp"))
    # dcp.save's last gloo collectives hold tensors made in Python; waiting here with the GIL released
    # lets gloo's workers release them before the interpreter shuts down (docs/python.md, "Ending a job").
    session.barrier()
    report["dcp"] = True
    torch.distributed.destroy_process_group()
    return report


def fsdp(session, args):
    from torch.distributed.fsdp import fully_shard

    torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    model = TinyLM()
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        distill.Steps(session, model, opt)
        refused = ""
    except distill.ConfigError as e:
        refused = str(e)
    mbs = micro_batches(session.rank, 2)
    tokens = torch.tensor([float(sum(distill.count_tokens(y, -100) for _, y in mbs))])
    torch.distributed.all_reduce(tokens)  # the step's tokens over the students
    handles = [session.submit(x, 1, acc) for acc, (x, _) in enumerate(mbs)]
    for h, (x, y) in zip(handles, mbs):
        distill.loss(model(x), y, session.get(h), tokens.item() / session.world_size, session).loss.backward()
    opt.step()
    session.finish()
    after = {n: p.full_tensor().tolist() for n, p in model.named_parameters()}
    session.barrier()  # as after dcp.save in steps()
    torch.distributed.destroy_process_group()
    return {"after": after, "tokens": tokens.item(), "steps_refused": refused}


def main():
    if os.environ.get("TRAINER_SIGPIPE_DEFAULT"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as an embedding interpreter may leave it
    session = distill.init()
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--teacher", required=True)
    args = p.parse_args()
    if session.is_teacher:
        return serve(session, args)
    modes = {"lowlevel": lowlevel, "fsdp": fsdp, "ids": ids}
    report = modes.get(args.mode, steps)(session, args)
    report["rank"] = session.rank
    report["sigpipe_ignored"] = signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN
    report["log_dir"] = session.config["run.log_dir"]
    cfg = session.config  # by section, typed: each value with its type's name
    typed = {"teacher.topk": cfg.teacher.topk, "loss.temperature": cfg["loss"]["temperature"],
             "student.grad_acc_steps": cfg.student.grad_acc_steps, "teacher.inputs": cfg.teacher.inputs,
             "checkpoint.async": cfg.checkpoint.async_, "teacher.cache.max_bytes": cfg["teacher"]["cache"]["max_bytes"]}
    report["typed_config"] = {k: [v, type(v).__name__] for k, v in typed.items()}
    with open(os.path.join(args.out, f"rank{session.rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
