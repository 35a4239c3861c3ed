"""teacher.answer hidden with a Hugging Face teacher served by distill.serve(session, model) and no
other code (docs/teacher.md, "The hidden-state answer"): the teacher sends the input of its output
layer and publishes the layer once; the students' losses and updates equal the full-logits
answer's, through the materialised loss (rank 0: backward(logits)) and the fused one (rank 1:
backward(hidden, lm_head=...)), on a GPU too (the students of one GPU share one copy of the head
there), and through the low-level API (a Reply of kind "hidden" and distill.loss of it). The head of every supported family reproduces the model's own logits; a head
that is not one is refused at start-up, naming the model type."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

import distill  # noqa: E402
import hf_trainer as ht  # noqa: E402
from distill.head import head_logits  # noqa: E402
from distill.hf import HFTeacher, hf_head  # noqa: E402

TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_trainer.py")

CONFIG = """
run: {{name: hidden, steps: {steps}, log_dir: logs-{answer}, startup_timeout_s: 120, collective_timeout_s: 120,
      hang_timeout_s: 120}}
teacher: {{kind: self, max_restarts: 0, inputs: {inputs}, answer: {answer}, device: {device}}}
student: {{grad_acc_steps: 1, in_flight: 2, device: {device}}}
loss: {{alpha: 0.5, temperature: 2.0}}
trainer: {{device: {device}}}
"""
# float32 throughout: the hidden answer's teacher logits are the same GEMM as the teacher's own
# lm_head, chunked in C++ (rounding of order 1e-7 on logits of order 1).
LOSS_TOL = 1e-5
PARAM_TOL = 1e-5


def run_job(bin_dir, tmp_path, answer, teacher, mode="paths", inputs="[input_ids]", rc=0, device="cpu"):
    cfg = tmp_path / f"{answer}.yaml"
    cfg.write_text(CONFIG.format(steps=ht.STEPS, answer=answer, inputs=inputs, device=device))
    out = tmp_path / f"out-{answer}"  # logs: log_dir logs-<answer>
    out.mkdir(exist_ok=True)
    cmd = [os.path.join(bin_dir, "distill-run"), "--config", str(cfg), "--nproc-per-node", "3", "--master-port", "0",
           "--", sys.executable, TRAINER, "--mode", mode, "--out", str(out), "--teacher", teacher]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = p.stdout + p.stderr
    assert (p.returncode == 0) == (rc == 0), output[-4000:]
    if rc:
        return None, output
    return [json.load(open(out / f"rank{r}.json")) for r in (0, 1)], output


def max_param_diff(params, ref):
    return max((torch.tensor(params[n]) - ref[n]).abs().max().item() for n in ref)


@pytest.fixture(scope="module")
def full_logits_job(bin_dir, tmp_path_factory):
    """The Qwen2 job with teacher.answer logits: what the hidden-state jobs must equal."""
    reports, _ = run_job(bin_dir, tmp_path_factory.mktemp("logits"), "logits", "qwen2")
    return reports


def assert_same_training(got, want):
    for h, f in zip(got, want):  # rank 0: materialised, rank 1: fused
        assert h["steps"] == f["steps"] == ht.STEPS
        diff = max(abs(a - b) for hl, fl in zip(h["losses"], f["losses"]) for a, b in zip(hl, fl))
        assert diff < LOSS_TOL, (h["losses"], f["losses"])
        assert max_param_diff(h["params"], {n: torch.tensor(v) for n, v in f["params"].items()}) < PARAM_TOL
    # the two paths and both students moved together: one summed gradient
    assert max_param_diff(got[0]["params"], {n: torch.tensor(v) for n, v in got[1]["params"].items()}) < PARAM_TOL


def test_a_qwen2_teacher_answering_hidden_states_trains_as_full_logits(bin_dir, tmp_path, full_logits_job):
    hidden, output = run_job(bin_dir, tmp_path, "hidden", "qwen2")
    assert "published its head" in output, output[-3000:]
    assert_same_training(hidden, full_logits_job)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
def test_cuda_students_share_one_copy_of_the_head_on_their_gpu_and_train_as_full_logits(bin_dir, tmp_path,
                                                                                       full_logits_job):
    """Two students on one GPU: the first copies the mapped head there, the other imports that copy
    by CUDA IPC (one copy per node and device); the training equals the CPU full-logits job's."""
    hidden, output = run_job(bin_dir, tmp_path, "hidden", "qwen2", device="cuda")
    assert output.count("copied the teacher's head to cuda:0") == 1, output[-3000:]
    assert output.count("shares the teacher's head on cuda:0") == 1, output[-3000:]
    assert "is not shared on" not in output, output[-3000:]
    for h, f in zip(hidden, full_logits_job):  # float32 GEMMs of cuBLAS against the CPU's
        assert max(abs(a - b) for hl, fl in zip(h["losses"], f["losses"]) for a, b in zip(hl, fl)) < 1e-4
        assert max_param_diff(h["params"], {n: torch.tensor(v) for n, v in f["params"].items()}) < 1e-4


