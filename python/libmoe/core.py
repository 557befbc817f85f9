# SPDX-License-Identifier: Apache-2.0
"""Runtime and MoELayer over the C API, and the torch.library op that runs a layer's forward."""
import atexit
import ctypes
import weakref
from typing import Optional

import torch

from . import _lib
from ._lib import MoEError, check

_TORCH_DTYPE = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
if hasattr(torch, "float8_e4m3fn"):
    _TORCH_DTYPE[torch.float8_e4m3fn] = "fp8_e4m3"


def _moe_dtype(d):
    """A weight dtype given as a torch dtype or a name ("f32", "bf16", "fp8_e4m3")."""
    if isinstance(d, torch.dtype):
        if d not in _TORCH_DTYPE:
            raise TypeError(f"dtype {d}: libmoe weights are float32, bfloat16, float16 or "
                            "float8_e4m3fn")
        d = _TORCH_DTYPE[d]
    if d == "fp8":
        d = "fp8_e4m3"
    if d not in _lib.DTYPE:
        raise ValueError(f"dtype {d!r}: one of {sorted(_lib.DTYPE)} or a torch dtype")
    return _lib.DTYPE[d]


def _enum(table, value, what):
    if isinstance(value, str):
        if value not in table:
            raise ValueError(f"{what} = {value!r}: one of {sorted(table)}")
        return table[value]
    return int(value)


# ---- MPI kept up for the process ---------------------------------------------------------------
# libmoe initialises MPI when it is not (and finalises it with the runtime that did), and MPI
# cannot be initialised twice in a process. A first, CPU-backend runtime held until exit owns
# MPI here, so Python code may create and destroy Runtimes as often as it likes.
_keeper = None


def _keep_mpi(lib, timeout_ms):
    global _keeper
    if _keeper is not None:
        return
    cfg = _lib.RuntimeConfig(_lib.BACKEND["cpu"], -1, int(timeout_ms), 0)
    h = ctypes.c_void_p()
    check(lib.moe_runtime_create(ctypes.byref(cfg), None, ctypes.byref(h)))
    _keeper = h
    atexit.register(_release_mpi)


def _release_mpi():
    global _keeper
    for rt in list(Runtime._live):
        rt.close()
    if _keeper is not None:
        _lib.load().moe_runtime_destroy(_keeper)
        _keeper = None


class Runtime:
    """libmoe's runtime over MPI_COMM_WORLD (collective: every rank creates it). MPI is
    initialised by the library when the process was started by mpirun/srun; a single process
    works too. A context manager; close() destroys its layers first. `device` is where the
    layers' tensors live (CUDA backend: device -1 picks the node-local rank's GPU; put the
    model there, e.g. torch.cuda.set_device(rt.device))."""

    _live = weakref.WeakSet()

    def __init__(self, backend="auto", device=-1, timeout_ms=0, bind=False):
        lib = _lib.load()
        _keep_mpi(lib, timeout_ms)
        cfg = _lib.RuntimeConfig(_enum(_lib.BACKEND, backend, "backend"), int(device),
                                 int(timeout_ms), int(bool(bind)))
        h = ctypes.c_void_p()
        check(lib.moe_runtime_create(ctypes.byref(cfg), None, ctypes.byref(h)))
        self._h = h
        self._layers = weakref.WeakSet()
        info = _lib.RuntimeInfo()
        check(lib.moe_runtime_get_info(h, ctypes.byref(info)))
        self.rank, self.world = info.rank, info.world_size
        self.local_rank, self.local_size = info.local_rank, info.local_size
        self.backend = _lib.BACKEND_NAME[info.backend]
        self.device = (torch.device("cuda", info.device) if self.backend == "cuda"
                       else torch.device("cpu"))
        self.hostname = info.hostname.decode(errors="replace")
        Runtime._live.add(self)

    @property
    def handle(self):
        if self._h is None:
            raise MoEError("MOE_STATUS_INVALID_STATE", "the runtime has been destroyed (closed)")
        return self._h

    @property
    def closed(self):
        return self._h is None

    def max_tokens(self, num_tokens):
        """Collective: the largest num_tokens over the ranks (moe_runtime_max_tokens)."""
        out = ctypes.c_int64()
        check(_lib.load().moe_runtime_max_tokens(self.handle, int(num_tokens), ctypes.byref(out)))
        return out.value

    def close(self):
        if self._h is None:
            return
        for layer in list(self._layers):
            layer.close()
        _lib.load().moe_runtime_destroy(self._h)
        self._h = None
        Runtime._live.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self._h is None else f"{self.backend} {self.device}"
        return f"libmoe.Runtime(rank {self.rank}/{self.world}, {state})"


