"""Issue 44's sampled answers in real distill-run jobs: a TorchScript teacher with teacher.samples
draws K ids per position and the students train on them to the end; what sampled answers cannot
serve is refused at the start, naming why."""

import math

from trainer import BATCH, SEQ, VOCAB  # noqa: F401 (the trainer the jobs run)

BASE = """
run: {{name: py, steps: 3, log_dir: logs, startup_timeout_s: 60, collective_timeout_s: 60,
      hang_timeout_s: 60}}
teacher: {{kind: torchscript, path: {path}, samples: 8}}
student: {{grad_acc_steps: 2, in_flight: 2}}
loss: {{alpha: 0.5, temperature: 2.0, kind: {kind}}}
"""


def test_sampled_answers_train_a_job_to_the_end(job):
    rc = job.run("steps_plain", BASE.format(path=job.tiny_lm, kind="forward_kl"))
    assert rc == 0, job.output
    assert "output sampled K=8" in job.output, job.output
    for rank in (0, 1):
        r = job.report(rank)
        assert r["steps"] == 3 and not r["stopped"], r
        losses = [step[4] for step in r["nonfinite"]]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses


def test_sampled_answers_with_reverse_kl_are_refused_at_the_start(job):
    rc = job.run("steps_plain", BASE.format(path=job.tiny_lm, kind="reverse_kl"))
    assert rc != 0, job.output
    assert "teacher.samples (8) with loss.kind reverse_kl: sampled answers give an unbiased forward KL only" \
        in job.output, job.output
