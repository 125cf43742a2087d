"""The measurement definitions computed on exact, hand-made timestamps."""

import pytest

from longctx_bench import metrics
from longctx_bench.sse import RequestRecord, event_tokens


def record(sent, events):
    r = RequestRecord(1000)
    r.sent = sent
    r.events = events
    return r


def test_request_metrics_exact():
    r = record(10.0, [(10.5, 1), (10.6, 2), (10.8, 1), (10.9, 3)])
    m = metrics.request_metrics(r)
    assert m["ttft_s"] == pytest.approx(0.5)
    assert m["step_p50_s"] == pytest.approx(0.1)          # gaps 0.1, 0.2, 0.1
    assert m["step_p10_s"] == pytest.approx(0.1)          # numpy's linear interpolation
    assert m["step_p90_s"] == pytest.approx(0.18)         # 0.1 + 0.8 x (0.2 - 0.1)
    assert m["tokens_per_event"] == pytest.approx(7 / 4)
    assert m["stream_tok_s"] == pytest.approx(6 / 0.4)     # (tokens - 1) / (last - first)
    assert m["task_s"] == pytest.approx(0.9)
    assert metrics.request_metrics(record(0, [])) is None


def test_group_and_summary():
    a = record(0.0, [(1.0, 1), (2.0, 1)])
    b = record(0.0, [(1.5, 2), (3.0, 2)])
    g = metrics.group_metrics([a, b])
    assert g["aggregate_tok_s"] == pytest.approx(6 / 2.0)  # all tokens / (last - first)
    assert g["combined_decode_tok_s"] == pytest.approx(1 / 1.0 + 3 / 1.5)
    s = metrics.summarize([1.0, 2.0, 3.0, None])
    assert s == {"mean": 2.0, "sd": 1.0, "n": 3}           # sample sd (ddof = 1)
    assert metrics.summarize([5.0]) == {"mean": 5.0, "sd": None, "n": 1}


def test_spec_decode_differencing():
    before = {"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_draft_tokens": 50,
              "vllm:spec_decode_num_accepted_tokens": 20,
              "vllm:spec_decode_num_accepted_tokens_per_pos|position=0": 8}
    after = {"vllm:spec_decode_num_drafts": 30, "vllm:spec_decode_num_draft_tokens": 150,
             "vllm:spec_decode_num_accepted_tokens": 60,
             "vllm:spec_decode_num_accepted_tokens_per_pos|position=0": 24}
    sd = metrics.spec_decode(before, after)
    assert sd["num_drafts"] == 20 and sd["mean_accepted_length"] == pytest.approx(1 + 40 / 20)
    assert sd["acceptance_per_position"] == {"0": pytest.approx(16 / 20)}
    assert metrics.spec_decode({}, {}) is None


def test_event_token_sources():
    assert event_tokens({"token_ids": [1, 2, 3], "text": "abc"}) == (3, [1, 2, 3], "token_ids")
    assert event_tokens({"logprobs": {"tokens": ["a", "b"]}, "text": "ab"})[::2] == (2, "logprobs")
    assert event_tokens({"delta": {"content": "hi"}}) == (1, [], "events")
    assert event_tokens({"text": ""}) == (0, [], "events")
