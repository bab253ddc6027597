"""Experts as a layer: the mixture-of-experts block (Qwen3-MoE) that takes a decoder layer's MLP
place: a router, top-k routing, and experts run grouped, so each routed expert's weights are read
once a step however many of the step's tokens picked it, and an expert no token picked is never read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from radixkv.attention.base import AttentionMetadata
from radixkv.cpu import moe as cpu_moe
from radixkv.cpu.quant_linear import QuantLinear
from radixkv.model.row_ops import INVARIANT_GEMM_ROWS, project_rows, silu_mul


@dataclass(slots=True, frozen=True)
class MoEConfig:
    """The routed experts of a model: which layers have them and their shape."""

    num_experts: int
    num_experts_per_tok: int  # top-k
    moe_intermediate_size: int  # each expert's SwiGLU width
    norm_topk_prob: bool  # renormalize the top-k probabilities to sum to 1
    moe_layers: tuple[int, ...]  # layer indices whose MLP is the expert block

    @classmethod
    def from_hf(cls, hf_config: Any, num_layers: int) -> MoEConfig:
        """Qwen3-MoE's fields: layer i is sparse unless listed in mlp_only_layers, and only every
        decoder_sparse_step-th layer ((i + 1) % step == 0), as transformers decides."""
        num_experts = int(hf_config.num_experts)
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        layers = tuple(i for i in range(num_layers) if num_experts > 0 and i not in dense and (i + 1) % step == 0)
        return cls(
            num_experts=num_experts,
            num_experts_per_tok=int(hf_config.num_experts_per_tok),
            moe_intermediate_size=int(hf_config.moe_intermediate_size),
            norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
            moe_layers=layers,
        )


def hf_expert_sources(prefix: str, num_experts: int) -> dict[str, list[str]]:
    """Our expert parameters -> the transformers names concatenated (dim 0) to make them, for a
    layer's `mlp.` prefix: gate_up is [gate_0; up_0; gate_1; up_1; ...], down [down_0; down_1; ...]."""
    experts = [f"{prefix}experts.{e}." for e in range(num_experts)]
    return {
        "experts.gate_up": [name for e in experts for name in (e + "gate_proj.weight", e + "up_proj.weight")],
        "experts.down": [e + "down_proj.weight" for e in experts],
    }


