# SPDX-License-Identifier: Apache-2.0
"""libmoe for PyTorch: a ctypes binding of libmoe.so (nothing compiled at import).

Runtime and MoELayer mirror the C API; fused_experts takes vLLM's layout; from_hf and patch put
transformers MoE blocks on libmoe. See the repository's README, section "Python"."""
from ._lib import MoEError, library_path
from .core import MoELayer, Runtime, default_runtime
from .fused import clear_cache, fused_experts
from .hf import LibmoeMoEBlock, from_hf, patch, supported

__all__ = ["MoEError", "MoELayer", "Runtime", "default_runtime", "fused_experts", "clear_cache",
           "from_hf", "patch", "supported", "LibmoeMoEBlock", "library_path", "version"]


def version():
    """(major, minor, patch) of the loaded libmoe.so."""
    import ctypes
    from . import _lib
    v = [ctypes.c_int(), ctypes.c_int(), ctypes.c_int()]
    _lib.load().moe_version(*[ctypes.byref(x) for x in v])
    return tuple(x.value for x in v)
