"""The HTTP server (`radixkv serve`, in `radixkv.cli`): `app.create_app` over `state.AppState`.

One subpackage per API family (`openai/`, `anthropic/`, `cache/`), each with its wire format and
routes; beside them the operator's and routers' routes (`ops_routes`, `worker_routes`) and what
every family shares: `errors`, `tenants` (keys, partitions, owners), `encode` (prompts to token
ids), `tools`, `logprobs`, `streaming`, `metrics`. Before any route: `connections`, `access`,
`body_limit`, `drain`; `limits`, `quotas`, `parse_slots` and `request_caps` bound each key.
"""