def route(logits: Tensor, top_k: int, norm_topk_prob: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(weights [T, k] in dtype, expert ids [T, k]) as transformers' Qwen3-MoE router: softmax in
    fp32 over all experts, top-k, divided by their sum when norm_topk_prob, then cast."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


@dataclass(slots=True, frozen=True)
class ExpertGroups:
    """A step's (token, slot) pairs bucketed by expert: the pairs of expert experts[g] are
    tokens[offsets[g]:offsets[g + 1]] (ascending) with their routing weights."""

    experts: list[int]  # the routed experts, ascending; the others are not listed
    offsets: list[int]
    tokens: Tensor  # [T * k] token rows, grouped by expert
    weights: Tensor  # [T * k] each pair's routing weight


def group_by_expert(ids: Tensor, weights: Tensor) -> ExpertGroups:
    """Bucket each token's top-k (ids, weights [T, k]) by expert, one stable sort."""
    top_k = ids.shape[1]
    if ids.shape[0] == 1:
        # One token (a decode step): its k experts are distinct, so sorting them in Python gives
        # the general path's groups without its five small tensor ops a layer.
        row = ids[0].tolist()
        order = sorted(range(top_k), key=row.__getitem__)
        picked = torch.tensor(order)
        tokens = torch.zeros(top_k, dtype=torch.long)
        return ExpertGroups([row[i] for i in order], list(range(top_k + 1)), tokens, weights[0][picked])
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs in token order within each expert
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    offsets = [0, *torch.cumsum(counts, 0).tolist()]
    return ExpertGroups(experts.tolist(), offsets, order // top_k, weights.reshape(-1)[order])


class FloatExperts(nn.Module):
    """num_experts SwiGLU MLPs in float, stacked: gate_up [E * 2I, H] (expert e's gate rows then
    its up rows), down [E * H, I]; expert e's weights are one contiguous slice of each."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up = nn.Parameter(torch.empty(num_experts * 2 * intermediate_size, hidden_size))
        self.down = nn.Parameter(torch.empty(num_experts * hidden_size, intermediate_size))
        self.native_fp32 = False  # EngineConfig.moe_kernel="native_fp32": grouped() runs csrc/moe.c's fp32 kernel

    @property
    def grouped_ready(self) -> bool:
        return self.native_fp32 and self.gate_up.dtype == torch.float32 and self.gate_up.device.type == "cpu"

    def grouped(self, x: Tensor, groups: ExpertGroups) -> Tensor:
        """Every routed pair's expert output, fp32 [pairs, H] in groups' order, one native call a
        projection (each expert's rows read once for all its tokens)."""
        size, pairs = self.intermediate_size, groups.tokens.numel()
        x = x.float().contiguous()
        gate_up = torch.empty(pairs, 2 * size)
        weights = self.gate_up.detach().view(self.num_experts, 2 * size, self.hidden_size)
        cpu_moe.native_grouped_f32(weights, x, groups.experts, groups.offsets, groups.tokens, gate_up)
        h = (F.silu(gate_up[:, :size]) * gate_up[:, size:]).contiguous()
        y = torch.empty(pairs, self.hidden_size)
        down = self.down.detach().view(self.num_experts, self.hidden_size, size)
        cpu_moe.native_grouped_f32(down, h, groups.experts, groups.offsets, torch.arange(pairs), y)
        return y

    def project_gate_up(self, expert: int, x: Tensor) -> Tensor:
        """[gate x, up x] of expert `expert` for rows x [n, H]: [n, 2I]."""
        rows = 2 * self.intermediate_size
        return F.linear(x, self.gate_up[expert * rows : (expert + 1) * rows])

    def project_down(self, expert: int, h: Tensor) -> Tensor:
        return F.linear(h, self.down[expert * self.hidden_size : (expert + 1) * self.hidden_size])


class QuantExperts(nn.Module):
    """num_experts SwiGLU MLPs over quantized weights: a QuantLinear for each expert's gate and up
    (stacked rows) and one for its down, each in its own blocks (radixkv.model.quantized builds them)."""

    rows_independent = True  # QuantLinear's rows never depend on the batch

    def __init__(self, gate_up: Sequence[QuantLinear], down: Sequence[QuantLinear]) -> None:
        super().__init__()
        assert len(gate_up) == len(down) and gate_up
        self.num_experts = len(gate_up)
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)

    def project_gate_up(self, expert: int, x: Tensor) -> Tensor:
        return self.gate_up[expert](x)

    def project_down(self, expert: int, h: Tensor) -> Tensor:
        return self.down[expert](h)


class MappedExperts(nn.Module):
    """num_experts SwiGLU MLPs read in place from a GGUF's stacked experts tensors (a memory map:
    the file's own blocks, never copied), multiplied by csrc/moe.c ("native") or its torch
    reference ("torch"), which compute the same bits; SiLU * up by the native row kernel either way.

    parts: (gate, up, down) as (block type, uint8 view [experts, rows, row bytes])."""

    rows_independent = True  # each output row is computed alone, whatever the batch

    def __init__(self, parts: Sequence[tuple[str, np.ndarray]], hidden_size: int, intermediate_size: int, kernel: str) -> None:
        super().__init__()
        assert kernel in ("native", "torch") and len(parts) == 3
        (self.gate_type, self.gate), (self.up_type, self.up), (self.down_type, self.down) = parts
        self.num_experts = self.gate.shape[0]
        self.hidden_size, self.intermediate_size, self.kernel = hidden_size, intermediate_size, kernel
        self.vnni = True  # the VNNI dot product where compiled in; False: the scalar loop (tests)
        self._row: cpu_moe.RowCalls | None = None  # one_token's calls, built at its first token

    grouped_ready = True

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the file this block reads in place."""
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    def grouped(self, x: Tensor, groups: ExpertGroups) -> Tensor:
        """Every routed pair's expert output, fp32 [pairs, H] in groups' order: gate and up over
        the quantized x, SiLU(gate) * up in fp32, down; each routed expert's rows read once."""
        size, pairs = self.intermediate_size, groups.tokens.numel()
        x = x.float().contiguous()
        gate_up = torch.empty(pairs, 2 * size)
        # The native calls' int32 arguments built once for the three projections.
        ids = (torch.tensor(groups.experts, dtype=torch.int32), torch.tensor(groups.offsets, dtype=torch.int32))
        tokens, order = groups.tokens.to(torch.int32), torch.arange(pairs, dtype=torch.int32)
        self._linear(self.gate_type, self.gate, x, groups, tokens, gate_up[:, :size], ids)
        self._linear(self.up_type, self.up, x, groups, tokens, gate_up[:, size:], ids)
        # The SiLU kernel the one-token call runs (its exp, not torch's), so a token has the
        # same bits alone and in a batch; torch's where the library is not built.
        h = silu_mul(gate_up)
        y = torch.empty(pairs, self.hidden_size)
        self._linear(self.down_type, self.down, h, groups, order, y, ids)
        return y

    def one_token(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor | None:
        """combine's result for one token x [1, H] routed to ids with weights ([1, k]) in one
        native call (cpu.moe.native_row), or None where that path does not run (the torch
        kernel, a dtype other than fp32 or bf16)."""
        if self.kernel != "native" or x.dtype not in (torch.float32, torch.bfloat16):
            return None
        if self._row is None:
            self._row = cpu_moe.RowCalls((self.gate_type, self.up_type, self.down_type), (self.gate, self.up, self.down))
        return self._row(x, ids, weights, self.vnni)  # [1, k] each: the kernels read k values

    def _linear(
        self, type_name: str, weights: np.ndarray, x: Tensor, groups: ExpertGroups, rows: Tensor, out: Tensor, ids: tuple[Tensor, Tensor],
    ) -> None:  # fmt: skip
        if self.kernel == "native":
            cpu_moe.native_grouped(type_name, weights, x, ids[0], ids[1], rows, out, self.vnni)
            return
        for g, expert in enumerate(groups.experts):
            start, stop = groups.offsets[g], groups.offsets[g + 1]
            out[start:stop] = cpu_moe.torch_block_linear(x[rows[start:stop]], type_name, weights[expert], x.shape[1])

    def extra_repr(self) -> str:
        types = f"{self.gate_type}/{self.up_type}/{self.down_type}"
        return f"num_experts={self.num_experts}, types={types}, mapped_bytes={self.mapped_bytes}, kernel={self.kernel}"


class SparseMoE(nn.Module):
    """Router (linear to num_experts), top-k, experts; a decoder layer's MLP.

    forward groups the step's tokens by expert: for each routed expert (ascending), gather its
    tokens, run its MLP on that block, and scatter-add the weighted rows into the output, the
    order transformers sums them in. run_expert is the one place an expert's weights are read.
    """

    def __init__(self, hidden_size: int, moe: MoEConfig, native: bool = True) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.num_experts_per_tok, moe.norm_topk_prob
        self.native = native  # SiLU * up may run as one native call (bf16 on CPU)
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts: FloatExperts | QuantExperts | MappedExperts = FloatExperts(
            moe.num_experts, hidden_size, moe.moe_intermediate_size
        )

    def forward(self, x: Tensor, meta: AttentionMetadata) -> Tensor:
        logits = project_rows(self.gate, x, meta)
        weights, ids = route(logits, self.top_k, self.norm_topk_prob, x.dtype)
        if x.shape[0] == 1 and isinstance(self.experts, MappedExperts):
            # A decode step's one token: no grouping tensors, the sum made in the kernel.
            out = self.experts.one_token(x, ids, weights)
            if out is not None:
                return out
        return self.combine(x, group_by_expert(ids, weights), meta.batch_invariant)

    def combine(self, x: Tensor, groups: ExpertGroups, batch_invariant: bool = False) -> Tensor:
        """sum over each token's routed experts of weight * expert(token), each expert run once."""
        if getattr(self.experts, "grouped_ready", False):
            # One grouped call a projection; pairs added in expert order per token, as below.
            out = torch.zeros_like(x)
            y = self.experts.grouped(x, groups).to(x.dtype)
            out.index_add_(0, groups.tokens, y * groups.weights[:, None])
            return out
        split = batch_invariant and not getattr(self.experts, "rows_independent", False)
        return combine_by_expert(x, groups, self.run_expert, split)

    def run_expert(self, expert: int, x: Tensor) -> Tensor:
        """Expert `expert`'s MLP over rows x [n, H]: down(silu(gate x) * up x)."""
        experts = self.experts
        return experts.project_down(expert, silu_mul(experts.project_gate_up(expert, x), self.native))


def combine_by_expert(x: Tensor, groups: ExpertGroups, run_expert: Callable[[int, Tensor], Tensor], split_rows: bool) -> Tensor:
    """sum over each token's routed experts of weight * run_expert(expert, its tokens' rows),
    each routed expert run once on its block and scatter-added in ascending expert order (the
    order transformers sums them in); split_rows: the block in INVARIANT_GEMM_ROWS-row parts
    (batch-invariant steps over float GEMMs)."""
    out = torch.zeros_like(x)
    for g, expert in enumerate(groups.experts):
        start, stop = groups.offsets[g], groups.offsets[g + 1]
        tokens = groups.tokens[start:stop]
        block = x[tokens]
        if split_rows and block.shape[0] > INVARIANT_GEMM_ROWS:
            y = torch.cat([run_expert(expert, part) for part in block.split(INVARIANT_GEMM_ROWS)])
        else:
            y = run_expert(expert, block)
        out.index_add_(0, tokens, (y * groups.weights[start:stop, None]).to(x.dtype))
    return out
