"""ggml (llama.cpp's tensor library) as a peer of one MoE layer's routed experts: the graph
llama.cpp's `build_moe_ffn` builds for Qwen3-MoE, called through ctypes on the libraries
llama-cpp-python builds from source (`llama_cpp/lib/libggml*.so`), nothing copied.

    gate = mul_mat_id(ffn_gate_exps, x, ids)      # [inter, top_k, T]
    up   = mul_mat_id(ffn_up_exps,   x, ids)
    h    = swiglu_split(gate, up)                 # silu(gate) * up
    y    = mul_mat_id(ffn_down_exps, h, ids)      # [hidden, top_k, T]
    y    = y * weights                            # [1, top_k, T]
    out  = sum over k of view(y, k)               # top_k - 1 adds, as llama.cpp orders them

Weights are the [E x N x K] bf16 tensors the caller holds (ggml's ne = [K, N, E], the same
bytes order): BF16 as they are, Q8_0 and Q4_0 quantized by ggml's own `ggml_quantize_chunk`
(what llama.cpp's quantizer calls). Each weight tensor lives where llama.cpp would put it: in
the CPU backend's repack buffer ("CPU_REPACK", Q4_0 re-laid in 8x8 blocks on x86 with AVX2)
when that buffer type takes it, else in a plain CPU buffer. Activations are f32, as in
llama.cpp. The graph runs on the CPU backend with `threads` threads and a ggml threadpool
attached, as llama-cli and llama-server attach one (in a ggml built with OpenMP, as
llama-cpp-python builds it where the compiler has OpenMP, OpenMP's threads run the graph and
the threadpool only carries the thread count), memory planned by ggml-alloc, one graph per
token count, built once; only the routing changes between calls.
"""
from __future__ import annotations

import ctypes as C
import glob
import time
from pathlib import Path

import torch

GGML_TYPE = {"f32": 0, "q4_0": 2, "q8_0": 8, "i32": 26, "bf16": 30}
FORMAT_TYPE = {"bf16": "bf16", "int8": "q8_0", "int4": "q4_0"}  # tandem format -> the ggml type compared


def label(fmt: str) -> str:
    """The peer's name in bench_peers' tables for tandem format `fmt`: "ggml Q4_0", ..."""
    return f"ggml {FORMAT_TYPE[fmt].upper()}"

USAGE_WEIGHTS = 1
MAX_THREADS = 512  # GGML_MAX_N_THREADS: the size of ggml_threadpool_params.cpumask


class InitParams(C.Structure):
    _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", C.c_void_p), ("no_alloc", C.c_bool)]


class ThreadpoolParams(C.Structure):
    _fields_ = [("cpumask", C.c_bool * MAX_THREADS), ("n_threads", C.c_int), ("prio", C.c_int),
                ("poll", C.c_uint32), ("strict_cpu", C.c_bool), ("paused", C.c_bool)]


