"""Linear and embedding layers over quantized weights (radixkv.cpu.quant.QuantWeight) that stay
quantized: QuantLinear multiplies them with activations quantized per block of 32 to int8, in
a native kernel (radixkv/cpu/csrc/quant_linear.c: AVX2, AVX-512 VNNI on 256-bit records;
quant_linear_zmm.c: 512-bit VNNI on 16-row records) or in torch.

A CPU decode step reads every weight once, so its time is the weights' bytes over the memory's
bandwidth: 9 (q8_0) or 6 (q4_1) bits a weight as packed, instead of fp32's 32. Every kernel
computes the same numbers bit for bit (the order of operations below), so the choice is one of
speed only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from radixkv.config import QUANT_KERNELS
from radixkv.cpu import native
from radixkv.cpu.features import cpu_features
from radixkv.cpu.quant import BLOCK, KERNEL_FORMATS, QuantWeight, as_kernel_format, dequantize, q6_k_parts, quantize_q8_0, stack_rows, unpack_q4
from radixkv.errors import ConfigError

# The native kernels of EngineConfig.quant_kernel, fastest first ("auto" takes the first that
# runs here), each with its bit in radixkv_quant_linear_kernels() and the CPU features it needs
# (for messages and test skips).
NATIVE_QUANT_KERNELS = {
    "amx_int8": (1, ("amx_int8", "amx_tile")),
    "avx512_vnni_zmm": (8, ("avx512f", "avx512bw", "avx512_vnni")),
    "avx512_vnni": (2, ("avx512_vnni", "avx512vl", "avx512bw")),
    "avx2": (4, ("avx2",)),
}
FORMAT_IDS = {"q8_0": 0, "q4_1": 1, "q4_k": 2, "q6_k": 3, "parts": 15}
# Records with fp16 scales and mins (q8_0h, q4_1h; quant_linear.c's and quant_linear_zmm.c's
# layouts alike): a weight whose scales and mins are all fp16 (a GGUF's Q8_0, Q5_0, Q4_0, Q4_1)
# keeps the file's 8.5 and 5 bits a weight, not 9 and 6, in the layouts that have them.
HALF_SCALE_IDS = {"q8_0": 4, "q4_1": 5}
_HALF_SCALE_LAYOUTS = ("avx512_vnni_zmm", "avx512_vnni", "avx2")
# The formats each kernel multiplies; a weight in another is taken in as_kernel_format's form.
# "parts": a linear whose row ranges differ in format (a Q4_K_M file's Q4_K q and k beside its
# Q6_K v), packed one after another behind a header, each part run in its own format.
_FORMATS = {"avx512_vnni_zmm": KERNEL_FORMATS, "torch": KERNEL_FORMATS}
_BASE_FORMATS = ("q8_0", "q4_1", "q6_k")  # the 256-bit kernels: q4_k as q4_1 (the same bits)
_PARTS_HEADER_ALIGN = 64
# Output rows of a packed group in every native layout (quant_linear.c's 8, quant_linear_zmm.c's 16).
_PACK_ROWS = 16
# Kernels whose packed records are their own (quant_linear_zmm.c), with the prefix of the
# library's pack, packed-bytes and dequant-rows functions; the others share quant_linear.c's.
_LAYOUTS = {"avx512_vnni_zmm": "radixkv_quant_zmm_"}
# Rows of x per torch-path chunk: bounds the [rows, out] temporaries of a long prefill.
_TORCH_ROWS = 256


def available_quant_kernels() -> tuple[str, ...]:
    """The native quantized kernels that run here (library built, CPU feature present), fastest first."""
    library = native.load()
    if library is None or not hasattr(library, "radixkv_quant_linear_kernels"):
        return ()
    bits = library.radixkv_quant_linear_kernels()
    return tuple(name for name, (bit, _) in NATIVE_QUANT_KERNELS.items() if bits & bit)


def missing_quant_kernel(name: str) -> str:
    """Why quantized kernel `name` does not run here ("" where it does), naming the missing piece."""
    if name == "torch" or name in available_quant_kernels():
        return ""
    if native.load() is None:
        return "the native kernels did not build (no C compiler, or not Linux)"
    flags = cpu_features().flags
    missing = [feature for feature in NATIVE_QUANT_KERNELS[name][1] if feature not in flags]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if name == "amx_int8":
        return "radixkv has no AMX-INT8 quantized kernel yet"
    return f"the native library reports no {name} kernel on this CPU"


def resolve_quant_kernel(requested: str, native_kernels: bool = True) -> str:
    """The kernel EngineConfig.quant_kernel stands for: 'auto' -> the fastest native kernel that
    runs here, else 'torch'; a named native kernel that cannot run here is a ConfigError."""
    if requested not in QUANT_KERNELS:
        raise ConfigError(f"quant_kernel must be one of {QUANT_KERNELS}, got {requested!r}", param="quant_kernel")
    if requested == "torch" or (requested == "auto" and not native_kernels):
        return "torch"
    if requested == "auto":
        return next(iter(available_quant_kernels()), "torch")
    if not native_kernels:
        raise ConfigError(f"quant_kernel={requested!r} is a native kernel, and native_kernels is False", param="quant_kernel")
    reason = missing_quant_kernel(requested)
    if reason:
        raise ConfigError(f"quant_kernel={requested!r} cannot run here: {reason}", param="quant_kernel")
    return requested


def kernel_formats(kernel: str) -> tuple[str, ...]:
    """The QuantWeight formats a resolved kernel multiplies as they are ("parts": linears of
    parts in several formats). A library built from sources before q4_k, q6_k and parts (one
    without radixkv_quant_super_blocks, e.g. main's in scenarios/quant_ab.py) takes q8_0 and q4_1."""
    if kernel == "torch":
        return (*KERNEL_FORMATS, "parts")
    library = native.load()
    if library is None or not hasattr(library, "radixkv_quant_super_blocks"):
        return ("q8_0", "q4_1")
    return (*_FORMATS.get(kernel, _BASE_FORMATS), "parts")


def quantize_activations(x: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """fp32 x [m, k] -> (int8-valued fp32 quants [m, k], fp32 scales [m, k // block]): per row and
    block of 32 (or `block`), scale = absmax / 127, inverse = 1 / scale (0 for an all-zero block),
    q = round_half_even(x * inverse) (a product, then the rounding), as the C kernels do."""
    blocks = x.reshape(x.shape[0], -1, block)
    scales = blocks.abs().amax(dim=-1) / torch.tensor(127.0)
    inverse = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round(blocks * inverse.unsqueeze(-1)).clamp_(-127.0, 127.0)
    return q.reshape(x.shape), scales


def torch_quant_linear(x: Tensor, weight: QuantWeight, bias: Tensor | None) -> Tensor:
    """y = x W^T (+ b) in fp32 for fp32 x [m, k], the reference every kernel matches bit for bit.

    With x's quants xq and scales sx (quantize_activations), W's quants q, scales s and mins
    (q4_1), for each output (r, o) an fp32 sum starts at 0 and takes the blocks b in order:
        i = sum_j q[o, 32b + j] * xq[r, 32b + j]   (an integer, exact)
        acc = acc + (s[o, b] * sx[r, b]) * float(i)        (two rounded products, then the sum)
        q4_1: acc = acc + mins[o, b] * (sx[r, b] * float(sum_j xq[r, 32b + j]))
    then y = acc + bias[o] (fp32), rounded once to the output dtype by the caller. No fused
    multiply-adds anywhere: each step rounds as written, so any kernel that keeps this order per
    output gets the same bits whatever rows it is called with.
    q4_k runs as its q4_1 form (the same numbers); q6_k as q8_0's steps with the integer weights
    w = sc * (q - 32) (sc: the int8 scale of each 16 inputs) and scale d per block: the block's
    integer sum stays below 2^24 (32 * 128 * 32 * 127), so fp32 holds it exactly."""
    if weight.format == "q4_k":
        weight = as_kernel_format(weight)
    m, out_features = x.shape[0], weight.out_features
    if weight.format == "q6_k":
        q, sc, d = q6_k_parts(weight)
        quants = q.to(torch.int16) * sc.to(torch.int16).repeat_interleave(16, dim=1)
        scales, mins = d.repeat_interleave(256 // BLOCK, dim=1), None
    else:
        scales = weight.scales.float()
        mins = None if weight.mins is None else weight.mins.float()
        quants = weight.quants if weight.format == "q8_0" else unpack_q4(weight.quants)
    y = torch.empty(m, out_features, dtype=torch.float32)
    for r0 in range(0, m, _TORCH_ROWS):
        xq, sx = quantize_activations(x[r0 : r0 + _TORCH_ROWS])
        xq_blocks = xq.reshape(xq.shape[0], -1, BLOCK)
        acc = torch.zeros(xq.shape[0], out_features, dtype=torch.float32)
        for b in range(weight.in_features // BLOCK):
            # Products of integers below 2^8 summed 32 at a time stay below 2^24: fp32 is exact.
            dots = xq_blocks[:, b] @ quants[:, b * BLOCK : (b + 1) * BLOCK].float().T
            acc = acc + (sx[:, b : b + 1] * scales[:, b]) * dots
            if mins is not None:
                acc = acc + mins[:, b] * (sx[:, b : b + 1] * xq_blocks[:, b].sum(dim=-1, keepdim=True))
        y[r0 : r0 + _TORCH_ROWS] = acc
    return y if bias is None else y + bias.float()


def _half_scaled(weight: QuantWeight) -> bool:
    """Whether a q8_0 or q4_1 weight's scales and mins are fp16 (QuantWeight keeps them so
    where every one is exact)."""
    halves = weight.scales.dtype == torch.float16 and (weight.mins is None or weight.mins.dtype == torch.float16)
    return weight.format in HALF_SCALE_IDS and halves


class QuantLinear(nn.Module):
    """y = x W^T (+ b) for 2-D fp32 or bf16 x (y in x's dtype), W a QuantWeight held once: in
    the native kernel's packed layout where one runs, else as given.

    kernel: a name of QUANT_KERNELS ("auto" resolves; see resolve_quant_kernel). Every kernel
    computes torch_quant_linear's bits, so rows_independent holds for all of them.
    """

    rows_independent = True

    def __init__(self, weight: QuantWeight | list[QuantWeight], bias: Tensor | None = None, kernel: str = "auto") -> None:
        super().__init__()
        self.kernel = resolve_quant_kernel(kernel)
        # Parts (row ranges, stacked in order) in a format the kernel lacks take their kernel
        # form; parts then sharing a format are one weight, else the linear is "parts".
        parts = [weight] if isinstance(weight, QuantWeight) else list(weight)
        formats = kernel_formats(self.kernel)
        parts = [w if w.format in formats else as_kernel_format(w) for w in parts]
        if len({w.format for w in parts}) > 1 and "parts" not in formats:
            # One format then: q8_0 holds a 4-bit part to within half an int8 step of its block's largest.
            parts = [w if w.format == "q8_0" else quantize_q8_0(dequantize(w)) for w in parts]
        one_format = len({w.format for w in parts}) == 1
        self._library = native.load() if self.kernel != "torch" else None
        # One format packs part by part into its rows' records where each part ends on a group
        # boundary (the records are the same bytes): no stacked copy beside the parts at load.
        if one_format and (self._library is None or any(w.out_features % _PACK_ROWS for w in parts[:-1])):
            parts = [stack_rows(parts)]
        part_ids = self._part_format_ids(parts, one_format)
        parts = [w if i in HALF_SCALE_IDS.values() else w.with_float_scales() for w, i in zip(parts, part_ids, strict=True)]
        self.in_features, self.out_features = parts[0].in_features, sum(w.out_features for w in parts)
        self.format = parts[0].format if one_format else "parts"
        # The id the kernels take (quant_linear.c's FORMAT_*, quant_linear_zmm.c's ZFORMAT_*).
        self.format_id = part_ids[0] if one_format else FORMAT_IDS["parts"]
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().contiguous(), requires_grad=False)
        if self._library is None:
            self.weight: QuantWeight | None = parts[0] if len(parts) == 1 else None
            self._torch_parts: list[QuantWeight] | None = parts
            self.packed = None
        else:
            self.weight, self._torch_parts = None, None  # held once: the packed form alone
            self.kernel_bit = NATIVE_QUANT_KERNELS[self.kernel][0]
            self._layout = _LAYOUTS.get(self.kernel, "radixkv_quant_")
            # A buffer, so the module's buffers() count the bytes; not persistent: the layout is this build's.
            self.register_buffer("packed", self._pack(parts, part_ids), persistent=False)

    def _part_format_ids(self, parts: list[QuantWeight], one_format: bool) -> list[int]:
        """Each part's packed format: with fp16 scales where the layout has them and the part's
        scales (and mins) are all fp16, else its own; one format's parts all alike (their
        records are one weight's)."""
        layout = self._library is not None and self.kernel in _HALF_SCALE_LAYOUTS
        ids = [HALF_SCALE_IDS[w.format] if layout and _half_scaled(w) else FORMAT_IDS[w.format] for w in parts]
        return [FORMAT_IDS[parts[0].format]] * len(parts) if one_format and len(set(ids)) > 1 else ids

    @property
    def weight_nbytes(self) -> int:
        return sum(w.nbytes for w in self._torch_parts) if self.packed is None else self.packed.nbytes

    def _pack(self, parts: list[QuantWeight], part_ids: list[int]) -> Tensor:
        """The parts' records: of one format, their rows' records as one weight's; else one
        part after another behind a header of int64s (count, then format, rows and byte offset
        per part) that quant_linear.c reads."""
        library = self._library
        packed_bytes = getattr(library, self._layout + "packed_bytes")
        if self.format != "parts":  # rows stacked: each part's records where its first row's group starts
            fmt, done, offsets = part_ids[0], 0, []
            for w in parts:
                offsets.append(packed_bytes(fmt, done, self.in_features))
                done += w.out_features
            packed = torch.zeros(packed_bytes(fmt, done, self.in_features), dtype=torch.uint8)
            for w, fmt_id, at in zip(parts, part_ids, offsets, strict=True):
                self._pack_part(w, fmt_id, packed, at)
            return packed
        sizes = [packed_bytes(fmt_id, w.out_features, w.in_features) for w, fmt_id in zip(parts, part_ids, strict=True)]
        header = 0 if len(parts) == 1 else -(-8 * (1 + 3 * len(parts)) // _PARTS_HEADER_ALIGN) * _PARTS_HEADER_ALIGN
        offsets = []
        for size in sizes:
            offsets.append(header + sum(-(-s // _PARTS_HEADER_ALIGN) * _PARTS_HEADER_ALIGN for s in sizes[: len(offsets)]))
        packed = torch.zeros(offsets[-1] + sizes[-1], dtype=torch.uint8)
        if header:
            fields = [len(parts)] + [v for w, fmt_id, at in zip(parts, part_ids, offsets, strict=True) for v in (fmt_id, w.out_features, at)]
            packed[: 8 * len(fields)] = torch.tensor(fields, dtype=torch.int64).view(torch.uint8)
        for w, fmt_id, at in zip(parts, part_ids, offsets, strict=True):
            self._pack_part(w, fmt_id, packed, at)
        return packed

    def _pack_part(self, w: QuantWeight, format_id: int, packed: Tensor, at: int) -> None:
        mins = 0 if w.mins is None else w.mins.data_ptr()
        getattr(self._library, self._layout + "pack")(
            format_id, w.quants.data_ptr(), w.scales.data_ptr(), mins, w.out_features, w.in_features, packed.data_ptr() + at
        )

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features or x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"expected fp32 or bf16 input [rows, {self.in_features}], got {x.dtype} {tuple(x.shape)}")
        if self.packed is None:
            y = torch.cat([torch_quant_linear(x.float(), w, None) for w in self._torch_parts], dim=1)
            return (y if self.bias is None else y + self.bias).to(x.dtype)
        if x.stride(1) != 1:
            x = x.contiguous()
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        bias = None if self.bias is None else self.bias.data_ptr()
        status = self._library.radixkv_quant_linear(
            self.kernel_bit, self.format_id, x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), x.shape[0],
            self.in_features, self.packed.data_ptr(), self.out_features, bias, y.data_ptr(), y.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise RuntimeError(f"the {self.kernel} quantized linear kernel does not run on this CPU")
        return y

    def weight_rows(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows `ids` of the dequantized weight (fp32 as dequantize() computes it, then `dtype`):
        a tied embedding's lookup, from this layer's own bytes."""
        ids = ids.reshape(-1).to(torch.long)
        if self.format == "parts":
            raise ValueError("a linear whose parts differ in format is no tied embedding")
        if self.packed is None:
            return dequantize(self.weight, ids).to(dtype)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise IndexError(f"row ids must be in [0, {self.out_features}), got {ids.min()}..{ids.max()}")
        rows = torch.empty(ids.numel(), self.in_features, dtype=torch.float32)
        getattr(self._library, self._layout + "dequant_rows")(
            self.format_id, self.packed.data_ptr(), self.out_features, self.in_features, ids.data_ptr(), ids.numel(), rows.data_ptr()
        )
        return rows.to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, bias={self.bias is not None}, kernel={self.kernel}"


class QuantEmbedding(nn.Module):
    """Token embedding over a QuantWeight, or over a QuantLinear's weight when the model ties its
    lm_head to the embedding (then read from the linear's bytes: no second copy)."""

    def __init__(self, source: QuantLinear | QuantWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        if isinstance(source, QuantLinear):
            self.linear: QuantLinear | None = source
            self.quant_weight: QuantWeight | None = None
            self.num_embeddings, self.embedding_dim = source.out_features, source.in_features
        else:
            self.linear, self.quant_weight = None, source
            self.num_embeddings, self.embedding_dim = source.out_features, source.in_features

    @property
    def weight_nbytes(self) -> int:
        """Bytes this module holds itself (0 when tied: the linear holds them)."""
        return 0 if self.quant_weight is None else self.quant_weight.nbytes

    def forward(self, ids: Tensor) -> Tensor:
        if self.linear is not None:
            rows = self.linear.weight_rows(ids, self.dtype)
        else:
            flat = ids.reshape(-1).to(torch.long)
            rows = dequantize(self.quant_weight, flat).to(self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)
