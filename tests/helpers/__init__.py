"""Helpers shared by the tests, imported as `from tests.helpers.<module> import ...`.

- `tiny_models`: tiny random Hugging Face model folders with a small trained tokenizer, and the
  chat template the tiny tokenizer lacks.
- `engine`: transformers' greedy reference, engine and LLM factories, stepping to the end, and
  the page-accounting checks tests end with; `wait_until`.
- `model`: fully random tiny models, attention metadata on contiguous pages, a forward stepper.
- `live_server`: a real uvicorn server on 127.0.0.1 over an engine, its keys and clients.
- `sdk`: the SDK tests' engine options and 5-shot template with its rows.

Fixtures live in conftest.py files: the tiny model folders several folders use in
tests/conftest.py, the rest beside the tests that use them.
"""
