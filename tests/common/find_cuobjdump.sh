# shellcheck shell=bash
# SPDX-License-Identifier: Apache-2.0
# Sourced by the device-code tests (tests/build): find_cuobjdump [CUDA_BIN] prints the
# cuobjdump to use ($MOE_CUOBJDUMP, PATH, CUDA_BIN/cuobjdump, then pip's nvidia-cuda-cuobjdump
# in python3's site-packages), or nothing.
find_cuobjdump() {
    local c=${MOE_CUOBJDUMP:-} site
    [ -n "$c" ] || c=$(command -v cuobjdump || true)
    if [ -z "$c" ] && [ -n "${1:-}" ] && [ -x "$1/cuobjdump" ]; then
        c=$1/cuobjdump
    fi
    if [ -z "$c" ] && command -v python3 >/dev/null; then
        site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)
        for x in "$site"/nvidia/*/bin/cuobjdump; do
            [ -x "$x" ] && c=$x && break
        done
    fi
    echo "$c"
}
