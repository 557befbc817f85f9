#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/device_commit.sh: writes this checkout's commit (12 hex digits, "-dirty" when tracked
# files differ from it) to .device/commit, which bench/device_run.sh hands to moe-bench as
# MOE_BENCH_COMMIT, so --json records the tree that is carried to the GPU machine: the copy there
# may hold a .git that is not this checkout's (2026-12-03: a run of c1ea904's tree recorded
# 69db5af). Run it here, before each call that measures; a tree changed since is recorded as
# "unknown" there, not as this commit.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
commit=$(git -C "$root" rev-parse --short=12 HEAD)
[ -z "$(git -C "$root" status --porcelain --untracked-files=no)" ] || commit="$commit-dirty"
mkdir -p "$root/.device"
echo "$commit" >"$root/.device/commit"
# the tracked files' contents as they are now (bench/tree_sum.sh, on both machines): the GPU
# machine's bench/device_run.sh compares, so a commit file left from an earlier tree is not
# recorded as this one's (2026-12-05: a run of d9f1c2c's tree recorded bf2adc5)
git -C "$root" ls-files -z >"$root/.device/commit.files"
(cd "$root" && bash bench/tree_sum.sh .device/commit.files) >"$root/.device/commit.sum"
echo "device commit: $commit"
