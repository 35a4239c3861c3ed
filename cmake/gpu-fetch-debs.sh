#!/usr/bin/env bash
# Fetches the Debian packages the build needs into .debs/ (ignored by git), for
# a GPU machine that cannot reach a package registry: the device tool carries
# .debs/ there and cmake/gpu-check.sh unpacks them with dpkg -x into .deps/root
# (never into /). Run here, on a machine with apt:
#   bash cmake/gpu-fetch-debs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# The -dev packages of cmake/distill.sh that a CUDA image lacks, with the
# runtime libraries their .so links point at.
pkgs=(libboost1.74-dev libyaml-cpp-dev libyaml-cpp0.7 libgloo-dev nlohmann-json3-dev libssl-dev libssl3
      libgtest-dev libgmock-dev googletest liblmdb-dev liblmdb0 libcli11-dev)
mkdir -p .debs
grep -qx '/.debs/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.debs/' >> .git/info/exclude; }
cd .debs
rm -f ./*.deb
apt-get download "${pkgs[@]}"
echo "== .debs: $(ls ./*.deb | wc -l) packages, $(du -sh . | cut -f1)"
