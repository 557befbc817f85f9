# SPDX-License-Identifier: Apache-2.0
"""libmoe.so through ctypes: where it is found, the public structs of include/moe/moe.h, and the
status -> exception mapping. Nothing here is compiled."""
import ctypes
import ctypes.util
import os
import sys

# ---- enums (include/moe/moe.h) ---------------------------------------------------------------
STATUS_NAMES = [
    "SUCCESS", "INVALID_ARGUMENT", "NOT_SUPPORTED", "OUT_OF_MEMORY", "INVALID_STATE", "IO_ERROR",
    "FORMAT_ERROR", "MISMATCH", "TIMEOUT", "PEER_FAILURE", "CUDA_ERROR", "NCCL_ERROR", "MPI_ERROR",
    "NUMERIC_ERROR", "INTERNAL_ERROR",
]
DTYPE = {"f32": 1, "bf16": 2, "f16": 3, "fp8_e4m3": 4}
SCALE = {"none": 0, "tensor": 1, "block": 2, "channel": 3}
FP8_MATH = {"auto": 0, "w8a16": 1, "w8a8": 2, "w8a8_fast": 3}
BACKEND = {"auto": 0, "cpu": 1, "cuda": 2}
BACKEND_NAME = {v: k for k, v in BACKEND.items()}
ACTIVATION = {"silu": 0, "gelu": 1, "gelu_tanh": 1, "gelu_pytorch_tanh": 1}
SCORING = {"softmax": 0, "sigmoid": 1}
DISPATCH = {"auto": 0, "all_to_all": 1, "all_gather": 2}
WEIGHT = {
    "router": 0, "router_bias": 1, "gate_proj": 2, "up_proj": 3, "down_proj": 4,
    "shared_gate_proj": 5, "shared_up_proj": 6, "shared_down_proj": 7, "shared_expert_gate": 8,
}
PER_EXPERT = ("gate_proj", "up_proj", "down_proj")


class MoEError(RuntimeError):
    """A libmoe call failed: `status` is the C status name, the message is moe_last_error()."""

    def __init__(self, status, message):
        self.status = status
        super().__init__(f"{status}: {message}" if message else status)


# ---- structs ---------------------------------------------------------------------------------
class RuntimeConfig(ctypes.Structure):
    _fields_ = [("backend", ctypes.c_int), ("device", ctypes.c_int), ("timeout_ms", ctypes.c_int),
                ("bind", ctypes.c_int)]


class RuntimeInfo(ctypes.Structure):
    _fields_ = [("rank", ctypes.c_int), ("world_size", ctypes.c_int), ("local_rank", ctypes.c_int),
                ("local_size", ctypes.c_int), ("backend", ctypes.c_int), ("device", ctypes.c_int),
                ("numa_node", ctypes.c_int), ("hostname", ctypes.c_char * 64),
                ("cpuset", ctypes.c_char * 64), ("workspace_bytes", ctypes.c_size_t)]


class LayerConfig(ctypes.Structure):
    _fields_ = [("num_experts", ctypes.c_int), ("top_k", ctypes.c_int), ("hidden", ctypes.c_int),
                ("intermediate", ctypes.c_int), ("num_shared_experts", ctypes.c_int),
                ("shared_intermediate", ctypes.c_int), ("shared_expert_gate", ctypes.c_int),
                ("activation", ctypes.c_int), ("scoring", ctypes.c_int),
                ("use_score_bias", ctypes.c_int), ("n_group", ctypes.c_int),
                ("topk_group", ctypes.c_int), ("renormalize", ctypes.c_int),
                ("routed_scaling_factor", ctypes.c_float), ("weight_dtype", ctypes.c_int),
                ("scale_kind", ctypes.c_int), ("max_tokens_per_rank", ctypes.c_int64),
                ("ep_size", ctypes.c_int), ("tp_size", ctypes.c_int), ("dispatch", ctypes.c_int),
                ("deterministic", ctypes.c_int), ("check_inputs", ctypes.c_int),
                ("skip_weight_check", ctypes.c_int), ("fp8_math", ctypes.c_int),
                ("ep_round_tokens", ctypes.c_int64), ("num_redundant_experts", ctypes.c_int)]


class LayerInfo(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int) for n in (
        "ep_size", "tp_size", "ep_rank", "tp_rank", "num_local_experts", "first_local_expert",
        "intermediate_begin", "intermediate_end", "shared_begin", "shared_end", "dispatch",
        "deterministic")] + [("weight_bytes", ctypes.c_size_t), ("workspace_bytes", ctypes.c_size_t),
                             ("ep_round_tokens", ctypes.c_int64)]


