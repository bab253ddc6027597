"""Reliability: aborts, tenant isolation, limits, load, memory pressure, a fuzzed server."""
