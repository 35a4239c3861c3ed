"""Issue 44's sampled answers in real distill-run jobs: a TorchScript teacher with teacher.samples
draws K ids per position and the students train on them to the end; what sampled answers cannot
serve is refused at the start, naming why; the teacher cache stores them like any answer."""

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
