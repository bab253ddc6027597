"""Tests of radixkv.sdk, in process and over HTTP."""
