"""On-policy distillation (distill.onpolicy, docs/onpolicy.md): the sampler in-process; prompt
groups scored once by the Hugging Face teacher, a zero-length response, a group larger than a
request slot, and a stop in the middle of a generation, in real distill-run jobs."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

import distill  # noqa: E402
import onpolicy_trainer as ot  # noqa: E402
from distill.hf import HFTeacher, find_groups  # noqa: E402

TRAINER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "onpolicy_trainer.py")

CONFIG = """
run: {{name: onpolicy, steps: {steps}, seed: 3, log_dir: logs, startup_timeout_s: 120, collective_timeout_s: 120,
      hang_timeout_s: 120}}
teacher: {{kind: self, max_restarts: 0{teacher}}}
student: {{grad_acc_steps: 1, in_flight: {in_flight}}}
loss: {{kind: {loss}, alpha: 0.9, temperature: 1.0}}
{extra}
"""


def start_job(bin_dir, tmp_path, mode, steps=1, in_flight=2, extra="", teacher="", loss="reverse_kl"):
    tmp_path.mkdir(exist_ok=True)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(CONFIG.format(steps=steps, in_flight=in_flight, extra=extra, teacher=teacher, loss=loss))
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    cmd = [os.path.join(bin_dir, "distill-run"), "--config", str(cfg), "--nproc-per-node", "3", "--master-port", "0",
           "--", sys.executable, TRAINER, "--mode", mode, "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_job(p, tmp_path, ok=True):
    try:
        output, _ = p.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        p.kill()
        output, _ = p.communicate()
        raise AssertionError("the job ran past 180 s: " + output[-3000:]) from None
    assert (p.returncode == 0) == ok, output[-4000:]
    return ([json.load(open(tmp_path / "out" / f"rank{r}.json")) for r in (0, 1)] if ok else None), output


def run_job(bin_dir, tmp_path, mode, steps=1, in_flight=2, extra="", ok=True, teacher="", loss="reverse_kl"):
    return finish_job(start_job(bin_dir, tmp_path, mode, steps, in_flight, extra, teacher, loss), tmp_path, ok)


def test_sampling_is_reproducible_from_the_seed():
    model, x = ot.student_model(), torch.randint(4, ot.VOCAB, (2, ot.P), generator=torch.Generator().manual_seed(0))

    def draw(seed, **kw):
        return distill.onpolicy.sample(model, x, ot.R, group_size=3, generator=torch.Generator().manual_seed(seed),
                                       **kw)

    a, b, c = draw(1, top_p=0.9), draw(1, top_p=0.9), draw(2, top_p=0.9)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.input_ids, c.input_ids)
    assert a.input_ids.shape == (6, ot.P + ot.R - 1)
    assert torch.equal(a.input_ids[:, : ot.P], x.repeat_interleave(3, 0))  # groups: consecutive rows
    assert (a.labels[:, : ot.P - 1] == -100).all() and (a.labels[:, ot.P - 1 :] != -100).all()
    assert torch.equal(a.labels[:, ot.P - 1 : -1], a.input_ids[:, ot.P :])  # the next token
    # greedy and the generic path (a plain callable returning logits: no KV cache) agree
    greedy = draw(1, temperature=0)
    plain = distill.onpolicy.sample(lambda ids: model(ids, use_cache=False).logits, x, ot.R, group_size=3,
                                    temperature=0)
    assert torch.equal(greedy.input_ids, plain.input_ids)


def test_sampling_records_its_log_probabilities_and_the_students_top_k():
    """At no extra forward: each label's log-probability under the distribution it was drawn from
    (temperature 0.7, top_p 1), and the top-k ids of the logits it was drawn from, both against a
    teacher-forced forward of the whole sample; 0 and 0 .. k - 1 where nothing was sampled."""
    model, x = ot.student_model(), torch.randint(4, ot.VOCAB, (2, ot.P), generator=torch.Generator().manual_seed(0))
    s = distill.onpolicy.sample(model, x, ot.R, group_size=2, temperature=0.7, topk=4, eos_token_id=ot.EOS,
                                generator=torch.Generator().manual_seed(3))
    assert s.sampling_logprobs.shape == s.labels.shape and s.topk_ids.shape == (*s.labels.shape, 4)
    with torch.no_grad():
        logits = model(s.input_ids, use_cache=False).logits
    sampled = s.labels != -100
    want = torch.log_softmax(logits / 0.7, -1).gather(-1, s.labels.clamp_min(0)[..., None])[..., 0]
    assert torch.allclose(s.sampling_logprobs[sampled], want[sampled], atol=1e-4)
    assert (s.sampling_logprobs[~sampled] == 0).all() and (s.sampling_logprobs[sampled] < 0).all()
    top = logits.topk(4, -1).values
    assert torch.allclose(logits.gather(-1, s.topk_ids)[sampled], top[sampled], atol=1e-4)
    assert (s.topk_ids[~sampled] == torch.arange(4)).all()
    assert torch.equal(s.token_ids()[..., 0][sampled], s.labels[sampled])
    assert distill.onpolicy.sample(model, x, ot.R, temperature=0).sampling_logprobs is None  # greedy: no policy


def test_the_mixer_hands_steps_the_ids_it_asks_for():
    model = ot.student_model()
    token = distill.onpolicy.Mixer(model, ot.prompts, ot.dataset, lam=0.5, max_new_tokens=ot.R, ids="token", seed=1)
    kinds = set()
    for _ in range(6):
        mb = token.next()
        assert len(mb) == 4 and torch.equal(mb[2][..., 0], mb[1].clamp_min(0))
        kinds.add(mb[3] is None)  # a dataset batch has no sampling log-probabilities
    assert kinds == {True, False}
    topk = distill.onpolicy.Mixer(model, ot.prompts, max_new_tokens=ot.R, ids="topk", topk=3)
    inputs, labels, ids = topk.next()
    assert ids.shape == (*labels.shape, 3)
    with pytest.raises(distill.ConfigError, match="exactly with 'topk'"):
        distill.onpolicy.Mixer(model, ot.prompts, ids="topk")


def test_bad_sampling_arguments_are_named():
    model, x = ot.student_model(), torch.zeros(2, ot.P, dtype=torch.long)
    with pytest.raises(distill.ConfigError, match=r"group_size=0 \(>= 1\)"):
        distill.onpolicy.sample(model, x, ot.R, group_size=0)
    with pytest.raises(distill.ConfigError, match=r"prompts must be token ids \[batch, prompt_len >= 1\], got \(16,\)"):
        distill.onpolicy.sample(model, x[0], ot.R)
    with pytest.raises(distill.ConfigError, match="lam=0.5 must be in \\[0, 1\\], and below 1 needs a dataset"):
        distill.onpolicy.Mixer(model, ot.prompts, lam=0.5)


def test_eos_ends_a_response_and_pads_the_rest():
    model, x = ot.student_model(), torch.randint(4, ot.VOCAB, (1, ot.P), generator=torch.Generator().manual_seed(0))
    eos = int(distill.onpolicy.sample(model, x, 2, temperature=0).labels[0, ot.P - 1])  # the greedy first token
    s = distill.onpolicy.sample(model, x, ot.R, temperature=0, eos_token_id=eos, pad_token_id=1)
    assert s.response_lengths.tolist() == [1]
    assert (s.labels[0] != -100).sum() == 1 and s.labels[0, ot.P - 1] == eos
    assert s.input_ids[0, ot.P] == eos and (s.input_ids[0, ot.P + 1 :] == 1).all()
    assert s.attention_mask[0].sum() == ot.P + 1


def test_groups_are_found_and_scored_as_unshared():
    teacher = ot.teacher_model().eval()
    x = torch.randint(4, ot.VOCAB, (3, 20), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([x[:1].repeat(3, 1), x[1:2], x[2:].repeat(2, 1)])
    ids[1, 18:], ids[2, 17:] = 1, 2  # the first group shares 17 tokens; the second all 20
    assert find_groups(ids, None, 16) == [(0, 3, 17), (4, 2, 20)]
    assert find_groups(ids, None, 18) == [(0, 2, 18), (4, 2, 20)]
    assert find_groups(ids, None, 19) == [(4, 2, 20)]
    h = HFTeacher(teacher, ["input_ids"])
    with torch.inference_mode():
        got, want = h(ids), teacher(input_ids=ids, use_cache=False).logits
    assert (got - want).abs().max().item() < 1e-5
    assert (h.tokens, h.tokens_unshared) == (17 + 3 * 3 + 20 + 20, 6 * 20)


def test_a_model_without_a_repeatable_cache_is_scored_unshared():
    teacher = ot.teacher_model().eval()

    def no_cache(*args, **kwargs):  # a model whose cache cannot be repeated to a group's rows
        out = type(teacher).forward(teacher, *args, **kwargs)
        for key in ("cache", "past_key_values"):
            if key in out:
                out[key] = (("not", "a cache"),)
        return out

    teacher.forward = no_cache
    ids = torch.randint(4, ot.VOCAB, (1, 20), generator=torch.Generator().manual_seed(0)).repeat(3, 1)
    ids[1:, 18:] = 1
    h = HFTeacher(teacher, ["input_ids"])
    with torch.inference_mode():
        got, want = h(ids), teacher(input_ids=ids, use_cache=False).logits
    assert torch.equal(got, want) and h.tokens == h.tokens_unshared == 60 and h.share_prefix == 0


def test_a_group_request_is_answered_as_single_requests(bin_dir, tmp_path):
    reports, output = run_job(bin_dir, tmp_path, "group", in_flight=1)
    for r in reports:
        assert r["rows"] == 2 * ot.G and r["width"] == ot.P + ot.R - 1
        assert r["group_vs_unshared"] < 1e-5, r
        assert r["group_vs_singles"] < 1e-5, r
        assert r["response_tokens"] < 2 * ot.G * ot.R  # row 1 trains nothing
    m = re.search(r"teacher tokens (\d+) of (\d+)", output)
    assert m, output[-3000:]
    rows, width = 2 * ot.G, ot.P + ot.R - 1
    # per student: the group request computes its 2 prompts once, then each row alone
    assert int(m[2]) == 2 * (2 * rows * width)
    assert int(m[1]) <= 2 * (2 * ot.P + rows * (width - ot.P) + rows * width), m[0]


def test_a_group_larger_than_a_request_slot_is_named(bin_dir, tmp_path):
    # 2 KiB holds teacher.max_batch_tokens=256 tokens (checked before start); the group's 16 rows do not fit.
    _, output = run_job(bin_dir, tmp_path, "big", extra="transport: {max_request_bytes: 2KiB}", ok=False,
                        teacher=", max_batch_tokens: 256")
    width = ot.P + ot.R - 1
    assert f"tensor 'input_ids' of {16 * width * 8} bytes does not fit a request slot" in output, output[-3000:]
    assert "the slot holds 2048 bytes; raise transport.max_request_bytes" in output


def test_a_stop_in_the_middle_of_a_generation_resumes_cleanly(bin_dir, tmp_path):
    ckpt = "checkpoint: {dir: ckpt, every_steps: 1}"
    # the uninterrupted run and the stopped one at the same time (3 processes each)
    whole_job = start_job(bin_dir, tmp_path / "whole", "steps", steps=4, in_flight=1, extra=ckpt)
    stopped, output = run_job(bin_dir, tmp_path / "parts", "steps", steps=4, in_flight=1,
                              extra=ckpt + "\ntrainer: {stop_at_read: 1}")
    whole, _ = finish_job(whole_job, tmp_path / "whole")
    assert "Ctrl-C: stopping after this step" in output
    assert all(r["stopped"] and 0 < r["steps"] < 4 for r in stopped), [r["steps"] for r in stopped]
    resumed, _ = run_job(bin_dir, tmp_path / "parts", "steps", steps=4, in_flight=1, extra=ckpt)
    for w, s, r in zip(whole, stopped, resumed):
        assert r["resumed"] == s["steps"] and r["steps"] == 4 and not r["stopped"]
        assert s["seen"] + r["seen"] == w["seen"]  # the same micro-batches: prompts, samples, dataset rows
        assert r["counts"] == w["counts"]
        for name, p in w["params"].items():
            assert torch.allclose(torch.tensor(r["params"][name]), torch.tensor(p), atol=1e-6), name
    assert whole[0]["counts"]["onpolicy"] > 0 and whole[0]["counts"]["dataset"] > 0


# All on-policy, a large step (the weights a sample is drawn from matter) and dropout (the random
# number generators matter). A teacher-output cache rounds the answers; the stopped runs share it.
CHAIN = "checkpoint: {{dir: ckpt, every_steps: 1}}\ntrainer: {{lam: 1.0, lr: 10.0, dropout: 0.1{stop}}}"
PREFIX_CACHE = ", cache: {path: teacher_cache, mode: readwrite, keys: prefix}"
# The sampled-token recipe: each request carries its sampled tokens; the Mixer's dataset batches too (lam 0.5).
TOKEN_CHAIN = "checkpoint: {{dir: ckpt, every_steps: 1}}\ntrainer: {{lam: 0.5, lr: 2.0, dropout: 0.1, ids: token{stop}}}"


@pytest.mark.parametrize("cache,loss,chain", [("", "reverse_kl", CHAIN), (PREFIX_CACHE, "reverse_kl", CHAIN),
                                              (", request_ids: 1", "sampled_token", TOKEN_CHAIN)],
                         ids=["uncached", "prefix_cache", "sampled_token"])
def test_a_run_stopped_after_every_step_ends_as_the_uninterrupted_one(bin_dir, tmp_path, cache, loss, chain):
    """Stopped by Ctrl-C after step 1 and resumed to the end (2 steps; each more is one more job):
    every micro-batch sampled and every final weight equal to the uninterrupted run's, bit for bit.
    With student.in_flight 2 the next step's sample is drawn before the optimizer step: the
    checkpoint keeps it (a resume would draw it from newer weights), and the RNG state (dropout).
    The sampled-token recipe (loss.kind sampled_token, ids answers of the sampled tokens, the
    sampling log-probabilities as importance weights) resumes as exactly."""
    steps, extra = 2, lambda k: chain.format(stop=f", stop_after_step: {k}" if k else "")
    whole_job = start_job(bin_dir, tmp_path / "whole", "steps", steps=steps, extra=extra(0), teacher=cache, loss=loss)
    seen = [[], []]
    for k in list(range(1, steps)) + [0]:
        parts, output = run_job(bin_dir, tmp_path / "parts", "steps", steps=steps, extra=extra(k), teacher=cache,
                                loss=loss)
        want = (k - 1, k, True) if k else (steps - 1, steps, False)  # resumed from, ended at, stopped
        assert all((p["resumed"], p["steps"], p["stopped"]) == want for p in parts), output[-3000:]
        seen = [s + p["seen"] for s, p in zip(seen, parts)]
    whole, output = finish_job(whole_job, tmp_path / "whole")
    assert "keys: prefix" not in cache or "prefix keys:" in output, output[-3000:]
    for w, s, p in zip(whole, seen, parts):
        assert [m[0] for m in s] == list(range(1, steps + 1))
        for i, (a, b) in enumerate(zip(w["seen"], s)):
            assert a == b, f"step {i + 1}'s micro-batch differs from the uninterrupted run's"
        for name, x in w["params"].items():
            assert torch.equal(torch.tensor(p["params"][name]), torch.tensor(x)), name
