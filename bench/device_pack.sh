#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# bench/device_pack.sh [TARGET...]: builds the targets here (build/, `cmake --preset dev`: the
# kernels carry sm_90a code, nvcc 13.0 as on the GPU machine) and packs stripped copies under their
# build-relative paths into .device/prebuilt.txz, with the commit (bench/device_commit.sh).
# `PREBUILT=1 bash bench/device_run.sh MODE` (carry .device) then unpacks them into build-gpu/
# instead of configuring and building there: the device build costs 110-180 s of a call's device
# time, the upload of a few compressed binaries seconds. For the modes that run binaries directly
# (vs, knob, trace, kernels with moe-run packed, a test binary); not for ctest's modes (tests,
# quick: no CTest files) or ab (it builds the base). Default targets: moe-bench decode_trace
# test_gpu_decode.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
targets=${*:-moe-bench decode_trace test_gpu_decode}
# shellcheck disable=SC2086 # $targets: target names
ninja -C build $targets >/dev/null
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for t in $targets; do
    f=$(find build -type f -name "$t" -perm -u+x -not -path "*/CMakeFiles/*" | head -1)
    [ -n "$f" ] || { echo "device_pack: no binary for target $t" >&2; exit 1; }
    rel=${f#build/}
    mkdir -p "$tmp/$(dirname "$rel")"
    cp "$f" "$tmp/$rel"
    strip "$tmp/$rel"
    echo "packed $rel"
done
mkdir -p .device
tar cJf .device/prebuilt.txz -C "$tmp" .
bash bench/device_commit.sh
ls -l .device/prebuilt.txz
