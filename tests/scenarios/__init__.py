"""Every scenario under scenarios/ runs at a tiny size, and `radixkv bench` finds them."""
