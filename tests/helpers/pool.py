"""The page pool as the stateful cache tests drive it (tests/cache/test_pages.py,
test_radix_stateful.py): an allocation checked against what the pool says is free."""

from __future__ import annotations

import pytest

from radixkv.cache import OutOfPages, PagePool


def allocate_checked(pool: PagePool, n: int) -> list[int] | None:
    """n pages from pool, or None where fewer are free, after checking that the pool refused
    with OutOfPages and lost no free page doing so."""
    free = pool.num_free
    if n > free:
        with pytest.raises(OutOfPages):
            pool.allocate(n)
        assert pool.num_free == free
        return None
    return pool.allocate(n)
