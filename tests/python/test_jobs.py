"""Python students and teachers in real distill-run jobs (real processes, rings, c10d groups)."""

import json
import re
import time

import pytest
import torch

import distill
from trainer import BATCH, SEQ, VOCAB, TinyLM, micro_batches

BASE = """
run: {{name: py, steps: {steps}, log_dir: logs, startup_timeout_s: 60, collective_timeout_s: 60,
      hang_timeout_s: 60}}
teacher: {teacher}
student: {{grad_acc_steps: 2, in_flight: 2}}
loss: {{alpha: 0.5, temperature: 2.0}}
{extra}
"""


def config(job, teacher="torchscript", steps=3, extra=""):
    t = f"{{kind: torchscript, path: {job.tiny_lm}}}" if teacher == "torchscript" else "{kind: self, max_restarts: 0}"
    return BASE.format(teacher=t, steps=steps, extra=extra)


def check_lowlevel(job):
    for rank in (0, 1):
        r = job.report(rank)
        assert len(r["tags"]) == 6
        for seq, step, acc, want_step, want_acc in r["tags"]:
            assert (step, acc) == (want_step, want_acc)
        assert [t[0] for t in r["tags"]] == sorted(t[0] for t in r["tags"])  # answers in request order
        assert r["max_logit_diff"] < 1e-4, r["max_logit_diff"]
        assert r["max_loss_diff"] < 1e-5, r["max_loss_diff"]
        bad = f"[n0 r{rank} student] session.all_reduce: op 'mean' is none of sum, max, min [step=3 acc_step=1]"
        assert r["all_reduce"] == {"same": True, "sum": [3.0, 30.0], "max": [1], "min": [5],
                                   "strided": [[0.0, 9.0], [3.0, 12.0], [6.0, 15.0]], "bad_op": bad,
                                   "mismatch": f"[n0 r{rank} student] session.all_reduce: the students passed tensors "
                                   f"of different shapes, dtypes or devices (this student's: Float [{2 + rank}] on "
                                   "cpu) [step=3 acc_step=1]", "after": [2.0, 2.0]}, r


def test_two_students_torchscript_teacher(job):
    rc = job.run("lowlevel", config(job))
    assert rc == 0, job.output
    check_lowlevel(job)


def test_two_students_python_self_teacher(job):
    rc = job.run("lowlevel", config(job, teacher="self"))
    assert rc == 0, job.output
    check_lowlevel(job)
    assert "teacher served 12 requests" in job.output


def test_python_teacher_under_cpu_bf16_autocast(job):
    """Issue 28 item 2: teacher.autocast bfloat16 runs distill.serve's forward under torch's CPU
    autocast (refused off the GPU before), and its logits travel as bfloat16 (payload_dtype auto)."""
    cfg = BASE.format(teacher="{kind: self, autocast: bfloat16}", steps=3,
                      extra="trainer: {teacher: autocast_probe}")
    rc = job.run("lowlevel", cfg)
    assert rc == 0, job.output
    assert "forward autocast cpu=True dtype=torch.bfloat16" in job.output, job.output
    for rank in (0, 1):
        r = job.report(rank)
        assert r["logits_dtype"] == "torch.bfloat16", r
        assert 0 < r["max_logit_diff"] < 0.25, r["max_logit_diff"]  # bfloat16 against the float32 forward
        assert r["max_loss_diff"] < 0.05, r["max_loss_diff"]


