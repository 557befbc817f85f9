# shellcheck shell=bash
# SPDX-License-Identifier: Apache-2.0
# Sourced by the moe-bench CLI tests: MPI as root on this host, the CPU backend, a temporary
# folder $tmp (removed on exit) and check WHAT CONDITION... (one verdict line; a miss sets fail=1).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 MOE_BACKEND=cpu
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl=self,vader,tcp
tmp=$(mktemp -d "${TMPDIR:-/tmp}/moe-bench-cli-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# shellcheck source=../common/check.sh
. "$(dirname "${BASH_SOURCE[0]}")/../common/check.sh"
