"""A decode step's decoder layers as one native call (radixkv/cpu/csrc/decode_layers.c), for
models whose linears run a native kernel (AMX or AVX512_BF16 in bf16, AVX2 in fp32, or a
quantized kernel over q8_0/q4_1 weights in either): the same kernels as the layer-by-layer
forward, minus its Python.

At 32 rows the Python between a layer's ten kernels and inside their wrappers costs ~0.3 ms,
which across SmolLM2's 30 layers is ~8 ms of a ~60 ms step (scenarios/decode_profile.py shows
both paths). Only steps where every request decodes one token take this path; prefill and
mixed steps run the modules, and so does every other device. radixkv.model.fused_layers installs
it over a model's layers and hands it the tables the CPU backend checked (StepState.decode_tables).
Gemma 3 runs it too: its norms and GeGLU (csrc/gemma_ops.c, which its layer loop calls as well),
and its window layers over their own group's tables with their own RoPE base. So do Qwen3 (its
per-head q/k norms: the add_rms_norm kernel, as its layer loop calls it) and Qwen3-MoE, whose
expert layers the native call stops after: the caller runs their router and experts (`mlp`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from radixkv.cpu import decode, native
from radixkv.cpu.features import cpu_caches
from radixkv.cpu.linear import NATIVE_LINEAR_KERNELS, PackedLinear, available_linear_kernels
from radixkv.cpu.quant_linear import QuantLinear

_p = ctypes.c_void_p


class DecodeTables(Protocol):
    """What run() reads of a step's checked tables (radixkv.attention.base.DecodeTables: this
    floor does not import attention/)."""

    slot_mapping: Tensor
    page_table: Tensor
    seq_lens: Tensor
    plan: Tensor | None


class _Layer(ctypes.Structure):
    _fields_ = [
        *(
            (name, _p)
            for name in ("input_norm", "post_norm", "qkv", "o", "gate_up", "down", "qkv_bias", "o_bias", "k_cache", "v_cache", "k_scales", "v_scales")
        ),
        ("formats", ctypes.c_int * 4),
        *((name, _p) for name in ("q_norm", "k_norm", "pre_ff_norm", "post_ff_norm")),
        *((name, ctypes.c_int) for name in ("window", "group", "rope")),
    ]


class _Shape(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int) for name in ("rows", "hidden", "intermediate", "num_q_heads", "num_kv_heads", "head_dim", "page_size", "num_threads")),
        ("linear_kernel", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("quant_kernel", ctypes.c_int),
        ("kv_kind", ctypes.c_int),
        ("gemma", ctypes.c_int),
        ("split_rows", ctypes.c_int),
    ]


class _Step(ctypes.Structure):
    """decode_layers.c's DecodeStep: [0] the full layers' tables and the model's RoPE, [1] the
    window group's tables and the local layers' RoPE."""

    _fields_ = [
        *((name, _p * 2) for name in ("cos", "signed_sin", "slots", "page_table")),
        ("page_table_stride", ctypes.c_int64 * 2),
        *((name, _p * 2) for name in ("seq_lens", "plan")),
    ]


class _Scratch(ctypes.Structure):
    _fields_ = [(name, _p) for name in ("h", "qkv", "attention", "projected", "gate_up", "activated", "work", "phase_seconds")]


def _linears(layer: torch.nn.Module) -> tuple[object, ...]:
    """The layer's linears the C loop runs: attention's, and its MLP's where dense (an experts
    block, which has no gate_up_proj, is the caller's)."""
    attention = layer.self_attn.qkv_proj, layer.self_attn.o_proj
    return (*attention, layer.mlp.gate_up_proj, layer.mlp.down_proj) if _dense(layer) else attention


def _dense(layer: torch.nn.Module) -> bool:
    return hasattr(layer.mlp, "gate_up_proj")


def _kernel(linear: object) -> tuple[str, str] | None:
    """Which native kernel runs this linear, as (kind, name); None: not one the C loop can call."""
    if isinstance(linear, PackedLinear) and linear.rows_independent:
        return "packed", linear.kernel
    if isinstance(linear, QuantLinear) and linear.packed is not None:
        return "quant", linear.kernel
    return None


