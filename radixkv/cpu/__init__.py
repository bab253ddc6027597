"""Everything CPU-specific: the native library (csrc/) and its loader, packed linears, the
layers' row ops, the fused decode step, the paged-decode and logits kernel wrappers and CPU
features."""