_default = None


def default_runtime():
    """The process's shared Runtime (backend auto), made at first use."""
    global _default
    if _default is None or _default.closed:
        _default = Runtime()
    return _default


# ---- layers --------------------------------------------------------------------------------
_layers_by_id = {}
_next_id = [1]


class MoELayer:
    """One MoE layer (moe_layer_config_t); collective create. Weights with set_weight, then
    forward(x) / layer(x). See include/moe/moe.h for each field."""

    def __init__(self, runtime, num_experts, top_k, hidden, intermediate, num_shared_experts=0,
                 shared_intermediate=0, shared_expert_gate=False, activation="silu",
                 scoring="softmax", use_score_bias=False, n_group=0, topk_group=0,
                 renormalize=True, routed_scaling_factor=1.0, dtype="bf16", scale_kind="none",
                 fp8_math="auto", max_tokens_per_rank=4096, ep_size=0, tp_size=0,
                 dispatch="auto", deterministic=0, check_inputs=False, skip_weight_check=False,
                 ep_round_tokens=0, num_redundant_experts=0):
        if runtime is None:
            runtime = default_runtime()
        c = _lib.LayerConfig()
        c.num_experts, c.top_k, c.hidden, c.intermediate = (int(num_experts), int(top_k),
                                                            int(hidden), int(intermediate))
        c.num_shared_experts = int(num_shared_experts)
        c.shared_intermediate = int(shared_intermediate)
        c.shared_expert_gate = int(bool(shared_expert_gate))
        c.activation = _enum(_lib.ACTIVATION, activation, "activation")
        c.scoring = _enum(_lib.SCORING, scoring, "scoring")
        c.use_score_bias = int(bool(use_score_bias))
        c.n_group, c.topk_group = int(n_group), int(topk_group)
        c.renormalize = int(bool(renormalize))
        c.routed_scaling_factor = float(routed_scaling_factor)
        c.weight_dtype = _moe_dtype(dtype)
        c.scale_kind = _enum(_lib.SCALE, scale_kind, "scale_kind")
        c.max_tokens_per_rank = int(max_tokens_per_rank)
        c.ep_size, c.tp_size = int(ep_size), int(tp_size)
        c.dispatch = _enum(_lib.DISPATCH, dispatch, "dispatch")
        c.deterministic = int(deterministic)
        c.check_inputs = int(bool(check_inputs))
        c.skip_weight_check = int(bool(skip_weight_check))
        c.fp8_math = _enum(_lib.FP8_MATH, fp8_math, "fp8_math")
        c.ep_round_tokens = int(ep_round_tokens)
        c.num_redundant_experts = int(num_redundant_experts)
        lib = _lib.load()
        h = ctypes.c_void_p()
        check(lib.moe_layer_create(runtime.handle, ctypes.byref(c), ctypes.byref(h)))
        self._h, self.runtime, self.config = h, runtime, c
        self.num_experts, self.top_k, self.hidden = c.num_experts, c.top_k, c.hidden
        self.device = runtime.device
        runtime._layers.add(self)
        self._id = _next_id[0]
        _next_id[0] += 1
        _layers_by_id[self._id] = weakref.ref(self)
        inf = _lib.LayerInfo()
        check(lib.moe_layer_get_info(h, ctypes.byref(inf)))
        self.info = {f: getattr(inf, f) for f, _ in _lib.LayerInfo._fields_}

    # -- lifetime
    @property
    def handle(self):
        if self._h is None:
            raise MoEError("MOE_STATUS_INVALID_STATE",
                           "the layer has been destroyed (or its runtime closed)")
        if self.runtime.closed:
            raise MoEError("MOE_STATUS_INVALID_STATE", "the layer's runtime has been destroyed")
        return self._h

    def close(self):
        if self._h is not None:
            _lib.load().moe_layer_destroy(self._h)
            self._h = None
            _layers_by_id.pop(self._id, None)

    def __del__(self):
        try:
            if self._h is not None and not self.runtime.closed:
                self.close()
        except Exception:
            pass

    # -- weights
    def local_experts(self):
        """The global ids of the experts whose matrices this rank keeps: its contiguous block, or
        (redundant slots, EPLB) every expert, set_weight keeping only what the rank holds."""
        first, n = self.info["first_local_expert"], self.info["num_local_experts"]
        return range(first, first + n) if first >= 0 else range(self.num_experts)

    def set_weight(self, kind, expert, tensor, scale=None, input_scale=None):
        """Copies a host matrix (a torch tensor, 2-D, or 1-D for router_bias and
        shared_expert_gate; f32, bf16, f16 or float8_e4m3fn with `scale`) into the layer. The full
        matrix or this rank's slice, as moe_layer_set_weight; `expert` is the global id for
        gate_proj, up_proj and down_proj and ignored (-1) otherwise. `input_scale` (a float or a
        one-element tensor): the matrix's static activation scale, a checkpoint's input_scale
        (moe_layer_set_weight_with_input_scale: W8A8 layers with per-tensor FP8 weights)."""
        k = _enum(_lib.WEIGHT, kind, "weight kind")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"set_weight({kind!r}): tensor must be a torch.Tensor, got "
                            f"{type(tensor).__name__}")
        t = tensor.detach()
        if t.dim() == 1:
            t = t.reshape(1, -1)
        if t.dim() != 2:
            raise ValueError(f"set_weight({kind!r}): a matrix, got shape {tuple(tensor.shape)}")
        dt = _moe_dtype(t.dtype)
        t = t.to("cpu").contiguous()
        ten = _lib.Tensor(dt, t.shape[0], t.shape[1], t.data_ptr(), None, 0, 0)
        s = None
        if scale is not None:
            s = torch.as_tensor(scale, dtype=torch.float32).detach().to("cpu").contiguous()
            if s.dim() == 0:
                s = s.reshape(1, 1)
            elif s.dim() == 1:
                s = s.reshape(-1, 1)
            ten.scale, ten.scale_rows, ten.scale_cols = s.data_ptr(), s.shape[0], s.shape[1]
        if input_scale is None:
            check(_lib.load().moe_layer_set_weight(self.handle, k, int(expert),
                                                   ctypes.byref(ten)))
            return
        if isinstance(input_scale, torch.Tensor):
            if input_scale.numel() != 1:
                raise ValueError(f"set_weight({kind!r}): input_scale has {input_scale.numel()} "
                                 "elements; one per matrix")
            input_scale = input_scale.item()
        check(_lib.load().moe_layer_set_weight_with_input_scale(
            self.handle, k, int(expert), ctypes.byref(ten), float(input_scale)))

    # -- forward
    def forward(self, x, topk_ids=None, topk_weights=None, router_logits=None):
        """y = layer(x), x [..., hidden] f32 or bf16, contiguous, on the layer's device (CPU for
        the CPU backend). topk_ids (int32) / topk_weights (f32) [T, top_k]: routing given by the
        caller; router_logits [T, E] f32: the router's logits given. On CUDA the step runs on
        torch.cuda.current_stream() without a host synchronisation (graph-capturable); device-
        side failures (a bad given id) show at synchronize(). Collective with EP."""
        if torch.compiler.is_compiling():
            return torch.ops.libmoe.layer_forward(x, self._id, topk_ids, topk_weights,
                                                  router_logits)
        return _forward(self, x, topk_ids, topk_weights, router_logits)

    __call__ = forward

    def synchronize(self):
        """Waits (bounded) for this layer's queued steps on the current stream and raises the
        verdict of the steps since the last synchronize (CUDA; returns at once on the CPU)."""
        stream = None
        if self.runtime.backend == "cuda":
            stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        check(_lib.load().moe_layer_synchronize(self.handle, stream))

    # -- introspection
    def explain(self, num_tokens):
        buf = ctypes.create_string_buffer(2048)
        check(_lib.load().moe_layer_explain(self.handle, int(num_tokens), buf, len(buf)))
        return buf.value.decode(errors="replace")

    def stats(self):
        s = _lib.LayerStats()
        check(_lib.load().moe_layer_get_stats(self.handle, ctypes.byref(s)))
        return {f: getattr(s, f) for f, _ in _lib.LayerStats._fields_}

    def expert_load(self):
        counts = (ctypes.c_int64 * self.num_experts)()
        check(_lib.load().moe_layer_get_expert_load(self.handle, counts, self.num_experts))
        return torch.tensor(list(counts), dtype=torch.int64)

    def __repr__(self):
        c = self.config
        return (f"libmoe.MoELayer(E={c.num_experts}, k={c.top_k}, H={c.hidden}, "
                f"I={c.intermediate}, {self.runtime.backend})")