P = C.c_void_p
I64 = C.c_int64
SIGS = {  # name: (result, arguments)
    "ggml_init": (P, [InitParams]),
    "ggml_free": (None, [P]),
    "ggml_tensor_overhead": (C.c_size_t, []),
    "ggml_graph_overhead": (C.c_size_t, []),
    "ggml_new_tensor_2d": (P, [P, C.c_int, I64, I64]),
    "ggml_new_tensor_3d": (P, [P, C.c_int, I64, I64, I64]),
    "ggml_get_data": (P, [P]),
    "ggml_nbytes": (C.c_size_t, [P]),
    "ggml_set_input": (None, [P]),
    "ggml_set_output": (None, [P]),
    "ggml_reshape_3d": (P, [P, P, I64, I64, I64]),
    "ggml_mul_mat_id": (P, [P, P, P, P]),
    "ggml_swiglu_split": (P, [P, P, P]),
    "ggml_mul": (P, [P, P, P]),
    "ggml_add": (P, [P, P, P]),
    "ggml_view_2d": (P, [P, P, I64, I64, C.c_size_t, C.c_size_t]),
    "ggml_new_graph": (P, [P]),
    "ggml_build_forward_expand": (None, [P, P]),
    "ggml_quantize_chunk": (C.c_size_t, [C.c_int, P, P, I64, I64, I64, P]),
    "ggml_row_size": (C.c_size_t, [C.c_int, I64]),
    "ggml_backend_cpu_init": (P, []),
    "ggml_backend_cpu_set_n_threads": (None, [P, C.c_int]),
    "ggml_backend_cpu_set_threadpool": (None, [P, P]),
    "ggml_threadpool_params_default": (ThreadpoolParams, [C.c_int]),
    "ggml_threadpool_new": (P, [C.POINTER(ThreadpoolParams)]),
    "ggml_threadpool_free": (None, [P]),
    "ggml_backend_free": (None, [P]),
    "ggml_backend_graph_compute": (C.c_int, [P, P]),
    "ggml_backend_cpu_reg": (P, []),
    "ggml_backend_reg_dev_get": (P, [P, C.c_size_t]),
    "ggml_backend_reg_get_proc_address": (P, [P, C.c_char_p]),
    "ggml_backend_buft_name": (C.c_char_p, [P]),
    "ggml_backend_cpu_buffer_type": (P, []),
    "ggml_backend_alloc_ctx_tensors_from_buft": (P, [P, P]),
    "ggml_backend_buffer_set_usage": (None, [P, C.c_int]),
    "ggml_backend_buffer_free": (None, [P]),
    "ggml_backend_tensor_set": (None, [P, P, C.c_size_t, C.c_size_t]),
    "ggml_gallocr_new": (P, [P]),
    "ggml_gallocr_alloc_graph": (C.c_bool, [P, P]),
    "ggml_gallocr_free": (None, [P]),
    "ggml_cpu_has_avx512": (C.c_int, []),
    "ggml_cpu_has_avx512_bf16": (C.c_int, []),
    "ggml_cpu_has_avx512_vnni": (C.c_int, []),
    "ggml_cpu_has_avx2": (C.c_int, []),
    "ggml_cpu_has_amx_int8": (C.c_int, []),
}


class Ggml:
    """The ggml functions this peer calls, bound from llama-cpp-python's libraries."""

    def __init__(self, libdir: str):
        libs = []
        # ggml-base first (the others link it), RTLD_GLOBAL so their symbols resolve
        for name in ("libggml-base.so", "libggml-cpu.so", "libggml.so"):
            path = Path(libdir, name)
            if not path.exists():
                raise FileNotFoundError(f"{path} is missing (llama-cpp-python's build puts libggml*.so in llama_cpp/lib)")
            libs.append(C.CDLL(str(path), mode=C.RTLD_GLOBAL))
        self.libs = libs
        for name, (res, args) in SIGS.items():
            fn = None
            for lib in libs:
                try:
                    fn = getattr(lib, name)
                    break
                except AttributeError:
                    continue
            if fn is None:
                raise AttributeError(f"{name} is in none of {libdir}/libggml*.so (another ggml version?)")
            fn.restype, fn.argtypes = res, args
            setattr(self, name, fn)

    def cpu_features(self) -> str:
        feats = [n for n in ("avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx_int8")
                 if getattr(self, f"ggml_cpu_has_{n}")()]
        return " ".join(feats) or "none of avx2/avx512"

    def extra_bufts(self) -> dict[str, int]:
        """The CPU device's extra buffer types by name (CPU_REPACK, AMX, ...)."""
        reg = self.ggml_backend_cpu_reg()
        dev = self.ggml_backend_reg_dev_get(reg, 0)
        addr = self.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
        if not addr:
            return {}
        arr = C.CFUNCTYPE(C.POINTER(C.c_void_p), C.c_void_p)(addr)(dev)
        out, i = {}, 0
        while arr and arr[i]:
            out[self.ggml_backend_buft_name(arr[i]).decode()] = arr[i]
            i += 1
        return out


