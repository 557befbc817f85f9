#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# ctest's python.* tests: pytest over python/tests with the interpreter that has torch and
# transformers (launch/dev.sh test puts them into <build>/pyenv). Skips (77) when that
# interpreter lacks them, unless MOE_REQUIRE_TORCH=1 (CI), which makes it a failure; pytest's
# "no tests ran" (5) is a failure too.
#   run_pytest.sh PYTHON SOURCE_DIR LIBMOE_SO [NP] [pytest args...]   (NP > 0: under mpirun)
set -u
py=$1 src=$2 lib=$3 np=${4:-0}
shift 4 || shift $#
if ! "$py" -c "import torch, transformers, pytest" 2>/dev/null; then
    echo "$py lacks torch, transformers or pytest (./launch/dev.sh test installs them)" >&2
    [ "${MOE_REQUIRE_TORCH:-0}" != 0 ] && exit 1
    exit 77
fi
export LIBMOE_LIBRARY=$lib PYTHONPATH=$src/python${PYTHONPATH:+:$PYTHONPATH}
export PYTHONDONTWRITEBYTECODE=1
cd "$src/python"
if [ "$np" -gt 0 ]; then
    # -x: a rank whose test fails stops, so its peers stop at their next collective's timeout
    mpirun --oversubscribe --allow-run-as-root --bind-to none -np "$np" \
        "$py" -m pytest -q -x -p no:cacheprovider "$@"
else
    "$py" -m pytest -q -p no:cacheprovider "$@"
fi
rc=$?
[ $rc -eq 5 ] && { echo "pytest ran no test" >&2; exit 1; }
exit $rc
