#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# A rank dies in the middle of a run: checks that the survivors end, with a libmoe error.
# Usage: fault_peer_exit.sh MPIEXEC NP EXE [mpiexec flags...]   (ctest's TIMEOUT bounds it)
#
# 1. Open MPI's default error manager: mpirun notices the dead rank and kills the survivors
#    itself (Open MPI 4.1: within milliseconds, before they time out). Accepted: the job must
#    end, non-zero, with mpirun naming the dead rank, or with the survivors' lines of 2.
# 2. --enable-recovery: mpirun lets the survivors run on. Each of the NP - 1 survivors must
#    print "survivor rank R got MOE_STATUS_TIMEOUT" (or MPI_ERROR), then destroy its layer
#    and runtime ("cleaned up"); once with the dead rank calling _exit(0) and once with it
#    killed by SIGKILL. The survivors skip MPI_Finalize, which in Open MPI 4.1 sometimes waits
#    for the dead rank forever (see test_mpi_faults.c), so mpirun's exit code is not checked.
set -u
mpiexec=$1
np=$2
exe=$3
shift 3
out=$(mktemp)
trap 'rm -f "$out"' EXIT
fail=0
survivors=$((np - 1))

# run NAME MPIEXEC-FLAGS... -- PROGRAM-ARGS...: prints the output, leaves it in $out.
run() {
    name=$1
    shift
    start=$(date +%s)
    "$mpiexec" "$@" >"$out" 2>&1
    rc=$?
    echo "---- $name: mpirun exit code $rc after $(($(date +%s) - start)) s"
    sed 's/^/    /' "$out"
}

count() {
    grep -Ec "$1" "$out"
}

run "default error manager, _exit(0)" "$@" -np "$np" "$exe" --peer-exit exit
got=$(count '^survivor rank [0-9]+ got MOE_STATUS_(TIMEOUT|MPI_ERROR)')
if [ "$got" -eq "$survivors" ]; then
    echo "ok: the survivors returned an error status"
elif [ "$rc" -ne 0 ] && grep -q 'exiting improperly\|exited on signal' "$out"; then
    echo "ok: mpirun reported the dead rank and ended the job (survivors killed by mpirun)"
else
    echo "FAIL: neither $survivors survivor statuses nor mpirun's report of the dead rank"
    fail=1
fi

for how in exit kill; do
    run "--enable-recovery, $how" "$@" --enable-recovery -np "$np" "$exe" --peer-exit "$how"
    got=$(count '^survivor rank [0-9]+ got MOE_STATUS_(TIMEOUT|MPI_ERROR)')
    fin=$(count '^survivor rank [0-9]+ cleaned up')
    if [ "$got" -ne "$survivors" ] || [ "$fin" -ne "$survivors" ]; then
        echo "FAIL: $got of $survivors survivors reported an error status, $fin cleaned up"
        fail=1
    else
        echo "ok: $got survivors got an error status and cleaned up"
    fi
done
exit $fail