def reference_grads(teacher_path, initial, batches, normalizer, alpha=0.5, T=2.0, model=None):
    """One process, the concatenated batch, the loss written out: alpha T^2 KL(teacher_T || student_T)
    + (1 - alpha) CE, both summed over tokens and divided by the step's token count."""
    if model is None:
        model = TinyLM()
        model.load_state_dict({k: torch.tensor(v) for k, v in initial.items()})
    teacher = torch.jit.load(teacher_path)
    x = torch.cat([b[0] for b in batches])
    labels = torch.cat([b[1] for b in batches])
    logits = model(x)
    with torch.no_grad():
        t = teacher(x)
    mask = labels != -100
    log_s = torch.log_softmax(logits / T, -1)
    log_t = torch.log_softmax(t / T, -1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)[mask].sum()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    loss = (alpha * T * T * kl + (1 - alpha) * ce) / normalizer
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["steps", "steps_plain"])
def test_steps_ddp_gradients_equal_one_process(job, mode):
    rc = job.run(mode, config(job))
    assert rc == 0, job.output
    r0, r1 = job.report(0), job.report(1)
    assert (r0["dist_rank"], r0["dist_world"], r1["dist_rank"], r1["dist_world"]) == (0, 2, 1, 2)
    assert r0["steps"] == r1["steps"] == 3
    # After close(): the counters keep their last values; a call is a clear error, never a crash.
    assert r0["after_close"]["step"] == 3 and r0["after_close"]["stopped"] is False
    assert "this Steps was closed (close())" in r0["after_close"]["call"], r0["after_close"]
    assert abs(r0["weights_after"] - r1["weights_after"]) < 1e-6  # the same model on both
    batches = micro_batches(0, 2) + micro_batches(1, 2)
    for rank, r in ((0, r0), (1, r1)):
        mine = micro_batches(rank, 2)
        assert r["seen"] == [b[0].tolist() for b in mine]
    tokens = sum(int((b[1] != -100).sum()) for b in batches)
    assert r0["step_tokens"] == tokens
    assert r0["dcp"] and r1["dcp"] and (job.dir / "out" / "dcp" / ".metadata").exists()  # DCP on the students' world
    ref = reference_grads(job.tiny_lm, r0["initial"], batches, tokens)
    for name, g in ref.items():
        for r in (r0, r1):
            got = torch.tensor(r["grads"][name])
            assert torch.allclose(got, g, atol=1e-6, rtol=1e-4), (name, (got - g).abs().max().item())


def test_students_world_uses_the_authenticated_store_on_master_addr_only(job):
    # torch.distributed's world of the students: rendezvous through distill's store (the job
    # secret), gloo on the loopback like distill's group; no TCPStore on every interface.
    assert job.run("steps", config(job)) == 0, job.output
    for rank in (0, 1):
        listening = job.report(rank)["listening"]
        assert listening and set(listening) == {"127.0.0.1"}, (rank, listening)
    assert job.report(1)["stranger"] == ""  # a client without the secret reads nothing


def test_checkpoint_resume(job):
    extra = "checkpoint: {dir: ckpt, every_steps: 2}"
    assert job.run("steps", config(job, steps=3, extra=extra)) == 0, job.output
    first = job.report(0)
    assert first["resumed"] == 0 and first["saved"]
    assert (job.dir / "ckpt" / "latest").read_text().strip() == "step_3"
    assert job.run("steps", config(job, steps=5, extra=extra)) == 0, job.output
    r0, r1 = job.report(0), job.report(1)
    assert r0["resumed"] == r1["resumed"] == 3
    assert r0["steps"] == 5
    assert (job.dir / "ckpt" / "latest").read_text().strip() == "step_5"


def test_ctrl_c_in_one_student_stops_all_after_the_step(job):
    extra = "checkpoint: {dir: ckpt}"
    assert job.run("sigint", config(job, steps=50, extra=extra)) == 0, job.output
    r0, r1 = job.report(0), job.report(1)
    assert r0["steps"] == r1["steps"] == 2
    assert r0["stopped"] and r1["stopped"]
    assert "Ctrl-C: stopping after this step" in job.output
    assert (job.dir / "ckpt" / "latest").read_text().strip() == "step_2"


