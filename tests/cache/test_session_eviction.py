"""The `session` eviction policy: dead leaves go before cold, cold before unknown, unknown before
hot, each least recently used first, retained last; set_liveness marks a node's private path
only; a locked node is never evicted; slru honours the marks, lru ignores them. A hypothesis state
machine checks every eviction against the order computed from the tree's leaves."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv.cache import BlockHasher, BlocksEvicted, Liveness, Node, PagePool, RadixTree
from radixkv.engine.kv_manager import KVManager
from tests.cache.test_radix import run_request, seq

PAGE_SIZE = 4


def make_tree(policy: str = "session", num_pages: int = 64) -> RadixTree:
    return RadixTree(PagePool(num_pages, PAGE_SIZE), BlockHasher(PAGE_SIZE, seed=3), eviction_policy=policy)


def evicted_order(tree: RadixTree) -> list[int]:
    """Evict everything; the node ids in the order they went."""
    order: list[int] = []
    tree.events.subscribe(lambda event: isinstance(event, BlocksEvicted) and order.append(event.node.node_id))
    tree.evict(tree.evictable_pages)
    tree.check_invariants()
    return order


def four_prompts(tree: RadixTree) -> list[Node]:
    """Four unrelated 2-block prompts, oldest first; their leaves."""
    nodes = []
    for i in range(4):
        tokens = seq(1000 * (i + 1), 2 * PAGE_SIZE + 1)
        run_request(tree, tokens)
        nodes.append(tree.deepest_node(tokens))
    return nodes


def test_dead_then_cold_then_unknown_then_hot_each_lru() -> None:
    tree = make_tree()
    oldest, older, newer, newest = four_prompts(tree)
    tree.mark_hot(oldest)
    tree.mark_dead(newest)
    tree.mark_cold(newer)  # `older` stays unknown
    tree.check_invariants()
    assert evicted_order(tree) == [newest.node_id, newer.node_id, older.node_id, oldest.node_id]


def test_within_a_class_least_recently_used_first() -> None:
    tree = make_tree()
    nodes = four_prompts(tree)
    for node in nodes:
        tree.mark_dead(node)
    assert evicted_order(tree) == [node.node_id for node in nodes]


def test_unmarked_session_policy_is_lru() -> None:
    orders = {}
    for policy in ("session", "lru"):
        tree = make_tree(policy)
        nodes = four_prompts(tree)
        run_request(tree, seq(1000, 2 * PAGE_SIZE + 1))  # the oldest used again
        orders[policy] = evicted_order(tree)
        assert orders[policy][-1] == nodes[0].node_id
    assert orders["session"] == orders["lru"]


def test_lru_ignores_the_marks() -> None:
    plain, marked = make_tree("lru"), make_tree("lru")
    four_prompts(plain)
    nodes = four_prompts(marked)
    for node, mark in zip(nodes, (marked.mark_hot, marked.mark_dead, marked.mark_cold, marked.mark_hot)):
        assert mark(node) == 1  # marked all the same, for a later switch of policy
    assert evicted_order(plain) == evicted_order(marked)


def test_slru_honours_the_marks_around_its_own_two_classes() -> None:
    tree = make_tree("slru")
    oldest, older, newer, newest = four_prompts(tree)
    run_request(tree, seq(3000, 2 * PAGE_SIZE + 1))  # `newer` served a hit: protected
    tree.mark_hot(oldest)
    tree.mark_dead(newest)
    tree.check_invariants()
    # dead, then probation (unknown, never hit), then protected (hit), then hot.
    assert evicted_order(tree) == [newest.node_id, older.node_id, newer.node_id, oldest.node_id]


def test_protected_over_its_cap_never_goes_before_a_dead_leaf() -> None:
    from radixkv.cache.eviction import EvictionOrder

    tree = make_tree("slru")
    oldest, older, newer, newest = four_prompts(tree)
    for tokens in (seq(1000, 2 * PAGE_SIZE + 1), seq(2000, 2 * PAGE_SIZE + 1)):
        run_request(tree, tokens)  # oldest and older served hits: protected
    tree.mark_dead(newest)
    order = EvictionOrder("slru")
    for node in (oldest, older, newer, newest):
        tree._order.remove(node)
        order.add(node)
    assert order.pop(protected_over_cap=True) is newest
    assert order.pop(protected_over_cap=True) is oldest  # then the protected set, over its cap


def test_retained_goes_after_hot() -> None:
    clock = [0.0]
    tree = RadixTree(PagePool(64, PAGE_SIZE), BlockHasher(PAGE_SIZE, seed=3), eviction_policy="session", clock=lambda: clock[0])
    a, b = four_prompts(tree)[:2]
    tree.retain(a, ttl_s=60.0)
    tree.mark_dead(a)  # dead but retained: retention wins
    tree.mark_hot(b)
    order = evicted_order(tree)
    assert order.index(b.node_id) < order.index(a.node_id) == len(order) - 1


def test_a_locked_dead_node_is_never_evicted() -> None:
    tree = make_tree()
    nodes = four_prompts(tree)
    tokens = seq(1000, 2 * PAGE_SIZE + 1)
    match = tree.match(tokens)
    tree.lock(match.node)
    tree.mark_dead(nodes[0])
    order = evicted_order(tree)
    assert nodes[0].node_id not in order and not nodes[0].removed
    assert tree.cached_pages == 2
    tree.unlock(match.node)
    assert evicted_order(tree) == [nodes[0].node_id]


def test_marks_cover_the_private_path_and_stop_at_a_branch() -> None:
    tree = make_tree()
    system = seq(0, 2 * PAGE_SIZE)
    turn1 = system + seq(100, 2 * PAGE_SIZE)
    turn2 = turn1 + seq(200, 2 * PAGE_SIZE)
    other = system + seq(900, 2 * PAGE_SIZE)
    for tokens in (turn1 + [1], turn2 + [1], other + [1]):
        run_request(tree, tokens)
    leaf = tree.deepest_node(turn2)
    middle = leaf.parent
    branch = middle.parent
    assert len(branch.children) == 2 and branch.tokens == system
    assert tree.mark_dead(leaf) == 2  # leaf and turn1's node; the system prompt is shared
    assert (leaf.liveness, middle.liveness, branch.liveness) == (Liveness.DEAD, Liveness.DEAD, Liveness.UNKNOWN)
    assert tree.mark_hot(branch) == 0  # a branch point is nobody's private tail
    assert tree.mark_hot(leaf, below_blocks=4) == 1  # the first 4 blocks are known shared
    assert (leaf.liveness, middle.liveness) == (Liveness.HOT, Liveness.DEAD)
    tree.check_invariants()


def test_a_node_that_branches_or_splits_is_unknown_again() -> None:
    tree = make_tree()
    first = seq(0, 4 * PAGE_SIZE)
    run_request(tree, first + [1])
    node = tree.deepest_node(first)
    tree.mark_dead(node)
    # Another request shares the first two blocks: the split's upper half is shared.
    run_request(tree, first[: 2 * PAGE_SIZE] + seq(500, PAGE_SIZE + 1))
    top = node.parent
    assert top.tokens == first[: 2 * PAGE_SIZE] and top.liveness == Liveness.UNKNOWN
    assert node.liveness == Liveness.DEAD
    # A node that gains a second child is a branch point: unknown.
    chain = seq(3000, 2 * PAGE_SIZE)
    run_request(tree, chain + [1])
    parent = tree.deepest_node(chain)
    tree.mark_hot(parent)
    run_request(tree, chain + seq(4000, PAGE_SIZE + 1))
    assert parent.liveness == Liveness.HOT  # one child: still its session's path
    run_request(tree, chain + seq(5000, PAGE_SIZE + 1))
    assert parent.liveness == Liveness.UNKNOWN
    tree.check_invariants()


def test_deepest_node_is_pure_and_kv_manager_marks_by_prefix() -> None:
    tree = make_tree()
    kv = KVManager(tree.pool, tree, tree.hasher, enable_prefix_caching=True)
    tokens = seq(0, 3 * PAGE_SIZE)
    run_request(tree, tokens + [1])
    node = tree.deepest_node(tokens)
    before = (node.last_access, tree.num_nodes, tree.stats().queries)
    assert tree.deepest_node(tokens + seq(50, PAGE_SIZE)) is node  # uncached blocks after it
    assert tree.deepest_node(tokens[: 2 * PAGE_SIZE]) is None  # would need a split
    assert (node.last_access, tree.num_nodes, tree.stats().queries) == before
    assert kv.mark(tokens + [7], Liveness.DEAD, below_blocks=1) == 0  # the node starts at 0
    assert kv.mark(tokens + [7], Liveness.DEAD) == 1 and node.liveness == Liveness.DEAD
    assert kv.mark(node, Liveness.HOT) == 1 and node.liveness == Liveness.HOT
    assert kv.mark(seq(9000, 8), Liveness.DEAD) == 0
    tree.check_invariants()


# ------------------------------------------------------------------ the state machine

PREFIX_TOKENS = (seq(0, 2 * PAGE_SIZE), seq(100, PAGE_SIZE), [])
RANK = {Liveness.DEAD: 0, Liveness.COLD: 1, Liveness.UNKNOWN: 2, Liveness.HOT: 3}


class SessionOrderMachine(RuleBasedStateMachine):
    """Requests over a few shared prefixes with tails that extend earlier requests, marks on
    any cached node, locks held across steps; every eviction must take an unlocked leaf of the
    lowest class present (retained ones only when nothing else is left), least recently used
    within it."""

    @initialize(num_pages=st.integers(8, 40))
    def setup(self, num_pages: int) -> None:
        self.clock_s = 0.0
        self.tree = RadixTree(
            PagePool(num_pages, PAGE_SIZE), BlockHasher(PAGE_SIZE, seed=5), eviction_policy="session",
            clock=lambda: self.clock_s,
        )
        self.tree.events.subscribe(lambda event: isinstance(event, BlocksEvicted) and self.evicting(event.node))
        self.prompts: list[list[int]] = []
        self.locked: list[tuple[Node, list[int]]] = []  # (locked node, pages held)
        self.victims: list[Node] = []

    def evicting(self, node: Node) -> None:
        assert node.lock_ref == 0 and not node.children
        leaves = [n for n in self.tree.iter_nodes() if not n.children and n.lock_ref == 0]
        assert node in leaves
        self.victims.append(node)
        unretained = [n for n in leaves if not n.retains]
        if node.retains:
            assert not unretained, "a retained leaf went before an unretained one"
            return
        best = min((RANK[n.liveness], n.last_access) for n in unretained)
        assert (RANK[node.liveness], node.last_access) == best, f"{node!r} is not next in the session order"

    def cached_nodes(self) -> list[Node]:
        return list(self.tree.iter_nodes())

    @rule(prefix=st.integers(0, len(PREFIX_TOKENS) - 1), extend=st.integers(0, 1 << 16), tail=st.integers(1, 3), salt=st.integers(0, 1 << 20))
    def request(self, prefix: int, extend: int, tail: int, salt: int) -> None:
        base = self.prompts[extend % len(self.prompts)] if self.prompts and extend % 3 else list(PREFIX_TOKENS[prefix])
        tokens = base + seq(10_000 + salt * 8, tail * PAGE_SIZE) + [0]
        tree, pool = self.tree, self.tree.pool
        # As the engine runs it: match and lock, evict for the rest, allocate, insert, release.
        match = tree.match(tokens)
        tree.lock(match.node)
        pool.incref(match.pages)
        num_new = -(-len(tokens) // PAGE_SIZE) - len(match.pages)
        if num_new > pool.num_free:
            tree.evict(num_new - pool.num_free)
        if num_new <= pool.num_free:
            pages = match.pages + pool.allocate(num_new)
            result = tree.insert(tokens, pages)
            assert result.pages[: len(match.pages)] == match.pages  # the locked match survived
            tree.lock(result.node)
            tree.unlock(result.node)
            pool.release(pages)
            self.prompts.append(tokens[:-1])
        else:
            pool.release(match.pages)
        tree.unlock(match.node)

    @precondition(lambda self: self.prompts)
    @rule(which=st.integers(0, 1 << 16), liveness=st.sampled_from(list(Liveness)), below=st.integers(0, 4))
    def mark(self, which: int, liveness: Liveness, below: int) -> None:
        nodes = self.cached_nodes()
        if nodes:
            self.tree.set_liveness(nodes[which % len(nodes)], liveness, below_blocks=below)

    @precondition(lambda self: self.prompts)
    @rule(which=st.integers(0, 1 << 16))
    def lock(self, which: int) -> None:
        tokens = self.prompts[which % len(self.prompts)]
        match = self.tree.match(tokens + [0])
        self.tree.lock(match.node)
        self.tree.pool.incref(match.pages)
        self.locked.append((match.node, match.pages))

    @precondition(lambda self: self.locked)
    @rule()
    def unlock(self) -> None:
        node, pages = self.locked.pop(0)
        self.tree.unlock(node)
        self.tree.pool.release(pages)

    @precondition(lambda self: self.prompts)
    @rule(which=st.integers(0, 1 << 16))
    def retain(self, which: int) -> None:
        match = self.tree.match(self.prompts[which % len(self.prompts)] + [0])
        if match.num_cached_tokens:
            self.tree.retain(match.node, ttl_s=5.0)

    @rule(seconds=st.sampled_from([1.0, 4.0]))
    def tick(self, seconds: float) -> None:
        self.clock_s += seconds

    @rule(num=st.integers(1, 12))
    def evict(self, num: int) -> None:
        locked = {id(n) for node, _ in self.locked for n in _path(node)}
        self.tree.evict(num)
        assert not any(id(victim) in locked for victim in self.victims), "a locked node was evicted"

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "tree"):
            self.tree.check_invariants()
            for node, _ in self.locked:
                assert not any(n.removed for n in _path(node))


def _path(node: Node) -> list[Node]:
    out = []
    current: Node | None = node
    while current is not None and current.parent is not None:
        out.append(current)
        current = current.parent
    return out


TestSessionOrder = SessionOrderMachine.TestCase
TestSessionOrder.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


def test_marks_reach_down_to_the_reply_below_the_known_prefix() -> None:
    tree = make_tree()
    prompt = seq(0, 2 * PAGE_SIZE)
    run_request(tree, prompt + [1])
    run_request(tree, prompt + seq(50, 2 * PAGE_SIZE) + [1])  # the turn's reply, cached below it
    node = tree.deepest_node(prompt)
    (reply,) = node.children.values()
    assert tree.mark_dead(node) == 2 and reply.liveness == Liveness.DEAD
    run_request(tree, prompt + seq(80, PAGE_SIZE) + [1])  # a second continuation: node branches
    assert node.liveness == Liveness.UNKNOWN
    assert tree.mark_hot(reply) == 1 and node.liveness == Liveness.UNKNOWN
    tree.check_invariants()


def test_an_evicted_node_marks_what_is_left_of_its_path() -> None:
    tree = make_tree()
    turn1 = seq(0, 2 * PAGE_SIZE)
    run_request(tree, turn1 + [1])
    run_request(tree, turn1 + seq(70, 2 * PAGE_SIZE) + [1])
    leaf = tree.deepest_node(turn1 + seq(70, 2 * PAGE_SIZE))
    parent = leaf.parent
    tree.evict(2)  # the leaf goes
    assert leaf.removed and not parent.removed and not parent.children
    assert tree.mark_dead(leaf) == 1 and parent.liveness == Liveness.DEAD
    tree.evict(2)
    assert tree.mark_hot(leaf) == 0  # nothing of the path is left
    tree.check_invariants()


def test_hot_only_as_far_and_as_long_as_retained() -> None:
    """Issue 43: mark_hot leaves what continues past the retained node unknown (a turn the caps
    trimmed), and a hot node whose last retention goes is unknown again; a retention's own
    match serves no request, so it makes nothing protected."""
    clock = [0.0]
    tree = RadixTree(PagePool(64, PAGE_SIZE), BlockHasher(PAGE_SIZE, seed=3), eviction_policy="slru", clock=lambda: clock[0])
    tokens = seq(0, 6 * PAGE_SIZE)
    run_request(tree, tokens + [1])
    retained = tree.match(tokens[: 2 * PAGE_SIZE] + [0], serves=False).node  # the caps kept 2 of 6 blocks
    (tail,) = retained.children.values()
    tree.retain(retained, ttl_s=60.0)
    assert tree.mark_hot(retained) == 2
    assert (retained.liveness, tail.liveness) == (Liveness.HOT, Liveness.UNKNOWN)
    assert retained.num_hits == 0 and tree.protected_pages == 0
    [retention] = tree.retentions(None)
    tree.release(retention.retention_id)
    assert retained.liveness == Liveness.UNKNOWN
    tree.check_invariants()
