"""Lower bounds on how long a workload can take on this machine: its flops at the measured
matmul rate, its bytes at the measured read bandwidth, whichever is larger, step by step.

A decode step reads every weight once and each request's KV once, and multiplies every weight
once per request; a prefill of the distinct prompt tokens is compute-bound. The counts come from
the model's shapes (radixkv.model.ModelConfig), so no engine needs to run to know them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixkv.model.llama import ModelConfig

# Modules whose tensors a decode step does not read whole: the embedding lookup (a row per
# token) and the rotary tables (a row per position).
NOT_READ_WHOLE = ("embed_tokens", "rope")


@dataclass(frozen=True, slots=True)
class Costs:
    """One model's per-token costs: multiply-adds of its linears (the lm_head included) and,
    per token of context, of one token's attention; bytes of its weights and of one token's KV."""

    linear_params: int
    lm_head_params: int
    attention_macs_per_context_token: int
    weight_bytes: int
    kv_bytes_per_token: int

    @classmethod
    def of(cls, config: ModelConfig, element_bytes: int) -> Costs:
        q, kv = config.num_q_heads * config.head_dim, config.num_kv_heads * config.head_dim
        per_layer = config.hidden_size * (q + 2 * kv) + q * config.hidden_size + 3 * config.hidden_size * config.intermediate_size
        lm_head = config.vocab_size * config.hidden_size
        linear_params = config.num_layers * per_layer + lm_head
        # An untied lm_head is its own tensor; the embedding table is read a row per token only.
        return cls(
            linear_params=linear_params,
            lm_head_params=lm_head,
            attention_macs_per_context_token=2 * q * config.num_layers,  # q.k and p.v
            weight_bytes=linear_params * element_bytes,
            kv_bytes_per_token=2 * kv * config.num_layers * element_bytes,
        )

    def decode_step_flops(self, context_lens: list[int]) -> float:
        return float(sum(2 * self.linear_params + 2 * self.attention_macs_per_context_token * n for n in context_lens))

    def decode_step_bytes(self, context_lens: list[int]) -> float:
        return float(self.weight_bytes + self.kv_bytes_per_token * sum(context_lens))

    def prefill_flops(self, num_tokens: int, num_prompts: int, mean_context: float) -> float:
        """num_tokens computed through the layers, attending to mean_context tokens each, and
        the lm_head for each prompt's last token only."""
        body = self.linear_params - self.lm_head_params
        per_token = 2 * body + 2 * self.attention_macs_per_context_token * mean_context
        return float(num_tokens * per_token + num_prompts * 2 * self.lm_head_params)


def step_bound_s(costs: Costs, context_lens: list[int], read_bytes_per_s: float, flops_per_s: float) -> float:
    """A decode step can go no faster than reading its bytes once or doing its flops at the rate."""
    return max(costs.decode_step_bytes(context_lens) / read_bytes_per_s, costs.decode_step_flops(context_lens) / flops_per_s)


def workload_bound_s(
    costs: Costs,
    prompt_lens: list[int],
    distinct_prompt_tokens: int,
    output_len: int,
    max_num_seqs: int,
    read_bytes_per_s: float,
    flops_per_s: float,
) -> dict:
    """The scenario-level bound: the distinct prompt tokens' flops at the matmul rate, plus each
    decode step's bound, requests decoding max_num_seqs at a time."""
    mean_context = sum(prompt_lens) / len(prompt_lens) / 2
    prefill_s = costs.prefill_flops(distinct_prompt_tokens, len(prompt_lens), mean_context) / flops_per_s
    decode_s = 0.0
    for start in range(0, len(prompt_lens), max_num_seqs):
        batch = prompt_lens[start : start + max_num_seqs]
        for step in range(1, output_len):  # the first output token comes from the prefill
            decode_s += step_bound_s(costs, [n + step for n in batch], read_bytes_per_s, flops_per_s)
    return dict(prefill_bound_s=prefill_s, decode_bound_s=decode_s, bound_s=prefill_s + decode_s)


def weight_bytes_read(model: torch.nn.Module) -> tuple[int, dict[str, int]]:
    """Bytes of the weights a decode step reads whole, as the loaded model holds them (packed,
    quantized), each storage once, and their bytes by dtype (so quantized storage shows as what
    it is). Experts read in place from a file's map are not torch tensors and are not counted."""
    seen: set[int] = set()
    by_dtype: dict[str, int] = {}
    lm_head_ptrs = {t.untyped_storage().data_ptr() for t in _tensors(model.lm_head)} if hasattr(model, "lm_head") else set()
    for name, module in model.named_modules():
        skip = any(part in NOT_READ_WHOLE for part in name.split("."))
        for tensor in _tensors(module, recurse=False):
            ptr = tensor.untyped_storage().data_ptr()
            if ptr in seen or (skip and ptr not in lm_head_ptrs):
                continue
            seen.add(ptr)
            key = str(tensor.dtype).removeprefix("torch.")
            by_dtype[key] = by_dtype.get(key, 0) + tensor.untyped_storage().nbytes()
    return sum(by_dtype.values()), by_dtype


def _tensors(module: torch.nn.Module, recurse: bool = True) -> list[torch.Tensor]:
    found = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
    modules = module.modules() if recurse else [module]
    for owner in modules:  # tensors kept as plain attributes (packed or quantized copies)
        found += [v for v in vars(owner).values() if isinstance(v, torch.Tensor) and v.numel()]
    return [t for t in found if t.device.type == "cpu" and t.numel()]