def test_killed_teacher_is_reported(job):
    rc = job.run("lowlevel", config(job, teacher="self", extra="trainer: {kill_teacher_after: 3}"))
    assert rc != 0
    # As for a C++ student: distill-run tears the job down and names the teacher first
    # (a student that saw it first says PeerLostError, raised as distill.PeerLostError).
    assert "job failed: [r2 teacher] signal SIGKILL" in job.output, job.output


def test_a_restarted_teacher_with_other_weights_is_refused_and_the_same_teacher_is_not(job):
    """Every answer carries the teacher's fingerprint; a student refuses answers of a second teacher."""
    other = "kill_teacher_after: 3, fingerprints: 'first,second'"
    rc = job.run("lowlevel", config(job, teacher="self", extra=f"trainer: {{{other}}}").replace(
        "max_restarts: 0", "max_restarts: 1"))
    assert rc != 0, job.output
    assert "a restarted teacher loaded other weights; one run trains on one teacher" in job.output, job.output
    same = "kill_teacher_after: 3, fingerprints: 'first,first'"
    rc = job.run("lowlevel", config(job, teacher="self", extra=f"trainer: {{{same}}}").replace(
        "max_restarts: 0", "max_restarts: 1"))
    assert rc == 0, job.output


def test_each_checkpoint_names_the_teacher_whose_answers_trained_it(job):
    """distill.Steps notes every answer's teacher fingerprint; a resume under another teacher says so."""
    def manifest(step):
        return json.loads((job.dir / "ckpt" / f"step_{step}" / "manifest.json").read_text())

    ckpt = "checkpoint: {dir: ckpt, every_steps: 2}"
    assert job.run("steps", self_teacher(job, steps=2, trainer="fingerprints: 'first'", extra=ckpt)) == 0, job.output
    first = manifest(2)["answer_teacher"]
    assert re.fullmatch(r"[0-9a-f]{16}", first) and int(first, 16) != 0, first
    assert "was trained on the answers of teacher" not in job.output, job.output
    assert job.run("steps", self_teacher(job, steps=4, trainer="fingerprints: 'second'", extra=ckpt)) == 0, job.output
    second = manifest(4)["answer_teacher"]
    assert re.fullmatch(r"[0-9a-f]{16}", second) and second != first, (first, second)
    assert (f"the model resumed was trained on the answers of teacher {first.lstrip('0')}, this run's teacher "
            f"answers as {second.lstrip('0')}") in job.output, job.output


def elastic(job, trainer):
    return config(job, teacher="self", steps=6, extra=f"trainer: {{{trainer}}}").replace(
        "max_restarts: 0", "max_restarts: 3")


def test_python_teacher_that_raises_once_is_restarted_and_the_job_is_undisturbed(job):
    assert job.run("steps", config(job, teacher="self", steps=6)) == 0, job.output
    undisturbed = [job.report(rank) for rank in (0, 1)]
    rc = job.run("steps", elastic(job, "raise_teacher_at: 4"))
    assert rc == 0, job.output
    assert "[r2 teacher] died (exit code 1); restarting it (1 of 3 restarts)" in job.output, job.output
    assert "planted teacher failure in forward 4" in job.output, job.output
    # The failed batch's requests were answered by the restarted teacher, as before. (Equal up to the
    # float rounding of the teacher's batching, which depends on timing in any run.)
    for rank in (0, 1):
        r, u = job.report(rank), undisturbed[rank]
        assert r["steps"] == 6 and r["weights_after"] == pytest.approx(u["weights_after"], rel=1e-6), (r, u)
        for name, grad in r["grads"].items():
            assert torch.allclose(torch.tensor(grad), torch.tensor(u["grads"][name]), rtol=0, atol=1e-6), name


