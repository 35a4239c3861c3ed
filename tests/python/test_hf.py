"""Hugging Face models with distill, in real distill-run jobs: a LlamaForCausalLM teacher served by
distill.serve(session, model) (use_cache at its default True), HF students through the low-level
API and through distill.Steps in float32, bf16 autocast and fp16 autocast with a GradScaler."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

import distill  # noqa: E402
import hf_trainer as ht  # noqa: E402

TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_trainer.py")

CONFIG = """
run: {{name: hf, steps: {steps}, log_dir: logs, startup_timeout_s: 300, collective_timeout_s: 300,
      hang_timeout_s: 300}}
teacher: {{kind: self, max_restarts: 0, inputs: {inputs}}}
student: {{grad_acc_steps: 1, in_flight: 2}}
loss: {{alpha: 0.5, temperature: 1.0}}
"""


def run_job(bin_dir, tmp_path, mode, inputs="[input_ids]", precision="float32", rc=0):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(CONFIG.format(steps=ht.STEPS, inputs=inputs))
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    cmd = [os.path.join(bin_dir, "distill-run"), "--config", str(cfg), "--nproc-per-node", "3", "--master-port", "0", "--",
           sys.executable, TRAINER, "--mode", mode, "--out", str(out), "--precision", precision]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = p.stdout + p.stderr
    assert (p.returncode == 0) == (rc == 0), output[-4000:]
    if rc:
        return None, output
    return [json.load(open(out / f"rank{r}.json")) for r in (0, 1)], output


def test_hf_teacher_served_as_is_with_attention_mask(bin_dir, tmp_path):
    assert ht.teacher_model().config.use_cache  # the default that failed before the adapter
    reports, output = run_job(bin_dir, tmp_path, "lowlevel", inputs="[input_ids, attention_mask]")
    for r in reports:
        assert r["answers"] == 3
        assert r["max_logit_diff"] < 1e-5, r
        assert r["masked_rows_differ"] > 1e-3, r  # the mask was passed to the model
    assert "teacher served 6 requests" in output


def test_a_teacher_dict_entry_that_is_no_tensor_is_named(bin_dir, tmp_path):
    # A callable returning the HF model's ModelOutput as it is: the cache beside the logits.
    _, output = run_job(bin_dir, tmp_path, "raw", rc=1)
    assert re.search(r"the Python teacher's forward returned a dict whose '(cache|past_key_values)' is a "
                     r"DynamicCache, not a tensor", output), output[-4000:]
    assert "pybind11" not in output and "Unable to cast" not in output


def reference_params():
    """One process, float32: both students' micro-batches of each step concatenated, the same
    loss (distill.loss on the teacher's full logits, normaliser the step's tokens), SGD."""
    teacher, model = ht.teacher_model().eval(), ht.student_model()
    opt = torch.optim.SGD(model.parameters(), lr=ht.LR)
    mbs = [ht.micro_batches(r, ht.STEPS) for r in (0, 1)]
    for step in range(ht.STEPS):
        x = torch.cat([mbs[0][step][0], mbs[1][step][0]])
        y = torch.cat([mbs[0][step][1], mbs[1][step][1]])
        with torch.no_grad():
            t = teacher(x, use_cache=False).logits
        r = distill.loss(model(x).logits, y, {"logits": t}, float(y.numel()), alpha=0.5, temperature=1.0)
        r.loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def relative_update_error(params, ref, initial):
    """|| (p - p0) - (ref - p0) || / || ref - p0 ||, over every parameter."""
    num = sum(((torch.tensor(params[n]) - ref[n]) ** 2).sum() for n in ref)
    den = sum(((ref[n] - initial[n]) ** 2).sum() for n in ref)
    return (num / den).sqrt().item()


@pytest.mark.parametrize("precision,tolerance", [("float32", 1e-4), ("bf16", 0.05), ("fp16", 0.01)])
def test_hf_students_with_steps_in_mixed_precision(bin_dir, tmp_path, precision, tolerance):
    reports, _ = run_job(bin_dir, tmp_path, "steps", precision=precision)
    ref = reference_params()
    initial = {n: p.detach() for n, p in ht.student_model().named_parameters()}
    for r in reports:
        assert r["steps"] == ht.STEPS
        err = relative_update_error(r["params"], ref, initial)
        assert err < tolerance, (precision, err)
    if precision == "fp16":  # the scaler's scale was applied to the loss and unscaled by scaler.step
        assert all(s >= 2.0**10 for s in reports[0]["scales"]), reports[0]["scales"]
