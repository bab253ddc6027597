"""The OpenAI-compatible HTTP server (`radixkv serve`, in `radixkv.cli`): `app.create_app`.

Routes per API (`openai_routes`, `cache_routes`, `ops_routes`), `errors`, `tenants` (auth and
cache salts), `streaming`, `prompts`, `metrics`; `protocol` holds the wire format. Before any
route: `access` (who may reach the server) and `body_limit`; `limits` holds the server's knobs,
`quotas` each key's fair share, `openapi` the request bodies in the schema. The engine runs
beside the event loop through `radixkv.engine.async_engine.AsyncEngine`.
"""
