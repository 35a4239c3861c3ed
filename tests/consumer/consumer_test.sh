#!/usr/bin/env bash
# Installs distill from the build tree into a temporary prefix, then configures,
# builds and runs a tiny outside project that uses find_package(distill).
# The installed package must find torch when the consumer configures, never at
# a path of the build machine: the package files may not name the build's
# torch, and a Torch_DIR the consumer gives (here: torch seen through another
# path) is the one used.
set -euo pipefail
build=$1 src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
pkg="$work/prefix/lib/cmake/distill"

# 1. No absolute path of the build's torch in the package files.
torch_dir=$(sed -n 's/^Torch_DIR:[A-Z]*=//p' "$build/CMakeCache.txt")
torch_root=${torch_dir%/share/cmake/Torch}
[ -n "$torch_dir" ] && [ -d "$torch_root" ] || { echo "no Torch_DIR in $build/CMakeCache.txt"; exit 1; }
if grep -rnF "$torch_root" "$pkg"; then
  echo "FAIL: the installed package names the build machine's torch ($torch_root): a consumer elsewhere cannot use it"
  exit 1
fi

# 1b. Internal headers stay internal: the segment layout (ipc/src/wire.h) is not installed,
#     and every distill header an installed header includes is installed too.
inc="$work/prefix/include"
if [ -n "$(find "$inc" -name wire.h)" ]; then
  echo "FAIL: the internal segment layout header is installed: $(find "$inc" -name wire.h)"
  exit 1
fi
for h in $(grep -rhoE '^#include "distill/[^"]+"' "$inc" | sed -E 's/^#include "(.*)"/\1/' | sort -u); do
  [ -f "$inc/$h" ] || { echo "FAIL: an installed header includes $h, which is not installed"; exit 1; }
done
# Only the headers distill/distill.h reaches (cmake/DistillInstall.cmake) are installed: not the
# segment's or the launcher's, not sys.h.
[ -f "$inc/distill/distill.h" ] && [ -f "$inc/distill/train/steps.h" ] || { echo "FAIL: distill/distill.h or what it includes is not installed"; exit 1; }
for h in distill/ipc/segment.h distill/ipc/hang_report.h distill/core/sys.h distill/group/rendezvous.h; do
  [ ! -f "$inc/$h" ] || { echo "FAIL: $h is installed, but distill/distill.h does not reach it"; exit 1; }
done

# 2. The consumer's own Torch_DIR wins: torch through a symlinked root.
ln -s "$torch_root" "$work/torch"
cmake -S "$src/tests/consumer/project" -B "$work/build-own-torch" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
      -DTorch_DIR="$work/torch/share/cmake/Torch" >"$work/configure-own.log" 2>&1 || { cat "$work/configure-own.log"; exit 1; }
used=$(sed -n 's/^Torch_DIR:[A-Z]*=//p' "$work/build-own-torch/CMakeCache.txt")
if [ "$used" != "$work/torch/share/cmake/Torch" ]; then
  echo "FAIL: the consumer set Torch_DIR=$work/torch/share/cmake/Torch, the package used '$used'"
  exit 1
fi

# 3. Versions: the package is the version CMakeLists.txt's project() states; a request for
#    another minor (before 1.0, incompatible: CHANGELOG.md) is refused, its own is taken.
version=$(sed -n 's/^set(PACKAGE_VERSION "\(.*\)")$/\1/p' "$pkg/distillConfigVersion.cmake")
stated=$(sed -n 's/^project(distill VERSION \([0-9.]*\) .*/\1/p' "$src/CMakeLists.txt")
[ -n "$version" ] && [ "$version" = "$stated" ] || { echo "FAIL: package version '$version', CMakeLists.txt says '$stated'"; exit 1; }
major=${version%%.*} rest=${version#*.} minor=${rest%%.*}
bad_requests="$major.$((minor + 1))"
[ "$minor" -gt 0 ] && bad_requests="$major.$((minor - 1)) $bad_requests"
for bad in $bad_requests; do
  if cmake -S "$src/tests/consumer/project" -B "$work/build-$bad" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" \
        -DDISTILL_REQUEST="$bad" >"$work/configure-$bad.log" 2>&1; then
    echo "FAIL: find_package(distill $bad) accepted distill $version"; exit 1
  fi
  grep -q "requested version \"$bad\"" "$work/configure-$bad.log" ||
    { echo "FAIL: find_package(distill $bad) failed for another reason:"; cat "$work/configure-$bad.log"; exit 1; }
done
echo "find_package(distill X.Y) for X.Y in $bad_requests: refused by distill $version"

# 4. Without a Torch_DIR, torch is found through python3 at configure time; build and run
#    (asking for the package's own major.minor).
cmake -S "$src/tests/consumer/project" -B "$work/build" -G Ninja -DDISTILL_REQUEST="$major.$minor" \
      -DCMAKE_PREFIX_PATH="$work/prefix" >"$work/configure.log" 2>&1 || { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
"$work/build/consumer"

# 5. Issue 39 item 4: under torchrun the teacher's slot runs the distill-teacher of the install the
#    trainer loaded (found beside its library), not the build tree's; the log says which. Its
#    teacher file is missing, so the job ends at once: only the choice is checked here.
printf 'run:\n  startup_timeout_s: 20\nteacher:\n  kind: torchscript\n  path: %s/missing.pt\n' "$work" >"$work/job.yaml"
DISTILL_TEACHER_BIN= DISTILL_CONFIG="$work/job.yaml" OMP_NUM_THREADS=1 timeout 120 \
  python3 -m torch.distributed.run --standalone --nproc-per-node 2 --no-python "$work/build/consumer" --trainer \
  >"$work/torchrun.log" 2>&1 || true
want="runs $work/prefix/bin/distill-teacher (beside the loaded distill library $work/prefix/lib"
grep -qF "$want" "$work/torchrun.log" || { echo "FAIL: the teacher's slot did not say '$want':"; cat "$work/torchrun.log"; exit 1; }
echo "torchrun: the teacher's slot ran $work/prefix/bin/distill-teacher"
# 6. Both programs print the installed library's version.
for p in distill-run distill-teacher; do
  got=$("$work/prefix/bin/$p" --version 2>&1) || got="(exit $?) $got"
  [ "$got" = "$p $version" ] || { echo "FAIL: $p --version printed '$got', not '$p $version'"; exit 1; }
done
echo "distill-run and distill-teacher --version: $version"
