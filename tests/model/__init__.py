"""Tests of radixkv.model and the CPU kernels it calls."""
