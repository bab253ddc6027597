"""Tests of radixkv/cpu/: the native kernels against torch and float64 references, one module per module."""
