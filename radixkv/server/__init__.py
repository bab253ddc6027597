"""The OpenAI-compatible HTTP server (`radixkv serve`, in `radixkv.cli`): `app.create_app`.

`protocol` holds the wire format, `metrics` the Prometheus collectors; the engine runs beside
the event loop through `radixkv.engine.async_engine.AsyncEngine`.
"""
