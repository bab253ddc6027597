"""Turns each request's last-token logits into its next token, for the whole batch in one pass.

Greedy rows take the argmax; sampled rows apply temperature (and top-k and top-p where asked,
over sorted logits) on the logits' device and draw by the inverse CDF with one uniform number
from each sequence's own generator, so a seeded request is reproducible in any batch. The only
host sync is the final transfer of the token ids (with the logprobs of the rows that ask for
them). Guided rows are masked to their grammar's allowed tokens first, then a request's
logit_bias is added and, before its min_tokens, its end tokens are barred; logprobs are of the
raw logits. `sample_batch` falls back to row by row when the batch fails, so a row that cannot be
sampled fails its own request only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixkv.cpu.logits import argmax_rows
from radixkv.engine.guide import GuideMasks
from radixkv.engine.request import SequenceState
from radixkv.engine.request_output import TokenLogprob
from radixkv.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self, base_seed: int | None = None, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.base_seed = base_seed
        self.eos_token_ids = eos_token_ids  # barred with a request's stop ids before its min_tokens

    def sample(
        self, logits: torch.Tensor, seqs: Sequence[SequenceState], masks: GuideMasks | None = None
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: [len(seqs), vocab] fp32, masked in place where `masks` has a row. Returns one
        token id per sequence, and per sequence its TokenLogprob (None where it asks for none;
        an empty list when no sequence asks)."""
        logprob_rows = [row for row, seq in enumerate(seqs) if seq.params.logprobs is not None]
        # Before the masks: logprobs are the model's, not the grammar's.
        logprobs = torch.log_softmax(logits[logprob_rows].float(), dim=-1) if logprob_rows else None
        if masks is not None:
            masks.apply(logits)
        steered = [row for row, seq in enumerate(seqs) if seq.params.steers_logits]
        if steered:
            # The logits are the forward's (inference tensors): only changed in place under it.
            with torch.inference_mode():
                for row in steered:
                    self._steer(logits[row], seqs[row])
        tokens = greedy_tokens(logits)
        rows = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
        if rows:
            drawn = self._draw(logits[rows], [seqs[row] for row in rows])
            tokens = tokens.index_copy(0, torch.tensor(rows, device=logits.device), drawn)
        if logprobs is None:
            return tokens.tolist(), []
        return _with_logprobs(tokens, logprobs, logprob_rows, seqs)

    def sample_batch(
        self, logits: torch.Tensor, seqs: Sequence[SequenceState], masks: GuideMasks | None = None
    ) -> tuple[list[int], list[TokenLogprob | None], dict[int, BaseException]]:
        """`sample` over the batch at once; if that fails, row by row, so only the rows that
        fail lose their request: (tokens, logprobs as `sample` gives them, the failed rows with
        why; a failed row's token is a placeholder 0). Row by row, a guided row's mask is
        applied to the logits first, so its logprobs are of the masked logits (this fallback only)."""
        try:
            tokens, logprobs = self.sample(logits, seqs) if masks is None else self.sample(logits, seqs, masks)
            return tokens, logprobs, {}
        except Exception:  # noqa: BLE001 - find the row at fault below
            if masks is not None:
                with torch.inference_mode():
                    masks.apply(logits)  # may have been applied already: masking twice is a no-op
        tokens = []
        logprobs: list[TokenLogprob | None] = []
        failed: dict[int, BaseException] = {}
        for row, seq in enumerate(seqs):
            try:
                row_tokens, row_logprobs = self.sample(logits[row : row + 1].clone(), [seq])
            except Exception as error:  # noqa: BLE001 - this row's request fails, alone
                failed[row] = error
                row_tokens, row_logprobs = [0], []
            tokens.append(row_tokens[0])
            logprobs.append(row_logprobs[0] if row_logprobs else None)
        return tokens, logprobs if any(lp is not None for lp in logprobs) else [], failed

    def _steer(self, logits: torch.Tensor, seq: SequenceState) -> None:
        """One row's logit_bias, then its end tokens barred while it is short of min_tokens
        (in place). A bar that would leave the row no token (a grammar that allows only its
        end) is lifted: the request ends short rather than drawing a token nothing allowed."""
        params = seq.params
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), device=logits.device)
            logits.index_add_(0, ids, torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device))
        if len(seq.output_token_ids) < params.min_tokens:
            barred = torch.tensor(sorted({*self.eos_token_ids, *params.stop_token_ids}), dtype=torch.long, device=logits.device)
            kept = logits[barred].clone()
            logits[barred] = float("-inf")
            if not torch.isfinite(logits).any():
                logits[barred] = kept

    def _draw(self, logits: torch.Tensor, seqs: list[SequenceState]) -> torch.Tensor:
        vocab = logits.shape[-1]
        # Rows with neither top-k nor top-p draw over the vocabulary as it is: sorting a
        # vocabulary's logits for every row costs far more than the draw.
        # Which way a row goes depends on its own parameters only, so a seed still gives the
        # same tokens in any batch.
        filtered = [i for i, seq in enumerate(seqs) if 0 < seq.params.top_k < vocab or seq.params.top_p < 1.0]
        if not filtered:
            return self._pick(_tempered_probs(logits, seqs), seqs)
        if len(filtered) == len(seqs):
            probs, order = sorted_filtered_probs(logits, [seq.params for seq in seqs])
            return order.gather(-1, self._pick(probs, seqs).unsqueeze(-1)).squeeze(-1)
        chosen = set(filtered)
        plain = [i for i in range(len(seqs)) if i not in chosen]
        drawn = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        for rows in (plain, filtered):
            index = torch.tensor(rows, device=logits.device)
            drawn.index_copy_(0, index, self._draw(logits[index], [seqs[i] for i in rows]))
        return drawn

    def _pick(self, probs: torch.Tensor, seqs: list[SequenceState]) -> torch.Tensor:
        """Per row, a position drawn from p by its inverse CDF: one uniform number per row from
        the sequence's own generator (the whole vocabulary of exponential noise cost ~40 ms a
        32-row step). The sums run in float64, so the long tail's mass stays where it is."""
        uniform = torch.stack([torch.rand(1, generator=self._generator(seq), dtype=torch.float64) for seq in seqs])
        cdf = probs.double().cumsum(dim=-1)
        target = uniform.to(probs.device) * cdf[:, -1:]
        # right=True: the first position whose cumulative mass exceeds the target, which never
        # lands on a zero-probability token.
        picks = torch.searchsorted(cdf, target, right=True).squeeze(-1)
        return picks.clamp_(max=probs.shape[-1] - 1)

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


