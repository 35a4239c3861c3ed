"""Python students and a Python teacher on a GPU, in real distill-run jobs: the teacher's answers
reach the students on the GPU (CUDA IPC through the rings) equal to a CPU forward, and distill.Steps
trains a DDP student on cuda (2 students sharing one GPU: the student group reduces through gloo)
to the same first-step gradients as the same job on the CPU, and a job under transport.cuda_mps: on
answers as without it. Skipped where no GPU is visible."""

import shutil

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")

JOB = """
run: {{name: pycuda, steps: 3, log_dir: logs, startup_timeout_s: 120, collective_timeout_s: 120,
      hang_timeout_s: 120}}
teacher: {{kind: {kind}, device: {device}, max_restarts: 0{path}}}
student: {{grad_acc_steps: 2, in_flight: 2, device: {device}}}
loss: {{alpha: 0.5, temperature: 2.0}}
trainer: {{device: {device}}}
"""


def config(job, device, kind="self"):
    path = f", path: {job.tiny_lm}" if kind == "torchscript" else ""
    return JOB.format(kind=kind, device=device, path=path)


def expect_cuda_answers_equal_to_a_cpu_forward(job):
    for rank in (0, 1):
        r = job.report(rank)
        assert r["logits_device"].startswith("cuda"), r
        assert len(r["tags"]) == 6
        assert r["max_logit_diff"] < 1e-3, r["max_logit_diff"]
        assert r["max_loss_diff"] < 1e-4, r["max_loss_diff"]


@pytest.mark.parametrize("kind", ["self", "torchscript"])
def test_answers_reach_cuda_students_equal_to_a_cpu_forward(job, kind):
    rc = job.run("lowlevel", config(job, "cuda", kind))
    assert rc == 0, job.output
    expect_cuda_answers_equal_to_a_cpu_forward(job)
    if kind == "self":
        assert "teacher module on cuda" in job.output, job.output


def test_steps_on_cuda_match_the_same_job_on_cpu(job, tmp_path):
    rc = job.run("steps_plain", config(job, "cuda"))
    assert rc == 0, job.output
    cuda = [job.report(rank) for rank in (0, 1)]
    rc = job.run("steps_plain", config(job, "cpu"))
    assert rc == 0, job.output
    cpu = [job.report(rank) for rank in (0, 1)]
    for g, c in zip(cuda, cpu):
        assert g["steps"] == c["steps"] == 3
        for name, want in c["grads"].items():
            got = torch.tensor(g["grads"][name])
            want = torch.tensor(want)
            assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item()), name
        assert abs(g["weights_after"] - c["weights_after"]) <= 1e-3 * max(1.0, abs(c["weights_after"]))


@pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None, reason="no nvidia-cuda-mps-control on PATH")
def test_a_job_under_transport_cuda_mps_answers_as_without_it(job):
    """transport.cuda_mps: on (docs/gpu.md): distill-run runs an MPS server of its own, every rank a
    client of it; the answers reach the CUDA students as they do without it, and the server stops."""
    rc = job.run("lowlevel", config(job, "cuda") + "transport: {cuda_mps: on}\n")
    assert rc == 0, job.output
    expect_cuda_answers_equal_to_a_cpu_forward(job)
    assert "transport.cuda_mps: an MPS server for this node's ranks" in job.output, job.output
    assert "transport.cuda_mps: the MPS server stopped" in job.output, job.output
