"""radixkv beyond one process: `workers` (N `radixkv serve` workers behind sglang-router on this
machine, `LocalCluster`), `front_door` (the sticky-session proxy in front of them, behind the
workers' own guards), `command` (`radixkv cluster`), and `ray_serve` (replicas behind Ray Serve's
prefix-aware router; needs the `ray` extra, so nothing here imports it).
"""
