"""What computing tokens costs this engine, learnt from its own steps: forward seconds as
a * tokens + b * (context the tokens attend to), fitted by least squares. The disk tier asks it
whether reading a run of blocks beats computing them at their positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixkv.engine.request import Batch

# Too few tokens say more about the step's fixed costs than about tokens.
_MIN_TOKENS = 256


class ComputeCost:
    """A running least-squares fit of seconds = a * tokens + b * attended over every step (both
    sums kept as 2x2 normal equations: O(1) per step, nothing stored). Attention makes a token
    at position p cost more the larger p is, so a run's cost depends on where it lies, not only
    on its length; b carries that. Where the fit is not yet determined (every step alike) or
    comes out negative, b is 0 and a the mean seconds per token."""

    def __init__(self) -> None:
        self._tt = self._ta = self._aa = self._ts = self._as = 0.0
        self._tokens = 0
        self._seconds = 0.0

    def observe_batch(self, batch: Batch, forward_s: float) -> None:
        """What a step's forward over `batch` cost; before the batch is committed."""
        num_attended = sum(attended(item.seq.num_computed_tokens, item.num_new_tokens) for item in batch.items)
        self.observe(batch.num_tokens, num_attended, forward_s)

    def observe(self, num_tokens: int, num_attended: int, seconds: float) -> None:
        """One step: tokens computed, the sum over them of the positions they attend to
        (context length each), forward seconds."""
        t, a = float(num_tokens), float(num_attended)
        self._tt += t * t
        self._ta += t * a
        self._aa += a * a
        self._ts += t * seconds
        self._as += a * seconds
        self._tokens += num_tokens
        self._seconds += seconds

    def coefficients(self) -> tuple[float, float] | None:
        """(seconds per token, seconds per attended position), None until enough has run."""
        if self._tokens < _MIN_TOKENS:
            return None
        det = self._tt * self._aa - self._ta * self._ta
        if det > 1e-9 * self._tt * self._aa:
            per_token = (self._ts * self._aa - self._as * self._ta) / det
            per_attended = (self._tt * self._as - self._ta * self._ts) / det
            if per_token > 0 and per_attended >= 0:
                return per_token, per_attended
        return self._seconds / self._tokens, 0.0

    def estimate_s(self, start_token: int, num_tokens: int) -> float | None:
        """Seconds to compute tokens [start_token, start_token + num_tokens) of a sequence."""
        fit = self.coefficients()
        if fit is None:
            return None
        per_token, per_attended = fit
        return per_token * num_tokens + per_attended * attended(start_token, num_tokens)


def attended(start_token: int, num_tokens: int) -> int:
    """Positions attended to by tokens start..start+n-1 (token p attends to p + 1)."""
    return num_tokens * start_token + num_tokens * (num_tokens + 1) // 2