def _check_tensor(name, t, dtypes, device, shape):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}.dtype = {t.dtype}: must be one of {list(dtypes)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}: the layer runs on {device}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}.shape = {tuple(t.shape)}: must be {tuple(shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} is not contiguous (call .contiguous())")


def _device_of(layer):
    d = layer.device
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _forward(layer, x, topk_ids, topk_weights, router_logits):
    h = layer.handle
    dev = _device_of(layer)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != layer.hidden:
        raise ValueError(f"x.shape = {tuple(x.shape)}: the last dimension must be hidden = "
                         f"{layer.hidden}")
    T = x.numel() // layer.hidden
    _check_tensor("x", x, (torch.float32, torch.bfloat16), dev, x.shape)
    a = _lib.ForwardArgs()
    a.num_tokens, a.dtype = T, _lib.DTYPE["f32" if x.dtype == torch.float32 else "bf16"]
    if (topk_ids is None) != (topk_weights is None):
        raise ValueError("topk_ids and topk_weights: give both or neither")
    if topk_ids is not None:
        if router_logits is not None:
            raise ValueError("router_logits and topk_ids/topk_weights: one routing only")
        _check_tensor("topk_ids", topk_ids, (torch.int32,), dev, (T, layer.top_k))
        _check_tensor("topk_weights", topk_weights, (torch.float32,), dev, (T, layer.top_k))
        a.given_topk_ids, a.given_topk_weights = topk_ids.data_ptr(), topk_weights.data_ptr()
    if router_logits is not None:
        _check_tensor("router_logits", router_logits, (torch.float32,), dev,
                      (T, layer.num_experts))
        a.router_logits = router_logits.data_ptr()
    y = torch.empty_like(x)
    a.x, a.y = x.data_ptr(), y.data_ptr()
    if dev.type == "cuda":
        a.stream = torch.cuda.current_stream(dev).cuda_stream
        if torch.cuda.current_device() != dev.index:  # the library runs on the current device
            with torch.cuda.device(dev):
                check(_lib.load().moe_layer_forward(h, ctypes.byref(a)))
            return y
    check(_lib.load().moe_layer_forward(h, ctypes.byref(a)))
    return y


def _layer_of(layer_id):
    ref = _layers_by_id.get(layer_id)
    layer = ref() if ref else None
    if layer is None:
        raise MoEError("MOE_STATUS_INVALID_STATE", f"libmoe layer {layer_id} has been destroyed")
    return layer


@torch.library.custom_op("libmoe::layer_forward", mutates_args=())
def _layer_forward_op(x: torch.Tensor, layer_id: int, topk_ids: Optional[torch.Tensor],
                      topk_weights: Optional[torch.Tensor],
                      router_logits: Optional[torch.Tensor]) -> torch.Tensor:
    return _forward(_layer_of(layer_id), x, topk_ids, topk_weights, router_logits)


@_layer_forward_op.register_fake
def _(x, layer_id, topk_ids, topk_weights, router_logits):
    return torch.empty_like(x)
