"""The held-out losses of a signal sweep as one JSON line (examples/llm/signals.sh, examples/gpt/signals.sh).

    python3 bench/signals_summary.py OUT BENCH COMMIT

Reads OUT/teacher.json ({"val_loss": ...}) and OUT/results/<signal>-s<seed>.json ({"val_loss": ...}, on-policy
runs also "sample_teacher_ll_before" and "sample_teacher_ll"), and the bytes per token on the ring from the
launcher's "slots:" line in OUT/results/<signal>-s<seed>.log. "gap_closed" is (label - distilled) /
(label - teacher) per seed, then averaged. Prints the line and writes OUT/signals.json.
"""
import glob
import json
import os
import re
import statistics
import sys


def ring_bytes(out: str, sig: str) -> int:
    if sig == "onpolicy_token":  # ids answers of one id: a float32 logit, logsumexp and log tail
        return 12
    logs = sorted(glob.glob(f"{out}/results/{sig}-s*.log"))
    m = re.search(r"\(auto; [^)]*?(\d+) B/token", open(logs[0]).read().split("response", 1)[-1]) if logs else None
    return int(m.group(1)) if m else 0


def main(out: str, bench: str, commit: str) -> None:
    teacher = json.load(open(f"{out}/teacher.json"))["val_loss"]
    rows, lls = {}, {}
    for f in sorted(glob.glob(f"{out}/results/*-s*.json")):
        sig, seed = re.match(r"(.*)-s(\d+)\.json", os.path.basename(f)).groups()
        r = json.load(open(f))
        rows.setdefault(sig, {})[int(seed)] = r["val_loss"]
        if "sample_teacher_ll_before" in r:
            lls.setdefault(sig, {})[int(seed)] = [r["sample_teacher_ll_before"], r["sample_teacher_ll"]]
    res = {"bench": bench, "teacher_val_loss": teacher, "commit": commit, "signals": {}}
    label = rows.get("label", {})
    for sig, by in rows.items():
        gap = [(label[s] - v) / (label[s] - teacher) for s, v in by.items() if s in label and sig != "label"]
        res["signals"][sig] = {"val_loss": by, "mean": statistics.mean(by.values()),
                               "ring_bytes_per_token": ring_bytes(out, sig),
                               "gap_closed": statistics.mean(gap) if gap else None}
        if sig in lls:  # on-policy: the teacher's log-likelihood of the student's samples, [before, after]
            res["signals"][sig]["sample_teacher_ll"] = lls[sig]
    print(json.dumps(res))
    json.dump(res, open(f"{out}/signals.json", "w"))


if __name__ == "__main__":
    main(*sys.argv[1:4])
