"""A paused Python teacher is a stall, not a death (default transport settings:
heartbeat_ms 100, stall_timeout_s 60)."""

from test_jobs import check_lowlevel, config


def test_teacher_holding_the_gil_for_seconds_is_no_loss(job):
    # The teacher's 3rd forward spins in Python for 3 s holding the GIL; the
    # heartbeat thread is C++ and the students wait: the job ends as usual.
    rc = job.run("lowlevel", config(job, teacher="self", extra="trainer: {gil_busy_s: 3}"))
    assert rc == 0, job.output
    check_lowlevel(job)
    assert "PeerLostError" not in job.output