def test_python_teacher_that_raises_again_on_the_same_request_ends_the_job_naming_it(job):
    t0 = time.monotonic()
    rc = job.run("steps", elastic(job, "raise_teacher_at: 3, raise_teacher_always: 1"))
    assert rc != 0
    assert time.monotonic() - t0 < 60, job.output
    headline = next(line for line in job.output.splitlines() if "job failed:" in line)
    assert "[r2 teacher]" in headline and "failed again on the request an earlier incarnation failed on" in headline
    assert re.search(r"the request \(step \d+, acc_step \d, seq \d+\) of student rank \d \(local \d\): "
                     r"RuntimeError: planted teacher failure in forward 1", headline), headline
    assert "restarting it (1 of 3 restarts)" in job.output and "2 of 3 restarts" not in job.output, job.output


class AlwaysRaises(torch.nn.Module):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if bool((input_ids >= 0).all()):
            raise RuntimeError("planted TorchScript failure")
        return input_ids.float()


def test_torchscript_teacher_that_raises_again_on_the_same_request_ends_the_job_naming_it(job):
    path = job.dir / "raises.pt"
    torch.jit.script(AlwaysRaises()).save(str(path))
    text = config(job).replace(f"{{kind: torchscript, path: {job.tiny_lm}}}",
                               f"{{kind: torchscript, path: {path}, max_restarts: 3}}")
    t0 = time.monotonic()
    rc = job.run("steps", text)
    assert rc != 0 and time.monotonic() - t0 < 60, job.output
    headline = next(line for line in job.output.splitlines() if "job failed:" in line)
    assert "[r2 teacher]" in headline and "failed again on the request an earlier incarnation failed on" in headline
    assert re.search(r"of student rank \d \(local \d\): RuntimeError: planted TorchScript failure$", headline), headline
    assert "restarting it (1 of 3 restarts)" in job.output and "2 of 3 restarts" not in job.output, job.output


def test_killed_student_is_reported(job):
    rc = job.run("kill_student", config(job, steps=5))
    assert rc != 0
    assert "job failed: [r1 student] signal SIGKILL" in job.output, job.output


def test_errors_are_python_classes_with_the_messages(tmp_path, monkeypatch):
    # One class per entry of the C++ list (DISTILL_ERROR_TYPES), each exported by distill.
    assert "UsageError" in distill._C._error_types and "ConfigError" in distill._C._error_types
    for name in distill._C._error_types:
        cls = getattr(distill, name)
        assert cls is getattr(distill._C, name)
        assert issubclass(cls, distill.Error) and issubclass(cls, RuntimeError) and cls is not distill.Error
    # The C++ ConfigError of a process started without a launcher, word for word.
    for k in ("DISTILL_ROLE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("DISTILL_ROLE", "student")
    try:
        distill.init(["trainer.py", "--config", str(tmp_path / "none.yaml")])
    except distill.ConfigError as e:
        assert "bad distill environment" in str(e) and "DISTILL_LOCAL_RANK is not set" in str(e), str(e)
        assert not re.search(r"\.(cpp|h):\d+", str(e)), str(e)  # no C++ source location
    else:
        raise AssertionError("no ConfigError")


def test_bad_config_key_fails_the_job_with_its_name(job):
    rc = job.run("lowlevel", config(job, extra="student: {grad_acc_stpes: 2}").replace(
        "student: {grad_acc_steps: 2, in_flight: 2}\n", ""))
    assert rc != 0
    assert "grad_acc_stpes" in job.output, job.output


def test_torchrun_python_students_and_a_torchscript_teacher(job, bin_dir):
    import os
    import subprocess
    import sys

    from conftest import TRAINER

    cfg = job.dir / "job.yaml"
    cfg.write_text(config(job))
    (job.dir / "out").mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", DISTILL_TEACHER_BIN=os.path.join(bin_dir, "distill-teacher"))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                        TRAINER, "--config", str(cfg), "--mode", "steps", "--out", str(job.dir / "out"),
                        "--teacher", job.tiny_lm], cwd=job.dir, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r0, r1 = job.report(0), job.report(1)
    assert (r0["dist_world"], r1["dist_rank"]) == (2, 1)  # torch.distributed: the students only
    assert r0["steps"] == r1["steps"] == 3
    assert abs(r0["weights_after"] - r1["weights_after"]) < 1e-6


