"""Tests of the Triton kernels (radixkv.kernels)."""