def test_a_function_teacher_with_its_head_given_trains_as_full_logits(bin_dir, tmp_path, full_logits_job):
    # distill.serve(session, lambda ids: base(ids).last_hidden_state, head=model.lm_head): no adapter
    hidden, output = run_job(bin_dir, tmp_path, "hidden", "qwen2-plain")
    assert "published its head" in output, output[-3000:]
    assert_same_training(hidden, full_logits_job)


def test_a_student_gets_a_hidden_reply_and_its_loss_with_the_low_level_api(bin_dir, tmp_path):
    # Gemma 2, soft-capped at 2: its logits from the reply's hidden states and the head found in
    # this process, and distill.loss of the reply (the head the student mapped) or of a dict of its
    # hidden states with session= (the same head), equal its own.
    reports, output = run_job(bin_dir, tmp_path, "hidden", "gemma2", mode="lowlevel",
                              inputs="[input_ids, attention_mask]")
    assert "softcap 2" in output, output[-3000:]  # the teacher's log line of the published head
    for r in reports:
        assert r["answers"] == 3 and r["kind"] == "hidden", r
        assert r["hidden_shape"] == [ht.BATCH, ht.SEQ, 48], r
        assert r["max_logit_diff"] < 1e-5, r
        assert r["max_loss_diff"] < LOSS_TOL, r
        assert r["masked_rows_differ"] > 1e-3, r  # the mask reached the model
        assert ("distill.loss: the teacher's answer is hidden states, and a dict of them brings no head: pass the "
                "Reply itself, or session=") in r["no_head_error"], r


def test_a_head_that_is_not_one_is_refused_at_start_up_naming_the_model_type(bin_dir, tmp_path):
    _, output = run_job(bin_dir, tmp_path, "hidden", "refused", rc=1)
    assert "the Hugging Face model of type 'llama' (LlamaForCausalLM) transforms its logits by " \
           "lm_head_multiplier = 2.0" in output, output[-4000:]
    assert "pybind11" not in output and ".cpp:" not in output


# In-process: the head found for each family reproduces the model's own logits (the hidden states
# taken by the pre-hook, the transforms from the config), without computing [B, T, V].

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, (0.0, 1.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, (0.0, 1.0)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "final_logit_softcapping": 3.0}, (3.0, 1.0)),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.5}, (0.0, 0.5)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 4.0}, (0.0, 0.25)),
}


def tiny(family, **overrides):
    import transformers

    config_name, model_name, extra, _ = FAMILIES[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, config_name)(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, **{**extra, **overrides})
    return getattr(transformers, model_name)(cfg).eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_head_of_each_family_gives_its_logits(family):
    model = tiny(family)
    teacher = HFTeacher(model, ["input_ids"], hidden=True, share_prefix=4)
    assert (teacher.head.softcap, teacher.head.scale) == FAMILIES[family][3]
    teacher.check_head()
    ids = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(1))
    ids[1] = ids[0]
    ids[1, 8:] = 7  # rows 0 and 1 share a prefix of 8: computed once (HFTeacher's groups)
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: seen.append(out.shape))
    with torch.no_grad():
        hidden = teacher(ids)
        hook.remove()
        want = model(input_ids=ids, use_cache=False).logits
        got = head_logits(hidden, teacher.head)
    assert hidden.shape == (3, 10, 32)
    assert all(s[-2] == 0 for s in seen), seen  # the output layer was given no positions
    assert teacher.tokens < teacher.tokens_unshared
    assert (got - want).abs().max().item() < 1e-5


def test_an_output_layer_with_a_bias_is_published_with_it():
    model = tiny("qwen2")
    with torch.no_grad():
        model.lm_head = torch.nn.Linear(32, 64, bias=True)
        model.lm_head.bias.uniform_(-1, 1)
    teacher = HFTeacher(model, ["input_ids"], hidden=True)
    assert teacher.head.bias is model.lm_head.bias
    teacher.check_head()  # the probe: the bias is part of the model's logits and of the head's
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = head_logits(teacher(ids), teacher.head)
        assert (got - model(input_ids=ids, use_cache=False).logits).abs().max().item() < 1e-5
        without = teacher.head._replace(bias=None)
        assert (head_logits(teacher(ids), without) - got).abs().max().item() > 0.1  # the bias mattered


