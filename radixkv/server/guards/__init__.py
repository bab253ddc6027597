"""The server's guards: what stands between a caller and the engine, refusing before work is
spent. A guard checks one thing and answers with the wire error itself: connections and header
time (`connections`), draining (`drain`), the API key and a key's quota before its body is read
(`access`, `quotas`), the body's size and read time (`body_limit`), what one body may carry
(`request_caps`), parsing threads and CPU per key (`parse_slots`), and who a key is: its cache
partitions and owner (`tenants`). Their numbers are `radixkv.server.limits.ServerLimits`.
"""
