#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Starts a real one-node Slurm (munged, slurmctld, slurmd on 127.0.0.1, all state in a temp
# folder), submits launch/slurm/moe-run.sbatch running moe-run with 2 ranks on the CPU backend,
# waits for the job (bounded) and checks its output holds moe-run's checksum line.
#   test_slurm.sh MOE_RUN SBATCH_SCRIPT
# Installs slurm-wlm and munge with apt-get when they are missing and this runs as root.
# Exit 77 (skip) only where Slurm cannot be installed or started here; the reason is printed.
set -uo pipefail

moe_run=$(readlink -f "$1")
sbatch_script=$(readlink -f "$2")
ntasks=${MOE_SLURM_NTASKS:-2}
skip() { echo "SKIP: $*"; exit 77; }

[ -x "$moe_run" ] || { echo "FAIL: $moe_run is not executable"; exit 1; }
[ "$(id -u)" = 0 ] || skip "a test Slurm needs root (slurmd runs jobs as their users)"

# ---- Slurm and munge -------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null ||
    ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    command -v apt-get >/dev/null || skip "slurm-wlm/munge missing and no apt-get to install them"
    echo "installing slurm-wlm and munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    if ! timeout 600 apt-get install -y -q slurm-wlm munge >/tmp/moe-slurm-apt.log 2>&1; then
        timeout 300 apt-get update -q >>/tmp/moe-slurm-apt.log 2>&1
        timeout 600 apt-get install -y -q slurm-wlm munge >>/tmp/moe-slurm-apt.log 2>&1 ||
            { tail -5 /tmp/moe-slurm-apt.log; skip "apt-get install slurm-wlm munge failed"; }
    fi
fi

tmp=$(mktemp -d /tmp/moe-slurm-XXXXXX)
chmod 755 "$tmp"
mkdir -p "$tmp/munge" "$tmp/state" "$tmp/spool"
chmod 700 "$tmp/munge"

stop_daemons() {
    # Only the daemons started here, by the pids they wrote.
    if [ -n "${SLURM_CONF:-}" ] && [ -n "${job:-}" ]; then scancel "$job" 2>/dev/null; fi
    for p in "$tmp/slurmd.pid" "$tmp/slurmctld.pid" "$tmp/munge/munged.pid"; do
        [ -s "$p" ] && kill "$(cat "$p")" 2>/dev/null
    done
    for p in "$tmp/slurmd.pid" "$tmp/slurmctld.pid" "$tmp/munge/munged.pid"; do
        for _ in $(seq 50); do
            [ -s "$p" ] && kill -0 "$(cat "$p")" 2>/dev/null || break
            sleep 0.1
        done
    done
    rm -rf "$tmp"
}
trap stop_daemons EXIT

dump_logs() {
    for f in "$tmp"/slurmctld.log "$tmp"/slurmd.log "$tmp"/munge/munged.log "$tmp"/job-*.out; do
        [ -f "$f" ] && { echo "---- $f (last 30 lines)"; tail -30 "$f"; }
    done
}
fail() { echo "FAIL: $*"; dump_logs; exit 1; }

# A private munged (own key, socket and pid file) so that a system one is left alone.
dd if=/dev/urandom of="$tmp/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$tmp/munge/munge.key"
sock="$tmp/munge/munge.socket"
munged --force --socket="$sock" --key-file="$tmp/munge/munge.key" \
    --pid-file="$tmp/munge/munged.pid" --log-file="$tmp/munge/munged.log" \
    --seed-file="$tmp/munge/munged.seed" >"$tmp/munge/start.log" 2>&1 ||
    { cat "$tmp/munge/start.log"; skip "munged does not start here"; }
munge -S "$sock" -n | unmunge -S "$sock" >/dev/null 2>&1 || skip "munge credentials do not work"

# ---- slurm.conf: one node on the loopback address, no cgroups, no systemd --------------------
host=$(hostname -s)
cpus=$(nproc)
[ "$cpus" -ge "$ntasks" ] || cpus=$ntasks
mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
port=$((20000 + RANDOM % 20000))
cat >"$tmp/slurm.conf" <<CONF
ClusterName=moetest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$sock
CredType=cred/munge
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/slurmctld.log
SlurmdLogFile=$tmp/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=moetest Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF="$tmp/slurm.conf"

slurmctld -f "$SLURM_CONF" >"$tmp/slurmctld.start" 2>&1 ||
    { cat "$tmp/slurmctld.start"; dump_logs; skip "slurmctld does not start here"; }
slurmd -f "$SLURM_CONF" -N "$host" >"$tmp/slurmd.start" 2>&1 ||
    { cat "$tmp/slurmd.start"; dump_logs; skip "slurmd does not start here"; }

state=""
for _ in $(seq 60); do
    state=$(sinfo -h -n "$host" -o %t 2>/dev/null | head -1)
    [ "$state" = idle ] && break
    sleep 1
done
[ "$state" = idle ] || { dump_logs; skip "the Slurm node did not become idle (state '$state')"; }
echo "slurm: node $host idle (slurmctld port $port)"

