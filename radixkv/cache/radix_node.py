"""The radix tree's node record, what its lookups return, and the pure walks that need no tree:
a path's pages and tokens, a run compared with a prompt block by block. Nothing here changes a node.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from radixkv.cache.eviction import EvictKey, Liveness
from radixkv.cache.hashing import BlockHash


@dataclass(slots=True, eq=False, repr=False)
class Node:
    """A run of one or more cached blocks (a root holds none). Identity is the object."""

    node_id: int
    parent: Node | None
    salt: str | None
    tokens: list[int]  # the run's tokens, len(pages) * page_size of them
    pages: list[int]  # one page per block
    hashes: list[BlockHash]  # chained hash per block; hashes[0] is this node's key in parent
    children: dict[BlockHash, Node] = field(default_factory=dict)
    lock_ref: int = 0  # locks taken on this node or any descendant
    last_access: int = 0  # logical clock; never older than a descendant's
    removed: bool = False  # evicted or reset: a stale handle must not be locked
    retains: dict[int, float] = field(default_factory=dict)  # retention id -> expires_at_s, this node or below
    retention_expires_at_s: float = 0.0  # max(retains.values()); the node's key in the retained set
    evict_key: EvictKey | None = None  # its key in the eviction order; None when not in it
    num_hits: int = 0  # matches that used this node's blocks (this node or below)
    liveness: Liveness = Liveness.UNKNOWN  # what a session book said of it (policy `session`)

    def __repr__(self) -> str:
        kind = "root" if self.parent is None else f"{len(self.pages)} blocks"
        return f"Node(id={self.node_id}, {kind}, lock_ref={self.lock_ref}, last_access={self.last_access})"


@dataclass(frozen=True, slots=True)
class MatchResult:
    num_cached_tokens: int  # multiple of page_size
    pages: list[int]  # pages of the matched blocks, in order
    node: Node  # deepest node of the match (a root when nothing matched); for lock()/unlock()


@dataclass(frozen=True, slots=True)
class PeekResult:
    num_cached_tokens: int  # what match() would return now, multiple of page_size
    pages: list[int]  # pages of those blocks, in order
    num_unlocked_pages: int  # of those, the evictable ones: what locking the match takes from eviction


@dataclass(frozen=True, slots=True)
class InsertResult:
    num_existing_blocks: int  # leading blocks already cached: the caller frees its duplicates
    num_inserted_blocks: int  # blocks newly adopted (tree increfs their pages)
    pages: list[int]  # canonical pages of the first existing + inserted blocks
    node: Node  # deepest node now covering those blocks (a root if none)


def path_tokens(node: Node) -> list[int]:
    """Every token of the prefix `node` ends: its ancestors' runs, then its own. O(depth)."""
    runs = []
    current: Node | None = node
    while current is not None:
        runs.append(current.tokens)
        current = current.parent
    return [token for run in reversed(runs) for token in run]


def path_pages(node: Node) -> int:
    """Pages (blocks) on the path from the root down to `node`, its own included."""
    num = 0
    current: Node | None = node
    while current is not None:
        num += len(current.pages)
        current = current.parent
    return num


def unretained_path_pages(node: Node) -> int:
    """Pages on `node`'s path that no retention covers: since a retention marks its whole path,
    that is the path's tail, counted up to the first retained node."""
    num = 0
    current: Node | None = node
    while current is not None and current.parent is not None and not current.retains:
        num += len(current.pages)
        current = current.parent
    return num


def iter_preorder(roots: Iterable[Node]) -> Iterator[Node]:
    """Every non-root node below `roots`, each before its children, children in insertion order."""
    stack = [child for root in roots for child in reversed(list(root.children.values()))]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(list(node.children.values())))


def iter_subtrees(roots: Iterable[Node]) -> Iterator[Node]:
    """Every non-root node below `roots`, in no promised order (the cheaper walk)."""
    stack = [child for root in roots for child in root.children.values()]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def token_list(token_ids: Sequence[int]) -> list[int]:
    """The ids as a list of Python ints, which compare cheaply."""
    # numpy arrays and torch tensors: tolist() gives Python ints.
    tolist = getattr(token_ids, "tolist", None)
    if tolist is not None:
        return tolist()
    return token_ids if isinstance(token_ids, list) else list(token_ids)


def common_blocks(run: list[int], tokens: list[int], start: int, max_blocks: int, ps: int) -> int:
    """How many leading blocks of `run` equal the blocks of `tokens` from `start` (at most
    `max_blocks`)."""
    num = min(len(run) // ps, max_blocks)
    end = start + num * ps
    if (run if num * ps == len(run) else run[: num * ps]) == tokens[start:end]:
        return num  # the common case, one comparison in C
    for block in range(num):
        lo = block * ps
        if run[lo : lo + ps] != tokens[start + lo : start + lo + ps]:
            return block
    raise AssertionError("unreachable: the runs differ but no block does")


def check_hashes_len(block_hashes: Sequence[BlockHash] | None, needed: int) -> None:
    if block_hashes is not None and len(block_hashes) < needed:
        raise ValueError(f"block_hashes has {len(block_hashes)} hashes but {needed} full blocks need one each")