def test_fsdp_on_the_students_world_equals_one_process(job):
    """FSDP2 (fully_shard) over torch.distributed's students-only world, the low-level API, the
    normaliser for an averaging all-reduce: the parameters after one SGD step equal one process's."""
    rc = job.run("fsdp", config(job, steps=1))
    assert rc == 0, job.output
    r0, r1 = job.report(0), job.report(1)
    batches = micro_batches(0, 2) + micro_batches(1, 2)
    tokens = sum(int((b[1] != -100).sum()) for b in batches)
    assert r0["tokens"] == r1["tokens"] == tokens
    assert "DTensor parameters (FSDP): use the low-level API" in r0["steps_refused"]  # Steps says so, at once
    torch.manual_seed(0)
    model = TinyLM()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = reference_grads(job.tiny_lm, None, batches, tokens, model=model)
    for name, g in grads.items():
        want = before[name] - 0.1 * g
        for r in (r0, r1):
            got = torch.tensor(r["after"][name])
            assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), (name, (got - want).abs().max().item())


def self_teacher(job, steps=3, trainer="", extra=""):
    text = config(job, teacher="self", steps=steps, extra=extra)
    return text + (f"trainer: {{{trainer}}}\n" if trainer else "")


def test_teacher_answering_the_last_position_only_fails_at_its_first_answer(job):
    rc = job.run("steps", self_teacher(job, trainer="teacher: last_position"))
    assert rc != 0
    # The teacher's own failure, named first, with the shapes; the students only lost it.
    assert "job failed: [r2 teacher]" in job.output, job.output
    # The batch (the first dimension) is however many requests the teacher's first batch took.
    assert re.search(r"has shape \[(\d+), 1, 64\] for input 'input_ids' of shape Long \[\1, 16\]: "
                     r"expected \[\1, 16, V\]", job.output), job.output
    assert "teacher refused request" not in job.output, job.output


def test_lambda_teacher_with_cache_is_refused_in_python_words(job):
    cache = f"  cache: {{mode: readwrite, path: {job.dir / 'cache'}}}\n"
    text = self_teacher(job, trainer="teacher: function").replace(
        "teacher: {kind: self, max_restarts: 0}", "teacher:\n  kind: self\n  max_restarts: 0\n" + cache)
    rc = job.run("steps", text)
    assert rc != 0
    assert "fingerprint=" in job.output and "torch.nn.Module" in job.output, job.output
    assert "TeacherModel::state" not in job.output
    # The exception's line (the traceback also quotes the trainer's own serve(..., fingerprint=...) call).
    line = next(line for line in job.output.splitlines() if "fingerprint=" in line and "Error" in line)
    assert "distill._C.ConfigError: " in line and not re.search(r"\.(cpp|h):\d+", line), line


def test_teacher_interrupted_is_named_with_its_exception(job):
    rc = job.run("steps", self_teacher(job, steps=20, trainer="interrupt_teacher_at: 3"))
    assert rc != 0
    # Issue 39 item 3: a Ctrl-C to the teacher alone does not stop the students; the words say so.
    assert "Ctrl-C: serving until the students finish; a Ctrl-C to distill-run stops them" in job.output, job.output
    assert "one to this teacher alone does not" in job.output, job.output
    assert "they stop after this step" not in job.output, job.output
    headline = next(line for line in job.output.splitlines() if "job failed:" in line)
    assert "[r2 teacher]" in headline and "KeyboardInterrupt" in headline, headline
    assert "teacher refused request" not in job.output, job.output


def test_ctrl_c_to_the_job_stops_a_python_teacher_cleanly(job):
    rc = job.run("sigint_job", self_teacher(job, steps=50, extra="checkpoint: {dir: ckpt}"))
    assert rc == 128 + 2, job.output  # distill-run's exit after a SIGINT stop
    r0, r1 = job.report(0), job.report(1)
    assert r0["stopped"] and r1["stopped"] and r0["steps"] == r1["steps"]
    assert "Ctrl-C: serving until the students finish" in job.output, job.output
    assert "KeyboardInterrupt" not in job.output, job.output


