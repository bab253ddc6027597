"""The HTTP server (`radixkv serve`, in `radixkv.cli`): `app.create_app` over `state.AppState`.

One subpackage per API family (`openai/`, `anthropic/`, `cache/`), each with its wire format and
routes; beside them the operator's and routers' routes (`ops_routes`, `worker_routes`) and what
every family shares: `errors`, `encode` (prompts to token ids), `tools`, `logprobs`, `streaming`,
`metrics`. The guards (`guards/`: connections, drain, access, body limits, quotas, parse slots,
request caps, tenants) refuse before work is spent, with the numbers in `limits`.
"""
