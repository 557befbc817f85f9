#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# mpirun -np N bash bench/shared_gpu_rank.sh PROGRAM ARGS...: PROGRAM as one of N ranks that
# share one GPU, with NCCL usable. NCCL refuses two ranks on one GPU of one host, so each rank
# gets its own NCCL_HOSTID: NCCL then takes the ranks for hosts and joins them with its socket
# transport over loopback. For correctness runs and smoke benches on a one-GPU machine: what
# NCCL moves here goes through host sockets, so its times say nothing of NVLink or of a NIC.
# (The GPU tests do the same themselves under MOE_TEST_SHARED_GPU=1: tests/common/gpu_mpi.h.)
rank=${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-${SLURM_PROCID:-0}}}
export NCCL_HOSTID=moe-shared-gpu-rank-$rank
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-1}
exec "$@"
