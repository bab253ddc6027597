"""Tests of radixkv.server against a live uvicorn server."""
