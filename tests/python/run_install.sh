#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# python.install: `pip install ./python` (pure Python, nothing compiled) into a scratch folder
# works, and the installed package finds the library in the build tree (LIBMOE_BUILD_DIR) and
# runs a layer.   run_install.sh PYTHON SOURCE_DIR BUILD_DIR
set -eu
py=$1 src=$2 build=$3
"$py" -c "import torch, setuptools" 2>/dev/null || {
    echo "$py lacks torch or setuptools" >&2
    [ "${MOE_REQUIRE_TORCH:-0}" != 0 ] && exit 1
    exit 77
}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r "$src/python" "$tmp/src" # pip builds in the source folder: keep the tree clean
"$py" -m pip install -q --no-deps --no-build-isolation --target "$tmp/site" "$tmp/src"
cd "$tmp"
env -u LIBMOE_LIBRARY PYTHONPATH="$tmp/site" LIBMOE_BUILD_DIR="$build" "$py" -c '
import os, torch, libmoe
assert libmoe.__file__.startswith(os.environ["PYTHONPATH"]), libmoe.__file__
print("libmoe from", libmoe.__file__, "library", libmoe.library_path())
with libmoe.Runtime(backend="cpu") as rt:
    layer = libmoe.MoELayer(rt, num_experts=2, top_k=1, hidden=8, intermediate=8,
                            dtype=torch.float32, max_tokens_per_rank=4)
    for e in range(2):
        for k in ("gate_proj", "up_proj", "down_proj"):
            layer.set_weight(k, e, torch.ones(8, 8))
    y = layer(torch.ones(2, 8), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1))
    assert torch.isfinite(y).all()
print("pip install ./python: ok")
'
