"""Issue 39 item 2: NaN and infinity are never trained on silently. A teacher answer that is not
finite is the teacher's error (teacher.on_nonfinite: error) or its tokens learn from their labels
only (mask), and is never cached; a student loss or gradient that is not finite stops the job
(loss.on_nonfinite: error) or skips that step's update on every student (skip_step). Real
distill-run jobs of trainer.py."""

import math

import pytest

from test_jobs import BASE

FREE_PORT = ("--master-port", "0")  # a free rendezvous port: other jobs may hold the default


def teacher_config(job, on_nonfinite, payload="full", value="nan", cache=""):
    topk = ", topk: 8" if payload == "topk" else ""
    return BASE.format(teacher=f"{{kind: self, on_nonfinite: {on_nonfinite}{topk}{cache}}}", steps=3,
                       extra=f"trainer: {{nonfinite: {value}}}")


@pytest.mark.parametrize("payload,value", [("full", "nan"), ("full", "inf"), ("topk", "nan")])
def test_nonfinite_teacher_answer_is_the_teachers_error(job, payload, value):
    rc = job.run("steps_plain", teacher_config(job, "error", payload, value), options=FREE_PORT)
    assert rc != 0, job.output
    # The request of student 0 holding the token, named by the teacher, with row, position, count.
    assert ("teacher rank 2 (teacher 0 of its node) computed an answer to the request (step 1, acc_step 0, seq 1) "
            "of student rank 0 whose output 'logits' is not finite: 1 value(s) NaN or +inf in 1 token(s), "
            f"the first at row 1, position 3 ({'nan' if value == 'nan' else '+inf'})") in job.output, job.output
    assert "the teacher's model is at fault, not the student" in job.output, job.output
    assert "[step=1 acc_step=0" in job.output, job.output
    # Never a loss from it: no step finished.
    assert "loss=nan" not in job.output, job.output


@pytest.mark.parametrize("payload", ["full", "topk"])
def test_masked_tokens_learn_from_labels_only_and_are_counted(job, payload):
    rc = job.run("steps_plain", teacher_config(job, "mask", payload), options=FREE_PORT)
    assert rc == 0, job.output
    assert "1 token(s) masked as not finite (teacher.on_nonfinite)" in job.output, job.output
    assert "masked tokens=1" in job.output, job.output  # distill-run's last status line
    for rank in (0, 1):
        r = job.report(rank)
        assert r["steps"] == 3, r
        masked = [s[0] for s in r["nonfinite"]]
        assert masked == [1, 0, 0], r["nonfinite"]  # summed over the students: the same on each
        assert all(math.isfinite(s[4]) for s in r["nonfinite"]), r["nonfinite"]
        assert math.isfinite(r["weights_after"]), r


def test_masked_answers_are_never_cached(job):
    cache = f", cache: {{path: {job.dir / 'cache'}, mode: readwrite}}"
    for run in range(2):
        rc = job.run("steps_plain", teacher_config(job, "mask", cache=cache), options=FREE_PORT)
        assert rc == 0, job.output
        # The second run finds every other row in the store, and computes the masked one again.
        assert "1 token(s) masked as not finite" in job.output, (run, job.output)
        assert [s[0] for s in job.report(0)["nonfinite"]] == [1, 0, 0], (run, job.output)


def student_config(on_nonfinite):
    """Student rank 1's logits are NaN at (step 2, acc_step 0)."""
    cfg = BASE.format(teacher="{kind: self}", steps=3, extra="trainer: {student_nan_step: 2}")
    return cfg.replace("loss: {alpha: 0.5, temperature: 2.0}",
                       f"loss: {{alpha: 0.5, temperature: 2.0, on_nonfinite: {on_nonfinite}}}")


def test_nonfinite_student_loss_is_an_error_naming_step_and_student(job):
    rc = job.run("steps", student_config("error"), options=FREE_PORT)
    assert rc != 0, job.output
    assert "NumericError" in job.output, job.output
    assert "step 2: student rank " in job.output, job.output
    assert "not finite" in job.output and "loss.on_nonfinite: skip_step" in job.output, job.output
    assert "[step=2 acc_step=1]" in job.output, job.output


def test_skip_step_skips_the_update_on_every_student(job):
    rc = job.run("steps", student_config("skip_step"), options=FREE_PORT)
    assert rc == 0, job.output
    assert "no student applies this step's update (loss.on_nonfinite: skip_step; 1 step(s) skipped so far)" \
        in job.output, job.output
    assert "skipped steps=1" in job.output, job.output  # distill-run's last status line
    weights = []
    for rank in (0, 1):
        r = job.report(rank)
        assert r["steps"] == 3, r
        steps = r["nonfinite"]
        assert [s[1] for s in steps] == [False, True, False], steps
        assert [s[2] for s in steps] == [0, 1, 1], steps
        assert steps[1][3] == steps[0][3], steps  # step 2 changed no weight
        assert steps[2][3] != steps[1][3], steps  # step 3 trained again
        assert math.isfinite(r["weights_after"]), r
        weights.append(r["weights_after"])
    assert weights[0] == weights[1]  # every student skipped the same step
