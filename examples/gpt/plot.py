#!/usr/bin/env python3
"""The demo's plot: validation loss against step of the distilled and the
label-only student, the teacher's final validation loss as a dashed line.

    python3 examples/gpt/plot.py LOG_DIR    (distill-gpt report runs it)

Reads LOG_DIR/{teacher,label_only,distilled}/metrics.jsonl and done.json (the
files distill-gpt writes; distilled_cached/metrics.jsonl too when it exists) and writes LOG_DIR/val_loss.png (900 x 560 pixels),
replacing it atomically. Exit status 1 with a message naming the file when one
is missing or unreadable.
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"plot.py: cannot read {path}: {e}")


def val_curve(path):
    """(steps, losses): the validation records, the last one written per step."""
    by_step = {}
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    sys.exit(f"plot.py: {path}:{n}: {e}")
                if rec.get("val_loss") is not None:
                    by_step[rec["step"]] = rec["val_loss"]
    except OSError as e:
        sys.exit(f"plot.py: cannot read {path}: {e}")
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: plot.py LOG_DIR")
    log_dir = sys.argv[1]
    teacher = read_json(os.path.join(log_dir, "teacher", "done.json"))
    steps = read_json(os.path.join(log_dir, "distilled", "done.json"))["steps"]

    fig, ax = plt.subplots(figsize=(9, 5.6), dpi=100)
    for phase, label, color in (("distilled", "distilled student", "tab:blue"),
                                ("label_only", "label-only student", "tab:orange")):
        x, y = val_curve(os.path.join(log_dir, phase, "metrics.jsonl"))
        ax.plot(x, y, marker="o", markersize=3, color=color, label=label)
    cached = os.path.join(log_dir, "distilled_cached", "metrics.jsonl")
    if os.path.exists(cached):
        x, y = val_curve(cached)
        ax.plot(x, y, marker="o", markersize=3, color="tab:green",
                label="2nd distilled student, teacher from the cache")
    ax.axhline(teacher["val_loss"], linestyle="--", color="0.35",
               label=f"teacher ({teacher['val_loss']:.4f})")
    ax.set_title(f"validation loss, {steps} steps, same data and seed")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()

    out = os.path.join(log_dir, "val_loss.png")
    tmp = out + ".tmp"
    fig.savefig(tmp, format="png")
    os.replace(tmp, out)


if __name__ == "__main__":
    main()
