"""A vLLM or SGLang server's metrics as adaptive concurrency reads them (broker/server_metrics.py):
the parser on exposition text written as those servers write it, and on what they never write.
In real worker processes against a server that reports a queue: tests/test_adaptive_metrics.py."""

from __future__ import annotations

import pytest

from broker.server_metrics import MAX_BODY, MetricsError, Reading, ServerMetrics, parse_reading

# As vLLM's /metrics (v1 engine, two engines of one model; 0.10 names KV use kv_cache_usage_perc)
VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 24.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-8B"} 22.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-8B"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.41
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.57
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 1.234e+06
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="Qwen/Qwen3-8B"} 10.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-8B"} 12.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="Qwen/Qwen3-8B"} 12.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="Qwen/Qwen3-8B"} 9.5
"""

# An older vLLM (v0 engine): gpu_cache_usage_perc, nothing waiting
VLLM_OLD = """# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.93
"""

# As SGLang's /metrics (--enable-metrics)
SGLANG = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="Qwen/Qwen2.5-7B-Instruct",engine_type="unified",tp_rank="0"} 31.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="Qwen/Qwen2.5-7B-Instruct",engine_type="unified",tp_rank="0"} 0.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="Qwen/Qwen2.5-7B-Instruct",engine_type="unified",tp_rank="0"} 0.95
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="Qwen/Qwen2.5-7B-Instruct",engine_type="unified",tp_rank="0"} 812.4
"""


@pytest.mark.unit
def test_vllm_sums_the_queue_over_engines_and_takes_the_fullest_kv():
    r = parse_reading(VLLM.encode())
    assert r == Reading("vLLM", 7.0, 0.57)
    assert r.overload() == "vLLM: 7 waiting"


@pytest.mark.unit
def test_older_vllm_kv_name_and_sglang():
    assert parse_reading(VLLM_OLD) == Reading("vLLM", 0.0, 0.93)
    assert parse_reading(VLLM_OLD).overload() == "vLLM: KV 0.93"
    r = parse_reading(SGLANG.encode())
    assert r == Reading("SGLang", 0.0, 0.95) and r.overload() == "SGLang: KV 0.95"


@pytest.mark.unit
def test_a_healthy_reading_is_no_overload():
    healthy = VLLM.replace("} 3.0", "} 0.0").replace("} 4.0", "} 0.0")
    assert parse_reading(healthy).overload() == ""
    assert Reading("SGLang", 0, None).overload() == "", "no KV reported: the queue alone decides"
    assert Reading("vLLM", 0, 0.9).overload() == "vLLM: KV 0.90", "0.9 is full"


@pytest.mark.unit
@pytest.mark.parametrize("body, words", [
    (b"", "no vLLM or SGLang queue metric"),
    (b"<html><body>404 Not Found</body></html>", "not Prometheus text"),
    (b"vllm:num_requests_waiting{model_name=\"m\" 3\n", "not Prometheus text"),
    (b"\xff\xfe\x00garbage {{{ }}}\n", "not Prometheus text"),
    (b"# TYPE up gauge\nup 1\n", "no vLLM or SGLang queue metric"),
    (VLLM.encode() + b"#" * (2 * MAX_BODY), "over 1 MB"),
])
def test_what_gives_no_reading_is_named(body, words):
    with pytest.raises(MetricsError, match=words):
        parse_reading(body)


@pytest.mark.unit
def test_not_a_number_values_are_skipped():
    assert parse_reading(VLLM_OLD.replace("} 0.93", "} NaN")) == Reading("vLLM", 0, None)
    with pytest.raises(MetricsError, match="no vLLM or SGLang queue metric"):
        parse_reading(VLLM_OLD.replace("} 0.0", "} NaN"))


def test_the_turn_goes_to_one_process_a_second_and_the_last_reading_is_kept(settings):
    from broker.caps import CAP_MODEL
    from broker.keys import Keys
    from broker.redisconn import connect

    client, keys = connect(settings), Keys(settings.key_prefix)
    cap = keys.cap(CAP_MODEL, "http://m-metrics")
    sm = ServerMetrics(client, keys)
    assert sm.last(cap) is None
    assert sm.take_turn(cap, poll_ms=300) and not sm.take_turn(cap, poll_ms=300)
    sm.record(cap, Reading("vLLM", 7, 0.5))
    sm.record(cap, None, "connection refused")
    last = sm.last(cap)
    assert (last["engine"], last["waiting"], last["kv"], last["error"]) == ("vLLM", 7, 0.5, "connection refused")
    assert last["at"] > 0 and last["error_at"] >= last["at"]
    client.hset(keys.cap_metrics(CAP_MODEL, "http://m-metrics"), "waiting", "lots")  # written by someone else
    assert sm.last(cap)["waiting"] is None
