"""Issue 44's answers in real distill-run jobs: a TorchScript teacher with teacher.samples draws K
ids per position and the students train on them to the end; what sampled answers cannot serve is
refused at the start, naming why; the teacher cache stores them like any answer; a request carrying
ids is answered with the teacher's logits at exactly those ids."""

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


IDS = """
run: {{name: py, log_dir: logs, startup_timeout_s: 60, collective_timeout_s: 60, hang_timeout_s: 60}}
teacher: {{kind: torchscript, path: {path}, request_ids: 5, payload_dtype: float32}}
student: {{in_flight: 1, grad_acc_steps: 2}}
loss: {{alpha: 0.5, temperature: 2.0, kind: reverse_kl}}
"""


def test_ids_answered_by_a_teacher_process_equal_a_gather_from_its_full_logits(job):
    """One student, one request at a time: the plain request and the one with ids are two batches
    of the same shape through the same teacher process, so the gather must be bit-for-bit."""
    rc = job.run("ids", IDS.format(path=job.tiny_lm), students=1)
    assert rc == 0, job.output
    r = job.report(0)
    assert r["kinds"] == ["ids"] * 3 and r["gather_equal"] == [True] * 3 and r["ids_back"], r
    assert r["lse_diff"] < 1e-5 and r["tail_diff"] < 1e-5, r  # float32 sums against float64
    assert r["loss_diff"] == 0.0 and math.isfinite(r["loss"]) and r["loss"] > 0, r
    assert "9 ids per position; teacher.request_ids (5) says how many a request may carry" in r["too_many"], r


def test_sampled_token_without_request_ids_is_refused_at_the_start(job):
    rc = job.run("steps_plain", BASE.format(path=job.tiny_lm, kind="sampled_token").replace(", samples: 8", ""))
    assert rc != 0, job.output
    assert "loss.kind sampled_token: needs the teacher's log-probability of each sampled token" in job.output, \
        job.output


def test_sampled_answers_with_reverse_kl_are_refused_at_the_start(job):
    rc = job.run("steps_plain", BASE.format(path=job.tiny_lm, kind="reverse_kl"))
    assert rc != 0, job.output
    assert "teacher.samples (8) with loss.kind reverse_kl: sampled answers give an unbiased forward KL only" \
        in job.output, job.output


def _cached(path, samples, cache, mode="readwrite"):
    """The sampled job's config with the teacher cache at `cache` (mode off: no cache)."""
    return BASE.format(path=path, kind="forward_kl").replace(
        "samples: 8}", f"samples: {samples}, cache: {{path: {cache}, mode: {mode}}}}}")


def _losses_and_weights(job):
    """Each student's (loss, weights after the step) per step, as its report says them."""
    return {rank: [(step[4], step[3]) for step in job.report(rank)["nonfinite"]] for rank in (0, 1)}


def _cache_summary(job):
    """The teacher's cache summary line ("teacher cache PATH: R rows ..."), from its rank log."""
    lines = [line for log in (job.dir / "logs").rglob("*.log") for line in log.read_text().splitlines()
             if "teacher cache " + str(job.dir / "cache") + ": " in line]
    assert len(lines) == 1, lines
    return lines[0]


def test_sampled_answers_are_cached_like_any_answer(job):
    """Issue 44 (d): the same job without the cache, with it over an empty store (every row
    computed, then stored) and again over that store (every row a hit, no forward) trains to the
    same losses and weights bit for bit: a row computed through the cache draws what it draws
    without it, and a hit returns the first draws. A teacher of another K over the store is refused
    at the start, naming what the store holds and what it answers."""
    cache = job.dir / "cache"
    assert job.run("steps_plain", _cached(job.tiny_lm, 8, cache, "off")) == 0, job.output
    uncached = _losses_and_weights(job)
    assert job.run("steps_plain", _cached(job.tiny_lm, 8, cache)) == 0, job.output
    missed, first = _losses_and_weights(job), _cache_summary(job)
    assert " looked up, 0 hits" in first, first
    assert job.run("steps_plain", _cached(job.tiny_lm, 8, cache)) == 0, job.output
    hit, second = _losses_and_weights(job), _cache_summary(job)
    assert "hits (100% of the rows looked up" in second and " 0 forwards, 0 rows stored" in second, second
    for rank in (0, 1):
        assert len(uncached[rank]) == 3 and all(math.isfinite(loss) for loss, _ in uncached[rank])
        assert missed[rank] == uncached[rank], (rank, missed[rank], uncached[rank])
        assert hit[rank] == missed[rank], (rank, hit[rank], missed[rank])

    assert job.run("steps_plain", _cached(job.tiny_lm, 16, cache)) != 0, job.output
    assert "was written by another teacher or for another signal: it holds answers of [sampled K=8 temperature " \
        "0x1p+1 run.seed 0] where this teacher answers [sampled K=16 temperature 0x1p+1 run.seed 0]" \
        in job.output, job.output