def find_libdir(path: str | None) -> tuple[str | None, str | None]:
    """(llama_cpp/lib under DIR, None) or (None, reason)."""
    if not path:
        return None, "no --llama-path and LLAMA_CPP_PATH is not set"
    for cand in (Path(path, "llama_cpp", "lib"), Path(path, "lib"), Path(path)):
        if glob.glob(str(cand / "libggml-base.so")):
            return str(cand), None
    return None, f"no llama_cpp/lib/libggml-base.so under {path}"


class GgmlRunner:
    """One MoE layer in ggml (see the module docstring). Same interface as bench_peers'
    runners: call(case, r), output(T), free()."""

    def __init__(self, g: Ggml, fmt: str, shape: dict, E: int, W, threads: int, cases: list[dict]):
        self.g = g
        self.name = label(fmt)
        self.type = GGML_TYPE[FORMAT_TYPE[fmt]]
        H, I, K = shape["hidden"], shape["inter"], shape["top_k"]
        self.H, self.I, self.K = H, I, K
        self.ctx_w = g.ggml_init(InitParams(g.ggml_tensor_overhead() * 8, None, True))
        if not self.ctx_w:
            raise MemoryError("ggml_init failed for the weights' context")
        ne = [(H, I, E), (H, I, E), (I, H, E)]  # gate, up: [K=hidden, N=inter]; down: [K=inter, N=hidden]
        self.w = [g.ggml_new_tensor_3d(self.ctx_w, self.type, *n) for n in ne]
        repack = g.extra_bufts().get("CPU_REPACK")
        # llama.cpp puts a weight in the repack buffer when that buffer supports its op, i.e. when
        # a repacked layout exists for its type on this CPU (Q4_0 on x86 with AVX2; not Q8_0/BF16)
        use_repack = repack is not None and FORMAT_TYPE[fmt] == "q4_0" and g.ggml_cpu_has_avx2()
        buft = repack if use_repack else g.ggml_backend_cpu_buffer_type()
        self.buf = g.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx_w, buft)
        if not self.buf:
            raise MemoryError("ggml could not allocate the weights' buffer")
        g.ggml_backend_buffer_set_usage(self.buf, USAGE_WEIGHTS)
        t0 = time.perf_counter()
        for t, src in zip(self.w, W):
            self._set_weight(t, src)
        self.load_s = time.perf_counter() - t0
        self.bytes = sum(g.ggml_nbytes(t) for t in self.w)
        self.desc = (f"{FORMAT_TYPE[fmt].upper()} in {g.ggml_backend_buft_name(buft).decode()}, "
                     f"{threads} threads; ggml CPU features: {g.cpu_features()}")

        self.backend = g.ggml_backend_cpu_init()
        g.ggml_backend_cpu_set_n_threads(self.backend, threads)
        tp = g.ggml_threadpool_params_default(threads)
        self.tp = g.ggml_threadpool_new(C.byref(tp))
        g.ggml_backend_cpu_set_threadpool(self.backend, self.tp)

        self.graphs = {}
        for case in cases:
            self._build(case)

    def _set_weight(self, t, src: torch.Tensor) -> None:
        """bf16 [E x N x K] -> the tensor's type, then one ggml_backend_tensor_set of the whole
        tensor (a repack buffer re-lays it there and wants it whole)."""
        g = self.g
        E, N, Kd = src.shape
        nbytes = g.ggml_nbytes(t)
        if self.type == GGML_TYPE["bf16"]:
            g.ggml_backend_tensor_set(t, src.contiguous().data_ptr(), 0, nbytes)
            return
        row = g.ggml_row_size(self.type, Kd)
        host = torch.empty(nbytes, dtype=torch.uint8)
        for e in range(E):
            f = src[e].float().contiguous()
            g.ggml_quantize_chunk(self.type, f.data_ptr(), host.data_ptr() + e * N * row, 0, N, Kd, None)
        g.ggml_backend_tensor_set(t, host.data_ptr(), 0, nbytes)

    def _build(self, case: dict) -> None:
        g, H, I, K, T = self.g, self.H, self.I, self.K, case["T"]
        ctx = g.ggml_init(InitParams(g.ggml_tensor_overhead() * 64 + g.ggml_graph_overhead(), None, True))
        x = g.ggml_new_tensor_2d(ctx, GGML_TYPE["f32"], H, T)
        ids = g.ggml_new_tensor_2d(ctx, GGML_TYPE["i32"], K, T)
        wts = g.ggml_new_tensor_3d(ctx, GGML_TYPE["f32"], 1, K, T)
        for t in (x, ids, wts):
            g.ggml_set_input(t)
            g.ggml_set_output(t)  # ggml-alloc never reuses an output's memory: x is written once
        x3 = g.ggml_reshape_3d(ctx, x, H, 1, T)
        gate = g.ggml_mul_mat_id(ctx, self.w[0], x3, ids)
        up = g.ggml_mul_mat_id(ctx, self.w[1], x3, ids)
        h = g.ggml_swiglu_split(ctx, gate, up)
        y = g.ggml_mul_mat_id(ctx, self.w[2], h, ids)
        y = g.ggml_mul(ctx, y, wts)
        gf = g.ggml_new_graph(ctx)
        g.ggml_build_forward_expand(gf, y)
        nb1, nb2 = H * 4, H * K * 4  # y is f32 [H, K, T], contiguous
        views = [g.ggml_view_2d(ctx, y, H, T, nb2, k * nb1) for k in range(K)]
        for v in views:
            g.ggml_build_forward_expand(gf, v)
        out = views[0]
        for v in views[1:]:
            out = g.ggml_add(ctx, out, v)
            g.ggml_build_forward_expand(gf, out)
        g.ggml_set_output(out)
        galloc = g.ggml_gallocr_new(g.ggml_backend_cpu_buffer_type())
        if not g.ggml_gallocr_alloc_graph(galloc, gf):
            raise MemoryError(f"ggml-alloc could not plan the graph for {T} tokens")
        xf = case["x"].float().contiguous()
        C.memmove(g.ggml_get_data(x), xf.data_ptr(), xf.numel() * 4)
        ids32 = [i.to(torch.int32).contiguous() for i in case["ids"]]
        self.graphs[T] = dict(ctx=ctx, gf=gf, galloc=galloc, ids=g.ggml_get_data(ids), wts=g.ggml_get_data(wts),
                              out=g.ggml_get_data(out), ids32=ids32, w=case["w"], routing=-1)

    def call(self, case: dict, r: int) -> None:
        gr = self.graphs[case["T"]]
        if gr["routing"] != r:  # the routing's ids and weights into the graph's inputs
            n = case["T"] * self.K * 4
            C.memmove(gr["ids"], gr["ids32"][r].data_ptr(), n)
            C.memmove(gr["wts"], gr["w"][r].data_ptr(), n)
            gr["routing"] = r
        st = self.g.ggml_backend_graph_compute(self.backend, gr["gf"])
        if st != 0:
            raise RuntimeError(f"ggml_backend_graph_compute returned status {st}")

    def output(self, T: int) -> torch.Tensor:
        out = torch.empty(T, self.H)
        C.memmove(out.data_ptr(), self.graphs[T]["out"], out.numel() * 4)
        return out

    def free(self) -> None:
        g = self.g
        for gr in self.graphs.values():
            g.ggml_gallocr_free(gr["galloc"])
            g.ggml_free(gr["ctx"])
        self.graphs.clear()
        if self.backend:
            g.ggml_backend_free(self.backend)
            self.backend = None
        if self.tp:
            g.ggml_threadpool_free(self.tp)
            self.tp = None
        if self.buf:
            g.ggml_backend_buffer_free(self.buf)
            self.buf = None
        if self.ctx_w:
            g.ggml_free(self.ctx_w)
            self.ctx_w = None
