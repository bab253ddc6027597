"""radixkv's own cache endpoints (pin, unpin, list, lookup, flush): `protocol` on the wire,
`routes` over the engine.
"""
