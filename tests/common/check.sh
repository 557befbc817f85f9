# shellcheck shell=bash
# SPDX-License-Identifier: Apache-2.0
# Sourced by shell tests: check WHAT CONDITION... runs CONDITION and prints one verdict line
# ("ok: WHAT" or "FAIL: WHAT"); a miss sets fail=1 (starts at 0).
fail=0

check() {
    local what=$1
    shift
    if "$@"; then
        echo "ok: $what"
    else
        echo "FAIL: $what"
        fail=1
    fi
}
