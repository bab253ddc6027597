"""Tests of the attention backends against the pure-torch reference."""