# ---- the jobs: the sbatch script with mpirun inside the allocation, and with srun + PMIx -----
run_job() { # LAUNCHER
    local launcher=$1 info out i
    job=$(cd "$tmp" && sbatch --parsable -n "$ntasks" -o "$tmp/job-%j.out" -t 10 \
        --export=ALL,MOE_RUN="$moe_run",MOE_LAUNCHER="$launcher" \
        "$sbatch_script" --backend cpu --preset tiny --tokens 64) || fail "sbatch refused the job"
    job=${job%%;*}
    echo "slurm: submitted job $job (MOE_LAUNCHER=$launcher)"
    for i in $(seq 300); do
        [ -z "$(squeue -h -j "$job" 2>/dev/null)" ] && break
        [ "$i" = 300 ] && fail "job $job still queued or running after 300 s"
        sleep 1
    done
    info=$(scontrol show job "$job" 2>/dev/null)
    out="$tmp/job-$job.out"
    echo "---- job $job output"
    cat "$out" 2>/dev/null
    echo "----"
    grep -q 'JobState=COMPLETED' <<<"$info" ||
        fail "job $job did not complete: $(echo "$info" | grep -o 'JobState=[A-Z_]*')"
    grep -q "^checksum " "$out" || fail "no checksum line in the output of job $job"
    grep -q "$ntasks rank(s)" "$out" || fail "moe-run did not run with $ntasks ranks in job $job"
    grep -q "launcher $launcher" "$out" || fail "job $job did not use launcher $launcher"
    echo "ok: moe-run.sbatch (MOE_LAUNCHER=$launcher) ran moe-run on $ntasks ranks"
}

# A rank killed mid-run: every survivor prints its libmoe status, the job ends and fails.
run_fault_job() { # LAUNCHER
    local launcher=$1 info out i marker=$((50000 + RANDOM)) pids victim n
    job=$(cd "$tmp" && sbatch --parsable -n "$ntasks" -o "$tmp/job-%j.out" -t 10 \
        --export=ALL,MOE_RUN="$moe_run",MOE_LAUNCHER="$launcher",MOE_TIMEOUT_MS=3000 \
        "$sbatch_script" --backend cpu --preset tiny --tokens 8 --iters 1000000 --warmup 0 \
        --seed "$marker") || fail "sbatch refused the fault job"
    job=${job%%;*}
    echo "slurm: submitted fault job $job (MOE_LAUNCHER=$launcher)"
    for i in $(seq 120); do # the ranks running their steps
        pids=$(pgrep -f -- "--seed $marker" | while read -r p; do
            [ "$(cat /proc/"$p"/comm 2>/dev/null)" = moe-run ] && echo "$p"; done)
        [ "$(echo "$pids" | grep -c .)" -eq "$ntasks" ] && break
        sleep 0.5
    done
    sleep 3
    victim=$(echo "$pids" | tail -1)
    [ -n "$victim" ] || fail "fault job $job: no moe-run rank found"
    kill -KILL "$victim"
    for i in $(seq 120); do
        [ -z "$(squeue -h -j "$job" 2>/dev/null)" ] && break
        [ "$i" = 120 ] && fail "fault job $job still running 120 s after the kill"
        sleep 1
    done
    info=$(scontrol show job "$job" 2>/dev/null)
    out="$tmp/job-$job.out"
    echo "---- fault job $job output"
    grep -v '^#' "$out" 2>/dev/null | tail -20
    echo "----"
    grep -q 'JobState=COMPLETED' <<<"$info" && fail "fault job $job ended COMPLETED (exit 0)"
    n=$(grep -cE '^moe-run: rank [0-9]+: .*MOE_STATUS_(TIMEOUT|MPI_ERROR)' "$out")
    grep -qE '^moe-run.sbatch: rank [0-9]+: exit status 137' "$out" ||
        fail "fault job $job: no summary line for the killed rank"
    # srun: Slurm's PMIx plugin cancels the step when a rank dies (the survivors may go first)
    [ "$launcher" = srun ] || [ "$n" -ge $((ntasks - 1)) ] ||
        fail "fault job $job: $n of $((ntasks - 1)) survivors printed their status"
    echo "ok: moe-run.sbatch (MOE_LAUNCHER=$launcher): a rank killed, $n survivor(s) reported," \
        "the job failed ($(echo "$info" | grep -o 'ExitCode=[0-9:]*'))"
}

launchers=${MOE_LAUNCHER:-mpirun srun}
if [ -z "${MOE_LAUNCHER:-}" ] && ! grep -q pmix <<<"$(srun --mpi=list 2>&1)"; then
    echo "note: this Slurm has no mpi/pmix plugin: only the mpirun launcher is tested"
    launchers=mpirun
fi
for l in $launchers; do
    run_job "$l"
    run_fault_job "$l"
done
echo "PASS: Slurm ran launch/slurm/moe-run.sbatch (${launchers// /, })"
