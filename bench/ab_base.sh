#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/ab_base.sh [REV]: the tree of REV (default HEAD) into .device/ab-base/, the baseline
# side of `bash bench/device_run.sh ab` (an A/B of the working tree against REV in one call on
# the GPU machine; .device is what the calls carry there). Run it here, before the call.
set -euo pipefail
rev=${1:-HEAD}
root=$(git rev-parse --show-toplevel)
dst=$root/.device/ab-base
short=$(git -C "$root" rev-parse --short "$rev")
rm -rf "$dst"
mkdir -p "$dst"
git -C "$root" archive "$rev" | tar -x -C "$dst"
echo "$short" >"$dst/.ab-rev"
echo "ab-base: $short in $dst ($(du -sh "$dst" | cut -f1))"
