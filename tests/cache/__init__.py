"""Tests of radixkv.cache: block hashes, the page pool, the radix tree."""
