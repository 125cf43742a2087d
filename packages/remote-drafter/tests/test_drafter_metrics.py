"""The counters and histograms behind status and /metrics: what a scrape shows is what was
counted, from every thread. CPU, no network."""

import threading

from prometheus_client.parser import text_string_to_metric_families

from remote_drafter.engine.metrics import LATENCY_BUCKETS, Metrics


def scrape(metrics: Metrics) -> dict[str, float]:
    return {s.name + str(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(metrics.prometheus()) for s in family.samples}


def test_counters_and_histograms_as_prometheus_reads_them():
    m = Metrics("t", {"rounds": "Rounds", "drafts": "Drafts"}, {"round": "Round time"})
    m.inc("rounds")
    m.inc("rounds", 2)
    m.inc("drafts", 7)
    for seconds in (5e-5, 1e-4, 3e-4, 2.0):  # at a bound counts into it (le), 2 s above all
        m.observe("round", seconds)
    got = scrape(m)
    assert got["t_rounds_total[]"] == 3 and got["t_drafts_total[]"] == 7
    assert got["t_round_seconds_bucket[('le', '0.0001')]"] == 2
    assert got["t_round_seconds_bucket[('le', '0.00025')]"] == 2
    assert got["t_round_seconds_bucket[('le', '0.0005')]"] == 3
    assert got[f"t_round_seconds_bucket[('le', '{LATENCY_BUCKETS[-1]}')]"] == 3
    assert got["t_round_seconds_bucket[('le', '+Inf')]"] == 4 and got["t_round_seconds_count[]"] == 4
    assert abs(got["t_round_seconds_sum[]"] - 2.00045) < 1e-12
    snap = m.snapshot()
    assert snap["rounds"] == 3 and snap["round_count"] == 4 and snap["round_max_ms"] == 2000.0


def test_counts_from_many_threads_are_all_kept():
    m = Metrics("t", {"n": "N"}, {"h": "H"})

    def work():
        for _ in range(20_000):
            m.inc("n")
            m.observe("h", 1e-3)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.value("n") == 80_000 and scrape(m)["t_h_seconds_count[]"] == 80_000


def test_a_counter_never_goes_down():
    m = Metrics("t", {"n": "N"}, {})
    try:
        m.inc("n", -1)
    except ValueError as exc:
        assert "decreased" in str(exc)
    else:
        raise AssertionError("a negative increment was taken")
    assert m.value("n") == 0


def test_a_rounds_counts_at_once_equal_them_one_by_one():
    one, many = (Metrics("t", {"rounds": "R", "drafts": "D"}, {"round": "T"}) for _ in range(2))
    times = [5e-5, 1e-4, 3e-4, 2.0, 7e-3]
    for seconds in times:
        one.observe("round", seconds)
    one.inc("rounds", 2)
    one.inc("drafts", 9)
    many.observe_all("round", times)
    many.add({"rounds": 2, "drafts": 9})
    many.observe_all("round", [])  # an empty round observes nothing
    many.add({})
    assert scrape(many) == scrape(one)
    assert many.snapshot() == one.snapshot()
    try:
        many.add({"rounds": 1, "drafts": -1})
    except ValueError as exc:
        assert "decreased" in str(exc)
    else:
        raise AssertionError("a negative count was taken")
    assert many.value("rounds") == 2  # refused whole: no counter of the call changed