def test_config_values_are_plain_text(job):
    # --log-dir D reaches the ranks as run.log_dir; session.config gives the path, not YAML.
    log_dir = job.dir / "my logs: x"
    assert job.run("steps", config(job), options=["--log-dir", str(log_dir)]) == 0, job.output
    assert job.report(0)["log_dir"] == str(log_dir)
    # By section, each value of its key's type (config() sets loss.temperature 2.0, grad_acc_steps 2).
    assert job.report(1)["typed_config"] == {
        "teacher.topk": [0, "int"], "loss.temperature": [2.0, "float"], "student.grad_acc_steps": [2, "int"],
        "teacher.inputs": [["input_ids"], "list"], "checkpoint.async": [False, "bool"],
        "teacher.cache.max_bytes": [1 << 30, "int"]}


def test_sigpipe_is_ignored_so_a_dead_peer_is_a_peer_lost_error(job):
    assert job.run("steps", config(job), env={"TRAINER_SIGPIPE_DEFAULT": "1"}) == 0, job.output
    assert job.report(0)["sigpipe_ignored"] and job.report(1)["sigpipe_ignored"]
    rc = job.run("kill_student", config(job, steps=5), env={"TRAINER_SIGPIPE_DEFAULT": "1"})
    assert rc != 0
    assert "job failed: [r1 student] signal SIGKILL" in job.output, job.output
    assert "SIGPIPE" not in job.output, job.output


def vocab_config(payload, vocab="error", pad_mass=False, steps=3):
    """A Python teacher whose vocabulary is the student's 64 + 128 padded rows (docs/vocab.md)."""
    topk = ", topk: 8" if payload == "topk" else ""
    return BASE.format(teacher=f"{{kind: self, max_restarts: 0{topk}}}", steps=steps,
                       extra=f"trainer: {{pad_vocab: 128, pad_mass: {1 if pad_mass else 0}}}").replace(
                           "loss: {alpha: 0.5, temperature: 2.0}",
                           f"loss: {{alpha: 0.5, temperature: 2.0, vocab: {vocab}}}").replace(
                               "run: {name: py,", "run: {name: py, master_port: 0,")


@pytest.mark.parametrize("payload", ["full", "topk"])
def test_padded_teacher_vocabulary_fails_at_the_first_answer_naming_both_sizes(job, payload):
    # Top-k: the padding never reaches the top-k, so only the vocabulary the teacher states tells.
    rc = job.run("steps_plain", vocab_config(payload))
    assert rc != 0, job.output
    assert "the teacher's vocabulary has 192 entries, the student's 64 (loss.vocab: error)" in job.output, job.output
    assert "[step=1 acc_step=0]" in job.output, job.output


@pytest.mark.parametrize("payload", ["full", "topk"])
def test_padded_teacher_vocabulary_truncated_runs_to_the_end(job, payload):
    rc = job.run("steps_plain", vocab_config(payload, vocab="truncate"))
    assert rc == 0, job.output
    for rank in (0, 1):
        r = job.report(rank)
        assert r["steps"] == 3 and not r["stopped"]
        assert r["truncated"] == [0.0, 0.0, 0.0]  # the padding rows held no probability


@pytest.mark.parametrize("payload", ["full", "topk"])
def test_teacher_rows_with_mass_fail_truncation_naming_step_and_mass(job, payload):
    rc = job.run("steps_plain", vocab_config(payload, vocab="truncate", pad_mass=True))
    assert rc != 0, job.output
    assert re.search(r"the teacher's ids >= 64 \(of its 192\) hold probability 0\.\d+.*\[step=1 acc_step=0\]",
                     job.output), job.output
    assert "raise loss.max_truncated_mass above 0." in job.output, job.output
