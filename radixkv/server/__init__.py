"""The OpenAI-compatible HTTP server (`radixkv serve`): `app.create_app` and `app.serve`.

`protocol` holds the wire format, `metrics` the Prometheus collectors; the engine runs beside
the event loop through `radixkv.engine.async_engine.AsyncEngine`.
"""
