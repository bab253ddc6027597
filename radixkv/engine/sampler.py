"""Turns each request's last-token logits into its next token, for the whole batch in one pass.

Greedy rows take the argmax; sampled rows apply temperature, top-k and top-p together on the
logits' device and draw by the exponential race (argmax of p / E, E ~ Exp(1)), with the noise
from each sequence's own generator, so a seeded request is reproducible in any batch. The only
host sync is the final transfer of the token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixkv.engine.request import SamplingParams, SequenceState


class Sampler:
    def __init__(self, base_seed: int | None = None) -> None:
        self.base_seed = base_seed

    def sample(self, logits: torch.Tensor, seqs: Sequence[SequenceState]) -> list[int]:
        """logits: [len(seqs), vocab] fp32; returns one token id per sequence."""
        # max().indices is argmax (first of equal maxima) at about 2.5x the speed on CPU.
        tokens = logits.max(dim=-1).indices
        rows = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
        if rows:
            drawn = self._draw(logits[rows], [seqs[row] for row in rows])
            tokens = tokens.index_copy(0, torch.tensor(rows, device=logits.device), drawn)
        return tokens.tolist()

    def _draw(self, logits: torch.Tensor, seqs: list[SequenceState]) -> torch.Tensor:
        probs, order = sorted_filtered_probs(logits, [seq.params for seq in seqs])
        # Each row's noise comes from its own generator, on the CPU (generators are per device).
        noise = torch.stack([torch.empty(logits.shape[-1]).exponential_(generator=self._generator(seq)) for seq in seqs])
        # A zero draw would make 0 / 0 = NaN, which argmax prefers: keep the noise positive.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        picks = (probs / noise.to(probs.device)).argmax(dim=-1, keepdim=True)
        return order.gather(-1, picks).squeeze(-1)

    def _generator(self, seq: SequenceState) -> torch.Generator:
        if seq.generator is None:
            generator = torch.Generator(device="cpu")
            if seq.params.seed is not None:
                # Each continuation of an n > 1 request gets its own stream from the one seed.
                generator.manual_seed((seq.params.seed * 1_000_003 + seq.index) % (1 << 64))
            elif self.base_seed is not None:
                generator.manual_seed((self.base_seed * 1_000_003 + seq.seq_id) % (1 << 64))
            else:
                generator.seed()
            seq.generator = generator
        return seq.generator


def sorted_filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities after temperature, top-k and top-p, sorted descending per row; the token
    id at each sorted position). logits: [rows, vocab], one SamplingParams per row."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    scaled, order = torch.sort(logits.float() / temperature, dim=-1, descending=True)
    vocab = scaled.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device).unsqueeze(1)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    probs = torch.softmax(scaled.masked_fill(ranks >= top_k, float("-inf")), dim=-1)
    if any(p.top_p < 1.0 for p in params):
        # Keep the smallest set whose mass reaches top_p: drop tokens whose preceding mass
        # already exceeds it (the top token always stays). Rows with top_p = 1 keep all, even
        # where rounding lifts their cumulative sum past 1.
        top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device).unsqueeze(1)
        probs = probs.masked_fill((probs.cumsum(-1) - probs) > top_p, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs, order


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's probabilities after temperature, top-k and top-p, in vocabulary order."""
    probs, order = sorted_filtered_probs(logits.unsqueeze(0), [params])
    return torch.zeros_like(probs).scatter_(-1, order, probs).squeeze(0)
