# SPDX-License-Identifier: Apache-2.0
"""The examples run and say what they should (CPU backend, one process)."""
import os
import subprocess
import sys

import pytest

import libmoe

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def run(script, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM", "PMIX_"))}
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(libmoe.__file__)))
    env["PYTHONPATH"] = pkg + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.parametrize("family,dtype", [("qwen3_moe", "f32"), ("deepseek_v3", "bf16")])
def test_generate(family, dtype):
    r = run("generate.py", "--family", family, "--dtype", dtype, "--new-tokens", "8")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "same tokens: yes" in r.stdout


def test_fused_experts():
    for extra in ([], ["--fp8"]):
        r = run("fused_experts.py", *extra)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "rel. difference from the torch loop" in r.stdout
