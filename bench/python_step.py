"""bench/python_step.py: a Python student's step through the teacher process vs the C++
student's, the demo's model sizes, in one run. Prints JSON lines.

    PYTHONPATH=build/python python3 bench/python_step.py [--build build] [--steps 30] [--warmup 5]

Three measurements, one after the other on the same machine:
  cpp     build/bin/bench_e2e --jobs teacher: the C++ demo student (examples/gpt), student_only
          and teacher_process (a registered C++ teacher under distill-teacher, in_flight 2)
  python  this file under distill-run (1 student + the same registered C++ teacher, the same
          random-weight teacher file): the Python GPT of examples/python with the demo's student
          sizes, student_only (a plain PyTorch step, the teacher idle) then teacher_process
          (distill.Steps, in_flight 2)
and the ratios: each language's teacher_process / its student_only (what distillation costs
the step), and python / cpp for each mode (what the Python trainer costs).
One torch thread per process, as in bench_e2e.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def args_of(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "demo.yaml"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--student-mode", action="store_true", help=argparse.SUPPRESS)  # the job's student
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_known_args(argv)[0]


def p50(xs):
    return statistics.median(xs) * 1e3


def student(a):
    """Inside the distill-run job: student_only steps, then the same steps through distill.Steps."""
    import torch
    import torch.nn.functional as F

    import distill

    torch.set_num_threads(1)
    session = distill.init()
    sys.path.insert(0, os.path.join(ROOT, "examples", "python"))
    from gpt import GPT

    ctx, batch = int(session.trainer["context"]), int(session.trainer["batch"])
    layers, heads, dim = (int(session.trainer[k]) for k in ("student_layers", "student_heads", "student_dim"))
    torch.manual_seed(0)
    model = GPT(layers, heads, dim, ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, (batch, ctx + 1), generator=g) for _ in range(a.warmup + a.steps)]
    mbs = [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in data]
    only = []
    for i, (x, y) in enumerate(mbs):
        t0 = time.perf_counter()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
        if i >= a.warmup:
            only.append(time.perf_counter() - t0)
    times = []
    last = [time.perf_counter()]

    def on_step(r):
        now = time.perf_counter()
        if r["step"] > a.warmup:
            times.append(now - last[0])
        last[0] = now

    steps = distill.Steps(session, model, opt, on_step=on_step)
    last[0] = t_loop = time.perf_counter()
    for mb in steps.run(iter(mbs)):
        steps.backward(model(mb.inputs))
        if steps.step_ends():
            opt.step()
            opt.zero_grad()
    loop = (time.perf_counter() - t_loop) / len(mbs)
    tokens = batch * ctx
    with open(a.out, "w") as f:
        json.dump({"student_only": p50(only), "teacher_process": p50(times), "tokens": tokens, "loop_mean_ms": loop * 1e3,
                   "wait_s": session.teacher_wait_seconds()}, f)


def main():
    a = args_of(sys.argv[1:])
    if a.student_mode:
        return student(a)
    bin_dir = os.path.join(a.build, "bin")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.path.join(a.build, "python") + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # C++: bench_e2e's teacher job (it prints JSON lines; keep its two modes).
    out = subprocess.run([os.path.join(bin_dir, "bench_e2e"), "--config", a.config, "--jobs", "teacher",
                          "--steps", str(a.steps), "--warmup", str(a.warmup), "--rounds", "1"],
                         env=env, capture_output=True, text=True, check=True).stdout
    cpp = {}
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            if r.get("mode") in ("student_only", "teacher_process"):
                cpp[r["mode"]] = r["step_ms_p50"]
    # Python: the same teacher process (a registered C++ GPT with random weights of the demo's teacher size).
    with tempfile.TemporaryDirectory() as d:
        weights = os.path.join(d, "teacher.pt")
        subprocess.run([os.path.join(bin_dir, "distill-gpt"), "train-teacher", "--config", a.config,
                        "--set", "trainer.teacher_steps=1", "--set", f"trainer.teacher_weights={weights}",
                        "--set", f"run.log_dir={d}/logs", "--set", f"checkpoint.dir={d}/ckpt"],
                       env=env, check=True, capture_output=True)
        res = os.path.join(d, "python.json")
        sets = ["run.nproc_per_node=2", f"run.steps={a.warmup + a.steps}", f"run.log_dir={d}/run",
                'checkpoint.dir=""', "teacher.kind=registered", "teacher.module=gpt", "teacher.threads=1",
                f"teacher.weights={weights}", f"teacher.library={a.build}/lib/libdistill_gpt_teacher.so",
                "teacher.cache.mode=off"]
        cmd = [os.path.join(bin_dir, "distill-run"), "--config", a.config]
        for s in sets:
            cmd += ["--set", s]
        cmd += ["--", sys.executable, os.path.abspath(__file__), "--student-mode", "--out", res,
                "--steps", str(a.steps), "--warmup", str(a.warmup)]
        job = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=d)
        if job.returncode != 0 or os.environ.get("DISTILL_BENCH_VERBOSE"):
            sys.stderr.write(job.stdout[-4000:] + job.stderr[-4000:])
        job.check_returncode()
        py = json.load(open(res))
        if os.environ.get("DISTILL_BENCH_VERBOSE"):
            sys.stderr.write(json.dumps(py) + "\n")
    for lang, r in (("cpp", cpp), ("python", py)):
        print(json.dumps({"bench": "python_step", "student": lang, "student_only_ms_p50": round(r["student_only"], 3),
                          "teacher_process_ms_p50": round(r["teacher_process"], 3),
                          "teacher_process_vs_student_only": round(r["teacher_process"] / r["student_only"], 3)}))
    print(json.dumps({"bench": "python_step", "summary": "python vs cpp, same sizes, same teacher process",
                      "python_vs_cpp_student_only": round(py["student_only"] / cpp["student_only"], 3),
                      "python_vs_cpp_teacher_process": round(py["teacher_process"] / cpp["teacher_process"], 3),
                      "steps": a.steps}))


if __name__ == "__main__":
    main()
