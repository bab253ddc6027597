"""The OpenAI-compatible HTTP server (`radixkv serve`, in `radixkv.cli`): `app.create_app`.

Routes per API (`openai_routes`, `cache_routes`, `ops_routes`), `errors`, `tenants` (auth and
cache salts), `streaming`, `prompts`, `metrics`; `protocol` holds the wire format. The engine
runs beside the event loop through `radixkv.engine.async_engine.AsyncEngine`.
"""