def _with_logprobs(
    tokens: torch.Tensor, logprobs: torch.Tensor, logprob_rows: list[int], seqs: Sequence[SequenceState]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """Tokens and the asked-for logprobs, gathered on the device and brought over in one
    transfer: float64 holds both the token ids and the fp32 logprobs exactly."""
    num_seqs, num_rows = len(seqs), len(logprob_rows)
    k = max(seqs[row].params.logprobs or 0 for row in logprob_rows)
    chosen = logprobs.gather(1, tokens[logprob_rows].unsqueeze(1)).squeeze(1)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    packed = torch.cat([tokens.double(), chosen.double(), top_values.double().flatten(), top_ids.double().flatten()]).tolist()
    token_ids = [int(t) for t in packed[:num_seqs]]
    values = packed[num_seqs + num_rows : num_seqs + num_rows + num_rows * k]
    ids = packed[num_seqs + num_rows + num_rows * k :]
    result: list[TokenLogprob | None] = [None] * num_seqs
    for i, row in enumerate(logprob_rows):
        own_k = seqs[row].params.logprobs or 0
        top = [(int(ids[i * k + j]), values[i * k + j]) for j in range(own_k)]
        result[row] = TokenLogprob(token_ids[row], packed[num_seqs + i], top)
    return token_ids, result


def _tempered_probs(logits: torch.Tensor, seqs: list[SequenceState]) -> torch.Tensor:
    temperature = torch.tensor([seq.params.temperature for seq in seqs], device=logits.device).unsqueeze(1)
    return torch.softmax(logits.float() / temperature, dim=-1)


# Candidates sorted first: a nucleus or top-k within them spares sorting the whole vocabulary.
CANDIDATES = 256


def sorted_filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities after temperature, top-k and top-p, sorted descending per row; the token
    id at each sorted position). logits: [rows, vocab], one SamplingParams per row.

    Where every row's kept set lies within its CANDIDATES most likely tokens (a top-k of at
    most that many, or a nucleus those tokens' mass reaches), only they are sorted (sorting all
    49k logits a row cost ~50 ms a 32-row step): the rest of the vocabulary stands behind them
    as one column holding its total mass, so the probabilities are the full vocabulary's, and
    that column is always cut."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    scaled = logits.float() / temperature
    vocab = scaled.shape[-1]
    if vocab > CANDIDATES + 1:
        top, candidates = scaled.topk(CANDIDATES, dim=-1)
        total = torch.logsumexp(scaled, dim=-1, keepdim=True)
        mass = torch.exp(torch.logsumexp(top, dim=-1, keepdim=True) - total).clamp(max=1.0)
        fits = [
            0 < p.top_k <= CANDIDATES or (not 0 < p.top_k < vocab and p.top_p < 1.0 and m >= p.top_p)
            for p, m in zip(params, mass.squeeze(1).tolist(), strict=True)
        ]
        if all(fits):
            rest = total + torch.log1p(-mass)  # log of the mass behind the candidates
            # The rest's column names a token outside the candidates (the least likely): it is
            # never drawn, and scattering it back writes that token's true 0.
            order = torch.cat([candidates, scaled.argmin(dim=-1, keepdim=True)], dim=-1)
            return _filter_sorted(torch.cat([top, rest], dim=-1), order, params)
    scaled, order = torch.sort(scaled, dim=-1, descending=True)
    return _filter_sorted(scaled, order, params)


def _filter_sorted(scaled: torch.Tensor, order: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k and top-p over logits sorted descending (all of the vocabulary, or a prefix of it
    holding every token either filter keeps), as probabilities of the whole vocabulary."""
    device = scaled.device
    width = scaled.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < width else width for p in params], device=device).unsqueeze(1)
    ranks = torch.arange(width, device=device).unsqueeze(0)
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


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, int64: the first of equal maxima, a NaN above every number (torch's
    max semantics). fp32 rows on CPU take the native kernel (radixkv/cpu/csrc/logits.c, ~10x
    torch on a 32 x 49k step); elsewhere max().indices, which is argmax at ~2.5x its speed."""
    tokens = argmax_rows(logits)
    return tokens if tokens is not None else logits.max(dim=-1).indices
