"""Why a request missed: the `CacheReport` made once per request at its first admission, from
the match it actually got (RAM, then disk) and the ghost index (cache/ghost.py), and the
counts of reports by reason that /metrics shows. Never looks outside the request's own owner.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixkv.cache.ghost import GhostIndex
from radixkv.cache.hashing import BlockHash, BlockHasher
from radixkv.cache.radix import RadixTree

# Why the first uncached token of a prompt was not served, best answer first:
#   hit               every full block that can be served was (the block of the last token,
#                     whose logits are needed, and a partial last page are always computed)
#   disk_read_skipped the disk tier held the next blocks, and computing them was judged faster
#   evicted           the next block was cached (RAM or disk) and has been evicted since, or
#                     (layer groups) RAM holds it but not the window KV a hit there needs
#   partial_page      the prompt fits in one page, or the next block begins with the partial
#                     last page an earlier sequence computed there (only full pages are cached)
#   another_partition the same API key's other partition (another cache_salt) holds it
#   never_seen        none of the above, as far as this partition can see
MISS_REASONS = ("hit", "never_seen", "evicted", "partial_page", "disk_read_skipped", "another_partition")


@dataclass(frozen=True, slots=True)
class CacheReport:
    """What the cache served a request's prompt at its first admission, in tokens, and why the
    first uncached token was not served (one of MISS_REASONS)."""

    num_prompt_tokens: int
    num_ram_tokens: int  # served from RAM
    num_disk_tokens: int  # read from the disk tier right after them (0 when the read was skipped)
    first_uncached_token: int  # index in the prompt: num_ram_tokens + num_disk_tokens
    reason: str


@dataclass(frozen=True, slots=True)
class AdmissionMatch:
    """What admission found for a sequence, before anything was computed: tokens its RAM match
    served, full blocks the disk tier held right after them, and whether reading them was
    skipped as slower than computing them."""

    num_ram_tokens: int
    num_disk_blocks: int
    disk_read_skipped: bool


class MissExplainer:
    """Turns an admission's match into a CacheReport, and counts reports by reason. Holds no
    state per request or per tenant: the ghost index (bounded over all tenants) is all."""

    def __init__(self, ghost: GhostIndex, tree: RadixTree, hasher: BlockHasher, windowed: bool = False) -> None:
        self.ghost = ghost
        self.windowed = windowed  # layer groups: RAM may hold a block whose window KV went
        self.tree = tree
        self.hasher = hasher
        self.page_size = hasher.page_size
        self.counts: Counter[str] = Counter({reason: 0 for reason in MISS_REASONS})

    def explain(
        self,
        tokens: Sequence[int],
        salt: str | None,
        hashes: Sequence[BlockHash],
        match: AdmissionMatch,
        disk_key: Callable[[int], int | None],
        sibling_salts: Sequence[str | None] = (),
    ) -> CacheReport:
        """The report of a prompt (`tokens`, the hashes of its full blocks under `salt`) given
        its admission `match`; `disk_key(block)` is the disk tier's key of a block (None
        without one). Counted by reason. O(blocks) at most: one ghost lookup, one tail lookup,
        and a peek per sibling partition only where nothing else explains the miss."""
        ps = self.page_size
        num_tokens = len(tokens)
        max_blocks = (num_tokens - 1) // ps if num_tokens else 0
        ram_blocks = match.num_ram_tokens // ps
        disk_blocks = 0 if match.disk_read_skipped else min(match.num_disk_blocks, max(0, max_blocks - ram_blocks))
        served = min(ram_blocks + disk_blocks, max_blocks)
        reason = self._reason(tokens, salt, hashes, match, served, max_blocks, disk_key, sibling_salts)
        self.counts[reason] += 1
        return CacheReport(num_tokens, match.num_ram_tokens, disk_blocks * ps, served * ps, reason)

    def _reason(
        self,
        tokens: Sequence[int],
        salt: str | None,
        hashes: Sequence[BlockHash],
        match: AdmissionMatch,
        served: int,
        max_blocks: int,
        disk_key: Callable[[int], int | None],
        sibling_salts: Sequence[str | None],
    ) -> str:
        if served >= max_blocks:
            return "hit" if max_blocks else "partial_page"
        if match.disk_read_skipped and match.num_disk_blocks:
            return "disk_read_skipped"
        block = served
        if block >= len(hashes):
            return "never_seen"  # prefix caching is off: no block is ever cached
        if hashes[block] in self.ghost or disk_key(block) in self.ghost:
            return "evicted"
        if self.windowed and self._held_by(tokens, salt, block):
            return "evicted"  # its full KV is cached, the window layers' KV before it was evicted
        ps = self.page_size
        parent = hashes[block - 1] if block else self.root_key(salt)
        if self.ghost.continues_tail(parent, tokens[block * ps : (block + 1) * ps]):
            return "partial_page"
        if any(self._held_by(tokens, other, block) for other in sibling_salts if other != salt):
            return "another_partition"
        return "never_seen"

    def _held_by(self, tokens: Sequence[int], salt: str | None, block: int) -> bool:
        """Whether partition `salt` caches the prompt's blocks through `block` in RAM; pure."""
        end = (block + 1) * self.page_size
        return self.tree.peek(list(tokens[:end]) + [0], salt).num_cached_tokens >= end

    def root_key(self, salt: str | None) -> BlockHash:
        """The key a partition's first partial page is remembered under (the hash of its first
        block's header: seed and salt), apart from every block hash."""
        return self.hasher.hash_fn(self.hasher.first_header(salt))

    def remember_tail(self, tokens: Sequence[int], salt: str | None, hashes: Sequence[BlockHash], num_computed: int) -> None:
        """A sequence gives back its pages having computed `num_computed` of `tokens`: the part
        past its last full block was never cached; remember where it lay."""
        ps = self.page_size
        full = num_computed // ps
        if num_computed % ps == 0 or full > len(hashes):
            return
        parent = hashes[full - 1] if full else self.root_key(salt)
        self.ghost.add_tail(parent, tokens[full * ps : num_computed])

    def snapshot(self) -> dict[str, int]:
        """Reports made so far, by reason (every reason present, 0 included)."""
        return dict(self.counts)
