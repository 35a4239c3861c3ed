#!/usr/bin/env bash
# gpu_check_script_test: cmake/gpu-check.sh refuses bad arguments (exit 2) and,
# with no GPU visible, says so, records it and builds nothing (exit 3).
set -u
repo=$1
script=$repo/cmake/gpu-check.sh
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
expect_rc() {  # expect_rc RC WHAT ARGS...
  local want=$1 what=$2; shift 2
  bash "$script" "$@" > "$out/stdout" 2> "$out/stderr"
  local rc=$?
  [ "$rc" = "$want" ] || { cat "$out/stderr" >&2; fail "$what: exit $rc, expected $want"; }
}
expect_rc 2 "no OUT_DIR"
grep -q "usage:" "$out/stderr" || fail "no OUT_DIR: no usage line"
expect_rc 2 "unknown step" "$out/r" --steps build,tset
grep -q "unknown step 'tset'" "$out/stderr" || fail "unknown step not named"
expect_rc 2 "bad --jobs" "$out/r" --jobs zero
grep -q "positive number, got 'zero'" "$out/stderr" || fail "bad --jobs not named"
expect_rc 2 "unknown argument" "$out/r" --fast
grep -q "unknown argument '--fast'" "$out/stderr" || fail "unknown argument not named"
expect_rc 2 "option as OUT_DIR" --steps build
if nvidia-smi -L 2>/dev/null | grep -q GPU; then
  echo "a GPU is visible: the no-GPU case does not apply here"
  exit 77
fi
expect_rc 3 "no GPU" "$out/r"
grep -q "no GPU visible" "$out/stderr" || fail "no GPU: message missing"
grep -q '"step":"gpu","ok":false' "$out/r/results.jsonl" || fail "no GPU: results.jsonl lacks the record"
# Issue 42's set is a name of its own, not a step to mix with others.
expect_rc 3 "issue42 set, no GPU" "$out/r" --steps issue42
expect_rc 2 "issue42 among steps" "$out/r" --steps build,issue42
grep -q "unknown step 'issue42'" "$out/stderr" || fail "issue42 among steps: not named"
echo "gpu-check.sh: arguments and the no-GPU case as documented"