def _packed(linear: PackedLinear | QuantLinear) -> Tensor:
    return linear.packed if isinstance(linear, QuantLinear) else linear.packed_weight


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _bias(linear: PackedLinear | QuantLinear) -> Tensor | None:
    return linear.bias if isinstance(linear, QuantLinear) else linear.bias_f32


class FusedDecode:
    """Runs a CausalLM's layers for a decode-only step in one native call, when the model fits
    (see `for_model`); the weights are read through the model's own tensors, never copied."""

    # The parts of a step the native call can time (decode_layers.c's PHASE_*), in its order.
    PHASES = ("norms, silu", "qkv", "rope, KV store", "attention", "o", "gate_up", "down")

    def __init__(self, model: torch.nn.Module, library: ctypes.CDLL) -> None:
        # The layers and config, not the model: the model holds this object.
        self.layers, self.config, self.library = model.layers, model.config, library
        self._layers: ctypes.Array | None = None
        self._caches: tuple[int, ...] | None = None  # data_ptr of every k and v cache bound
        # The distinct sliding windows of the layers (Gemma's local layers), sized for in run().
        self._windows = sorted({layer.self_attn.window for layer in self.layers if layer.self_attn.window is not None})
        # Where each native call stops: after every layer whose MLP the caller runs, and the last.
        experts = {i + 1 for i, layer in enumerate(self.layers) if not _dense(layer)}
        self._stops = sorted(experts | {len(self.layers)})
        self._experts_stops = frozenset(experts)  # asked each step: hasattr on a module raises inside
        # float64 [len(PHASES)] that each fused step adds its seconds per phase to, or None:
        # untimed. A profiler's (scenarios/decode_profile.py) to set, zero and read. Split by
        # rows (splits_rows), the share that starts at row 0 times its own phases.
        self.phase_seconds: Tensor | None = None
        # EngineConfig.split_decode_rows; the largest layer's linears in bytes, which "auto" weighs.
        self.split_rows = "auto"
        self.layer_weight_bytes = max(sum(_nbytes(_packed(linear)) for linear in _linears(layer)) for layer in self.layers)

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> FusedDecode | None:
        """A FusedDecode where every layer can take the native path, else None."""
        config = model.config
        library = native.load()
        linears = [linear for layer in model.layers for linear in _linears(layer)]
        # One native kernel for every linear: the C loop passes one kernel id to all of them, and
        # that kernel's dtype (the model's: PackedLinear packs for its weights' dtype) is the step's.
        # Quantized linears (any mix of formats) name the dtype by the norms' weights instead.
        kernels = {_kernel(linear) for linear in linears}
        kind = next(iter(kernels))[0] if len(kernels) == 1 and None not in kernels else None
        # The linears first: a quantized model's embedding (QuantEmbedding) has no float .weight.
        dtype_source = model.embed_tokens.weight if kind == "packed" else model.layers[0].input_layernorm.weight if kind else None
        # bf16 layers run the bf16 row ops and attention, which a packed bf16 kernel vouches for;
        # a quantized model in bf16 needs a CPU where one of them runs too.
        dtypes = (torch.bfloat16, torch.float32) if kind == "packed" or available_linear_kernels(torch.bfloat16) else (torch.float32,)
        fits = (
            library is not None
            and not config.attention_sinks
            and config.hidden_act == ("gelu_tanh" if config.gemma_norms else "silu")
            and dtype_source is not None
            and dtype_source.dtype in dtypes
            and dtype_source.device.type == "cpu"
        )  # fmt: skip
        return cls(model, library) if fits else None

    def splits_rows(self) -> bool:
        """Whether a step gives each thread its own share of the rows (decode_layers.c's
        split_rows): "on", or "auto" on two threads where a layer's weights take at most four
        times one core's L2 (EngineConfig.split_decode_rows says why)."""
        if self.split_rows != "auto":
            return self.split_rows == "on"
        l2_bytes = cpu_caches().l2_bytes
        return torch.get_num_threads() == 2 and 0 < self.layer_weight_bytes <= 4 * l2_bytes

    @staticmethod
    def takes_pages(compute_dtype: torch.dtype, k_cache: Tensor) -> bool:
        """Whether the step reads pages of k_cache's dtype under compute_dtype: the same dtype,
        bf16 or int8 pages under fp32, int8 pages under bf16 (decode.pages_fit's kernels)."""
        return k_cache.dtype == compute_dtype or decode.pages_fit(compute_dtype, k_cache)

    def run(
        self, x: Tensor, cos: Tensor, sin: Tensor, k_caches: list[Tensor], v_caches: list[Tensor],
        tables: DecodeTables, k_scales: list[Tensor] | None = None, v_scales: list[Tensor] | None = None,
        window_tables: DecodeTables | None = None, local_rope: tuple[Tensor, Tensor] | None = None,
        mlp: Callable[[int, Tensor], Tensor] | None = None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """(residual stream, last MLP output) after all layers, as the module loop returns them,
        for one new token a row. The C code trusts the tables' slots, page tables and lengths, so
        the caller range-checks them first (the CPU attention backend's prepare() does, and hands
        them out as DecodeTables, with the cascade plan). window_tables: the window layers' group
        (AttentionMetadata.window_meta's), None where they read `tables`; local_rope: the (cos,
        sin) of window layers with their own RoPE base (Gemma's local layers). Pages in another
        dtype than x's (takes_pages) come with their scales where int8 (PagePool.k_scales).
        mlp(i, h): layer i's MLP output for its normed input h, for the layers whose MLP has no
        native path here (experts); the module's own forward, so the bits are its bits."""
        config, rows = self.config, x.shape[0]
        assert self.takes_pages(x.dtype, k_caches[0]), "call takes_pages() first"
        layers = self._bind(k_caches, v_caches, k_scales, v_scales)
        q_size, kv_size = config.num_q_heads * config.head_dim, config.num_kv_heads * config.head_dim
        widths = dict(h=config.hidden_size, qkv=q_size + 2 * kv_size, attention=q_size, projected=config.hidden_size,
                      gate_up=2 * config.intermediate_size, activated=config.intermediate_size)  # fmt: skip
        buffers = {name: torch.empty(rows, width, dtype=x.dtype) for name, width in widths.items()}
        # Window layers read group 1's tables (their own pool's where the model has layer groups)
        # and no cascade plan; each of their windows sizes its own softmax work.
        groups = (tables, window_tables or tables)
        rotations = [(c.contiguous(), s.contiguous()) for c, s in ((cos, sin), local_rope or (cos, sin))]
        floats = [decode.work_floats(tables.seq_lens, tables.plan, config.num_q_heads, config.head_dim)]
        floats += [decode.work_floats(groups[1].seq_lens, None, config.num_q_heads, config.head_dim, window) for window in self._windows]
        work = torch.empty(max(*floats, 1), dtype=torch.float32)
        timed = self.phase_seconds
        if timed is not None and (timed.dtype != torch.float64 or timed.device.type != "cpu" or timed.numel() != len(self.PHASES) or not timed.is_contiguous()):
            raise ValueError(f"phase_seconds must be a contiguous float64 CPU tensor of {len(self.PHASES)} values")
        scratch = _Scratch(**{name: t.data_ptr() for name, t in buffers.items()}, work=work.data_ptr(), phase_seconds=_pointer(timed))
        shape = _Shape(
            rows=rows, hidden=config.hidden_size, intermediate=config.intermediate_size, num_q_heads=config.num_q_heads,
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, page_size=k_caches[0].shape[1],
            num_threads=torch.get_num_threads(), eps=config.rms_norm_eps, scale=self.layers[0].self_attn.scale,
            kv_kind=decode.widened_kind(x.dtype, k_caches[0].dtype), gemma=int(config.gemma_norms),
            split_rows=int(self.splits_rows()), **self._kernel_ids(x.dtype),
        )  # fmt: skip
        pair = lambda values: (_p * 2)(*values)  # noqa: E731
        slots = [group.slot_mapping.to(torch.int64).contiguous() for group in groups]
        step = _Step(
            cos=pair(c.data_ptr() for c, _ in rotations), signed_sin=pair(s.data_ptr() for _, s in rotations),
            slots=pair(t.data_ptr() for t in slots), page_table=pair(g.page_table.data_ptr() for g in groups),
            page_table_stride=(ctypes.c_int64 * 2)(*(g.page_table.stride(0) for g in groups)),
            seq_lens=pair(g.seq_lens.data_ptr() for g in groups), plan=pair(_pointer(g.plan) for g in groups),
        )  # fmt: skip
        delta = torch.empty_like(x)
        x = x.contiguous()
        if self._experts_stops and mlp is None:
            raise ValueError("a model with expert layers runs their MLP in the caller: pass mlp")
        # The arguments every call shares, read once: an experts model makes one call a layer.
        first, record = ctypes.addressof(layers), ctypes.sizeof(_Layer)
        shape_p, scratch_p, x_p, step_p = ctypes.addressof(shape), ctypes.addressof(scratch), x.data_ptr(), ctypes.addressof(step)
        run_layers, h = self.library.radixkv_decode_layers, buffers["h"]
        start = 0
        for stop in self._stops:
            status = run_layers(first + start * record, stop - start, int(start == 0), shape_p, scratch_p, x_p, delta.data_ptr(), step_p)
            if status != 0:
                raise RuntimeError("the fused decode kernels refused this model's shapes")
            if stop in self._experts_stops:  # the call left the experts' input in h
                delta = mlp(stop - 1, h)
                assert delta.dtype == x.dtype and delta.shape == x.shape and delta.is_contiguous()
            start = stop
        return x, delta

    def _kernel_ids(self, dtype: torch.dtype) -> dict[str, int]:
        """_Shape's linear_kernel and quant_kernel: a quantized model's linear_kernel names only
        its dtype (AVX2's id runs the fp32 row ops and attention, a bf16 kernel's the bf16 ones)."""
        down = self.layers[0].self_attn.o_proj  # every layer has one; an experts layer no down_proj
        if isinstance(down, QuantLinear):
            dtype_id = NATIVE_LINEAR_KERNELS["avx2" if dtype == torch.float32 else "avx512_bf16"][0]
            return dict(linear_kernel=dtype_id, quant_kernel=down.kernel_bit)
        return dict(linear_kernel=down.kernel_bit, quant_kernel=0)

    def _bind(
        self, k_caches: list[Tensor], v_caches: list[Tensor], k_scales: list[Tensor] | None, v_scales: list[Tensor] | None
    ) -> ctypes.Array:
        """The layer records, built once per set of caches (the pool's tensors never move)."""
        key = tuple(cache.data_ptr() for cache in (*k_caches, *v_caches))  # window layers' caches lie in their own pool
        if self._layers is None or self._caches != key:
            records = []
            no_scales = [None] * len(k_caches)
            for layer, k_cache, v_cache, k_scale, v_scale in zip(
                self.layers, k_caches, v_caches, k_scales or no_scales, v_scales or no_scales, strict=True
            ):
                if k_cache.dtype == torch.int8:
                    decode.check_scales(k_cache, k_scale, v_scale)
                attn, mlp, dense = layer.self_attn, layer.mlp, _dense(layer)
                norms = {name: _pointer(_norm(layer, attr)) for name, attr in _NORMS.items()}
                records.append(_Layer(
                    input_norm=layer.input_layernorm.weight.data_ptr(), post_norm=layer.post_attention_layernorm.weight.data_ptr(),
                    qkv=_packed(attn.qkv_proj).data_ptr(), o=_packed(attn.o_proj).data_ptr(),
                    gate_up=_packed(mlp.gate_up_proj).data_ptr() if dense else None,
                    down=_packed(mlp.down_proj).data_ptr() if dense else None,
                    qkv_bias=_pointer(_bias(attn.qkv_proj)), o_bias=_pointer(_bias(attn.o_proj)),
                    k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
                    k_scales=_pointer(k_scale), v_scales=_pointer(v_scale),
                    formats=(ctypes.c_int * 4)(*(getattr(linear, "format_id", 0) for linear in _linears(layer))),
                    **norms, window=attn.window or 0, group=int(attn.window is not None), rope=int(layer.local_rope),
                ))  # fmt: skip
            self._layers, self._caches = (_Layer * len(records))(*records), key
        return self._layers


def _pointer(tensor: Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


# _Layer's optional norms and the modules holding them: Gemma's four, Qwen3's q/k ones (a Llama
# layer has none of them).
_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
          "pre_ff_norm": "pre_feedforward_layernorm", "post_ff_norm": "post_feedforward_layernorm"}  # fmt: skip


def _norm(layer: torch.nn.Module, path: str) -> Tensor | None:
    """The weight of the norm at `path` in layer, None where the layer has none."""
    module = layer
    for part in path.split("."):
        module = getattr(module, part, None)
    return None if module is None else module.weight
