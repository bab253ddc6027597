"""Tests of radixkv.engine: exactness against transformers, scheduling, sampling, detokenizing."""