class Tensor(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
                ("data", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("scale_rows", ctypes.c_int64), ("scale_cols", ctypes.c_int64)]


class ForwardArgs(ctypes.Structure):
    _fields_ = [("num_tokens", ctypes.c_int64), ("dtype", ctypes.c_int), ("x", ctypes.c_void_p),
                ("y", ctypes.c_void_p), ("router_logits", ctypes.c_void_p),
                ("topk_ids", ctypes.c_void_p), ("topk_weights", ctypes.c_void_p),
                ("stream", ctypes.c_void_p), ("max_tokens_across_ranks", ctypes.c_int64),
                ("given_topk_ids", ctypes.c_void_p), ("given_topk_weights", ctypes.c_void_p)]


class LayerStats(ctypes.Structure):
    _fields_ = [(n, ctypes.c_double) for n in (
        "route_us", "dispatch_us", "expert_us", "combine_us", "shared_us", "total_us")] + [
        ("rows_received", ctypes.c_int64), ("bytes_sent", ctypes.c_int64)]


# ---- finding the library ---------------------------------------------------------------------
_NAMES = ("libmoe.so",)


def _candidates():
    """(path, where) pairs in the documented order: LIBMOE_LIBRARY, install prefix, build tree."""
    out = []
    env = os.environ.get("LIBMOE_LIBRARY")
    if env:
        out.append((env, "LIBMOE_LIBRARY"))
        return out
    prefixes = [os.environ.get("LIBMOE_PREFIX"), sys.prefix, "/usr/local", "/usr"]
    for p in prefixes:
        if not p:
            continue
        for lib in ("lib", "lib64", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu"):
            for n in _NAMES:
                out.append((os.path.join(p, lib, n), "install prefix"))
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))  # python/libmoe -> the repository
    builds = [os.environ.get("LIBMOE_BUILD_DIR")] + [
        os.path.join(repo, d) for d in ("build", "build-cpu")]
    for b in builds:
        if b:
            for n in _NAMES:
                out.append((os.path.join(b, n), "build tree"))
    return out


_lib = None
_lib_path = None


def library_path():
    load()
    return _lib_path


def load():
    """The loaded libmoe.so (loaded once, RTLD_GLOBAL so that Open MPI's plugins see libmpi)."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    tried = []
    for path, where in _candidates():
        if not os.path.isfile(path):
            tried.append(f"{path} ({where}: no such file)")
            continue
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            tried.append(f"{path} ({where}: {e})")
            continue
        _declare(lib)
        _lib, _lib_path = lib, path
        return lib
    raise ImportError("libmoe: libmoe.so not found; tried, in order:\n  " + "\n  ".join(tried) +
                      "\nSet LIBMOE_LIBRARY=/path/to/libmoe.so, install it (cmake --install "
                      "build), or build it in the repository's build/ folder.")


def _declare(lib):
    P, I, V = ctypes.POINTER, ctypes.c_int, ctypes.c_void_p
    S = ctypes.c_int  # moe_status_t
    sigs = {
        "moe_status_string": (ctypes.c_char_p, [I]),
        "moe_last_error": (ctypes.c_char_p, []),
        "moe_version": (None, [P(I), P(I), P(I)]),
        "moe_runtime_create": (S, [P(RuntimeConfig), V, P(V)]),
        "moe_runtime_destroy": (S, [V]),
        "moe_runtime_get_info": (S, [V, P(RuntimeInfo)]),
        "moe_runtime_max_tokens": (S, [V, ctypes.c_int64, P(ctypes.c_int64)]),
        "moe_layer_create": (S, [V, P(LayerConfig), P(V)]),
        "moe_layer_destroy": (S, [V]),
        "moe_layer_get_info": (S, [V, P(LayerInfo)]),
        "moe_layer_set_weight": (S, [V, I, I, P(Tensor)]),
        "moe_layer_set_weight_with_input_scale": (S, [V, I, I, P(Tensor), ctypes.c_float]),
        "moe_layer_forward": (S, [V, P(ForwardArgs)]),
        "moe_layer_synchronize": (S, [V, V]),
        "moe_layer_explain": (S, [V, ctypes.c_int64, ctypes.c_char_p, ctypes.c_size_t]),
        "moe_layer_get_stats": (S, [V, P(LayerStats)]),
        "moe_layer_get_expert_load": (S, [V, P(ctypes.c_int64), I]),
    }
    for name, (res, args) in sigs.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args


def check(status):
    """Raises MoEError for a failed status, with moe_last_error()'s text."""
    if status == 0:
        return
    lib = load()
    msg = (lib.moe_last_error() or b"").decode(errors="replace")
    name = STATUS_NAMES[status] if 0 <= status < len(STATUS_NAMES) else f"status {status}"
    raise MoEError("MOE_STATUS_" + name, msg)
