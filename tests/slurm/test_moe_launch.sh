#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# launch/moe-launch starts moe-run on this node: its mpirun command line for each binding mode,
# and a real 2-rank CPU-backend run that prints the checksum line.
#   test_moe_launch.sh MOE_LAUNCH MOE_RUN
set -uo pipefail

launch=$1
moe_run=$2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
command -v mpirun >/dev/null || { echo "SKIP: mpirun not found"; exit 77; }
fail=0
expect() { # WHAT COMMAND_OUTPUT PATTERN
    # a here-string, not echo | grep -q: under pipefail grep -q's early exit can SIGPIPE echo
    if grep -qE -- "$3" <<<"$2"; then echo "ok: $1"; else echo "FAIL: $1: '$2' lacks /$3/"; fail=1; fi
}

out=$("$launch" --dry-run --np 4 --exe "$moe_run" -- --preset tiny)
expect "gpu binding: mpirun leaves ranks unbound, moe-run --bind" "$out" \
    "^mpirun -np 4 --bind-to none .*moe-run --bind --preset tiny"
out=$("$launch" --dry-run --np 2 --bind numa --exe "$moe_run" --preset tiny)
expect "numa binding" "$out" "--map-by numa --bind-to numa .*moe-run --preset tiny"
out=$(MOE_DEBUG=INFO "$launch" --dry-run --np 2 --bind core --exe "$moe_run")
expect "core binding, MOE_* exported" "$out" "--map-by core --bind-to core .*-x MOE_DEBUG"
out=$("$launch" --np 0 --exe "$moe_run" 2>&1)
expect "--np 0 refused" "$out" "need a positive integer"
out=$("$launch" --bind sideways --exe "$moe_run" 2>&1)
expect "bad --bind refused" "$out" "use gpu, numa, core or none"

out=$(timeout 300 "$launch" --np 2 --exe "$moe_run" -- --backend cpu --preset tiny --tokens 64 2>&1)
expect "2 ranks ran" "$out" "2 rank\\(s\\)"
expect "checksum printed" "$out" "^checksum "
exit $fail
