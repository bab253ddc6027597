"""The surface routers poll on a worker (radixkv.server.worker_routes): load, server and model
info, a generating health probe, sglang's cache flush; and the load gauges on /metrics."""

from __future__ import annotations

import httpx

from tests.helpers.live_server import KEY_A, MODEL, metric_values


def test_get_load_reports_requests_tokens_and_pages(live_server):
    http = live_server.http()
    client = live_server.client()
    client.completions.create(model=MODEL, prompt="The quick brown fox jumps over the lazy dog. " * 3, max_tokens=2)
    live_server.assert_idle_and_consistent()
    (load,) = http.get("/get_load").json()  # a list: one entry per data-parallel rank
    stats = live_server.async_engine.stats()
    assert load["dp_rank"] == 0 and load["draining"] is False
    assert load["num_reqs"] == load["num_waiting_reqs"] == load["num_running_reqs"] == 0
    assert load["num_tokens"] == 0 and load["num_pages_in_use"] == 0 and load["kv_usage"] == 0.0
    assert load["num_pages"] == stats.num_pages
    assert load["num_free_pages"] + load["num_cached_pages"] == stats.num_pages
    assert load["num_cached_pages"] == stats.cache.evictable_pages > 0  # the prompt's blocks stay cached
    # The same numbers are Prometheus gauges.
    values = metric_values(live_server)
    assert values[("radixkv_kv_pages_free", ())] == load["num_free_pages"]
    assert values[("radixkv_kv_usage", ())] == 0.0
    assert values[("radixkv_num_requests_running", ())] == values[("radixkv_num_requests_waiting", ())] == 0
    assert values[("radixkv_draining", ())] == 0


def test_server_and_model_info_name_the_model_routers_register(live_server, tiny_llama):
    http = live_server.http()
    for path in ("/server_info", "/get_server_info"):
        info = http.get(path).json()
        assert info["served_model_name"] == MODEL and info["dp_size"] == 1
        assert info["max_total_tokens"] == info["num_pages"] * info["page_size"]
        assert info["model_path"] == str(tiny_llama.resolve())  # a local folder a router can read
    for path in ("/model_info", "/get_model_info"):
        info = http.get(path).json()
        assert info["is_generation"] is True and info["tokenizer_path"] == str(tiny_llama.resolve())
    # Like /metrics, they need a key when keys are set.
    assert httpx.get(f"{live_server.base_url}/get_load").status_code == 401
    assert httpx.get(f"{live_server.base_url}/server_info").status_code == 401


def test_health_generate_runs_one_token_through_the_engine(live_server):
    # The counters are read on the engine thread: stats() is a snapshot of the last loop
    # iteration, which may not have run yet when the response arrives.
    def output_tokens() -> int:
        return live_server.engine_call(lambda engine: engine.counters.num_output_tokens)

    before = output_tokens()
    response = httpx.get(f"{live_server.base_url}/health_generate")  # open, as /health is
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    assert output_tokens() == before + 1
    live_server.assert_idle_and_consistent()


def test_flush_cache_is_for_admins(live_server):
    # The live server has no admin key: nobody may flush, as with POST /v1/cache/flush.
    response = live_server.http(KEY_A).post("/flush_cache")
    assert response.status_code == 403 and response.json()["error"]["code"] == "permission_denied"
