"""Students that end right after torch.distributed gloo collectives on tensors made in Python,
for tests/python/test_exit.py (the exit hazard: docs/python.md, "Ending a job"):

    distill-run --config JOB.yaml -- python3 exit_trainer.py [--count N]

Each student wraps a model in DistributedDataParallel (which keeps the group after
destroy_process_group), starts N asynchronous all-reduces of tensors made in Python on 2 gloo
worker threads, waits for them (all but --unwaited), drops them, destroys the group and ends:
the workers release the last ones (or run them) while the interpreter shuts down. DISTILL_EXIT_DRAIN=0 leaves the exit unguarded.
"""

import argparse

import torch

import distill


def main():
    session = distill.init()
    p = argparse.ArgumentParser()
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--unwaited", type=int, default=0, help="the last ones are not waited for")
    args = p.parse_args()
    torch.set_num_threads(1)
    if session.is_teacher:  # teacher.kind self: asked nothing
        distill.serve(session, torch.nn.Embedding(16, 16))
        return
    torch.distributed.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    works = [torch.distributed.all_reduce(torch.ones(64), async_op=True) for _ in range(args.count)]
    for w in works[: len(works) - args.unwaited]:
        w.wait()
    del works
    torch.distributed.destroy_process_group()
    session.finish()
    print(f"student {session.rank} ends with {type(model).__name__} alive", flush=True)


if __name__ == "__main__":
    main()
