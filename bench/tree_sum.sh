#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/tree_sum.sh LIST: one SHA-256 over the files named in LIST (NUL-separated paths, as
# `git ls-files -z` writes them), in LIST's order: each path and its contents ("missing" for a
# file that is not there). No git needed: bench/device_commit.sh writes it beside .device/commit
# here, and bench/device_run.sh compares it on the GPU machine with the tree it was given.
set -euo pipefail
while IFS= read -r -d '' f; do
    printf '%s\0' "$f"
    if [ -f "$f" ]; then sha256sum <"$f"; else echo missing; fi
done <"$1" | sha256sum | cut -d' ' -f1