def test_an_output_layer_that_is_no_linear_is_refused_naming_the_type():
    model = tiny("llama")
    model.lm_head = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False))
    with pytest.raises(distill.ConfigError, match=r"model of type 'llama' \(LlamaForCausalLM\) has an output layer "
                                                  r"of type Sequential, not a torch.nn.Linear"):
        hf_head(model)
    model.get_output_embeddings = lambda: None
    with pytest.raises(distill.ConfigError, match=r"type 'llama' \(LlamaForCausalLM\) has no output layer.*serve a "
                                                  r"function that returns its final hidden states"):
        HFTeacher(model, ["input_ids"], hidden=True)


def test_a_scale_of_another_model_type_is_refused():
    model = tiny("llama")
    model.config.logits_scaling = 2.0  # Granite divides by it, HyperCLOVA X multiplies: not a Llama's
    with pytest.raises(distill.ConfigError, match=r"type 'llama'.*logits_scaling = 2.0"):
        hf_head(model)
    model.config.logits_scaling = 1.0  # neutral: no transform either way
    assert hf_head(model).scale == 1.0


def test_a_transform_no_config_declares_is_caught_by_the_start_up_probe():
    model = tiny("qwen2")
    forward = model.forward

    def doubled(*args, **kw):  # logits * 2 after lm_head, as a model of unknown code might
        out = forward(*args, **kw)
        out.logits = out.logits * 2
        return out

    model.forward = doubled
    teacher = HFTeacher(model, ["input_ids"], hidden=True)
    with pytest.raises(distill.ConfigError, match=r"type 'qwen2'.*do not reproduce"):
        teacher.check_head()


def fake_session(weight="lm_head.weight", softcap=0.0, scale=1.0):
    """What _declared_head reads of a session: session.config.teacher.head."""
    from types import SimpleNamespace as NS

    return NS(config=NS(teacher=NS(head=NS(weight=weight, softcap=softcap, scale=scale))))


def test_a_python_teacher_declares_its_head_by_argument_or_by_parameter_name():
    from distill.head import TeacherHead
    from distill.teacher import _declared_head

    layer = torch.nn.Linear(8, 16)
    given = _declared_head(fake_session(), lambda ids: ids, None, layer)
    assert given.weight is layer.weight and given.bias is layer.bias and (given.softcap, given.scale) == (0.0, 1.0)
    given = _declared_head(fake_session(), lambda ids: ids, None, TeacherHead(layer.weight, None, 30.0, 0.5))
    assert given.bias is None and (given.softcap, given.scale) == (30.0, 0.5)
    module = torch.nn.Module()
    module.lm_head = layer  # teacher.head.weight's default, lm_head.weight: the config path (C++ looks it up)
    assert _declared_head(fake_session(), module, None, None) is None
    with pytest.raises(distill.ConfigError, match=r"the Python teacher \(a function\) has no parameter or buffer "
                                                  r"'lm_head.weight' \(teacher.head.weight\).*head=\.\.\."):
        _declared_head(fake_session(), lambda ids: ids, None, None)
    with pytest.raises(distill.ConfigError, match=r"head must be a distill.TeacherHead, a torch.nn.Linear"):
        _declared_head(fake_session(), module, None, "lm_head")
    with pytest.raises(distill.ConfigError, match=r"weight must be \[V, d\] and its bias \[V\]"):
        _declared_head(fake_session(), module, None, (layer.weight, torch.zeros(3)))


def test_config_transforms_that_contradict_a_hugging_face_model_are_refused():
    from distill.teacher import _declared_head

    model = tiny("gemma2")
    hf = HFTeacher(model, ["input_ids"], hidden=True)
    assert _declared_head(fake_session(softcap=3.0), model, hf, None).softcap == 3.0  # the same: fine
    with pytest.raises(distill.ConfigError, match=r"teacher.head: softcap 30.0 and scale 1.0 differ from what the "
                                                  r"Hugging Face model \(type 'gemma2'\) declares, softcap 3.0"):
        _declared_head(fake_session(softcap=30.0), model, hf, None)


def test_head_logits_is_the_students_computation_against_its_closed_form():
    """distill.head.head_logits runs distill::teacherLogits (what the students compute, chunked):
    float64 against scale, then soft-cap, of hidden @ weight.T + bias, at any chunk size."""
    g = torch.Generator().manual_seed(0)
    w, b, h = (torch.randn(50, 8, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64),
               torch.randn(3, 7, 8, generator=g, dtype=torch.float64) * 4)
    head = distill.TeacherHead(w, b, softcap=5.0, scale=0.5)
    want = torch.tanh((h @ w.T + b) * 0.5 / 5.0) * 5.0
    for chunk in (0, 1, 4):
        got = head_logits(h, head, chunk_tokens=chunk)
        assert got.shape == (3, 7, 50) and got.dtype == torch.float64
        assert (got - want).abs().max().item() < 1e-12
    with pytest.raises(distill.UsageError, match="softcap"):
        head_logits(h, head._replace(softcap=-1.0))
