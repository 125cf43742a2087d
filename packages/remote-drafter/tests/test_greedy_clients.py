"""A greedy or hostile client against a real worker process.

(a) One 15 KB message of 256 opens took every request slot, so the engine's next open got
`capacity` until the idle expiry: now a peer (its address, all its connections and client
ids) holds at most its quota (half the slots by default), the excess gets status `quota`,
counted, and shown per peer in `status` (tests/test_peer_quota.py: peers rotating ids).
(b) A 224-byte request (two opens, k = 8, probabilities over the n-gram drafter's 2**20
tokens) made the worker build a 67 MB reply the link then refused: now each entry's reply
is sized before anything is drafted and refused when it would not fit.
The worker keeps serving; every wait is on a reply or a counter, never a sleep."""

import numpy as np
import pytest

from ofl import Connection
from remote_drafter.engine import protocol as P
from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.identity import Manifest
from remote_drafter.engine.transport import RemoteTransport, worker_stats
from remote_drafter.models.ngram import NgramDrafter
from remote_drafter.worker.service import DraftService

MiB = 1 << 20
HOSTILE, PROBER = 0xBAD, 0x5EE
REPEATING = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2)  # the n-gram drafter proposes 3..10 after it


def worker_process(*flags, env=None):
    testing = pytest.importorskip("remote_drafter.testing", reason="the worker needs torch")
    return testing.WorkerProcess("ngram", None, "tcp", 0, *flags, env=env)


def connection_from(source: str, address: str) -> Connection:
    """A connection from `source` (of 127.0.0.0/8): to the worker, another host."""
    testing = pytest.importorskip("remote_drafter.testing", reason="the worker needs torch")
    return testing.ConnectionFrom(source, address, backend="tcp")


@pytest.fixture(scope="module")
def worker():
    """`remote-drafter worker --drafter ngram` at its defaults; with no target the n-gram
    drafter's vocabulary is 2**20 tokens."""
    w = worker_process()
    yield w
    w.stop()


def opens(ids, k=0, want_probs=False, tokens=(1, 2, 3)):
    return [P.Entry(i, P.OP_OPEN, np.array(tokens, np.int32), None, k, want_probs=want_probs,
                    length=len(tokens)) for i in ids]


def fingerprint(conn: Connection) -> bytes:
    return Manifest.from_json(conn.peer_metadata["remote_drafter"]["manifest"]).fingerprint


def send(conn: Connection, entries, client_id: int) -> list[P.Reply]:
    payload = P.encode_request(entries, fingerprint(conn), client_id=client_id)
    return P.parse_reply(conn.request(payload, deadline_s=30))


def status_of(replies) -> list[str]:
    return [P.STATUS_NAMES[r.status] for r in replies]


def test_one_message_of_opens_cannot_take_the_engines_slots(worker):
    with connection_from("127.0.0.2", worker.address) as hostile:  # the engine: 127.0.0.1
        described = hostile.peer_metadata["remote_drafter"]
        slots = described["max_requests"]
        request = P.encode_request(opens(range(slots)), fingerprint(hostile), client_id=HOSTILE)
        assert len(request) < 16 << 10  # one small message asks for every slot
        grabbed = status_of(P.parse_reply(hostile.request(request, deadline_s=30)))

        engine = DrafterClient(RemoteTransport(worker.address, "tcp"), "8:3", deadline_s=30)
        try:
            engine.add_request(1, [5, 6, 7, 5, 6])
            drafts = engine.propose()
            assert 1 in drafts and drafts[1].tokens.tolist() == [7, 5, 6], engine.counters()
            assert engine.counters()["capacity_refusals"] == engine.counters()["quota_refusals"] == 0
        finally:
            engine.close()

        share = described["max_requests_per_client"]
        assert share == slots // 2
        assert grabbed == ["ok"] * share + ["quota"] * (slots - share)
        again = send(hostile, opens(range(slots, 2 * slots)), HOSTILE)
        assert status_of(again) == ["quota"] * slots
        assert "quota" in again[0].message and f"holds {share} requests" in again[0].message
        assert status_of(send(hostile, [P.Entry(0, P.OP_RELEASE)], HOSTILE)) == ["released"]
        assert status_of(send(hostile, opens([slots]), HOSTILE)) == ["ok"]  # a release frees its slot

    stats = worker_stats(worker.address)
    refused = 2 * slots - share
    assert stats["quota_refusals"] == refused and stats["capacity_refusals"] == 0
    assert stats["open_requests"] == share + 1
    per_request = described["bytes_per_request"]
    assert stats["peers_holding_requests"] == 2
    assert sorted(stats["peers"].values(), key=lambda c: c["requests"]) == [
        {"requests": 1, "history_bytes": per_request, "quota_refusals": 0, "client_ids": 1},
        {"requests": share, "history_bytes": share * per_request, "quota_refusals": refused,
         "client_ids": 1}]
    assert not {"127.0.0.1", "127.0.0.2"} & stats["peers"].keys()  # digests, not addresses


def peak_rss_since_reset(pid: int, reset: bool = False) -> int:
    """The peak resident memory of `pid` (VmHWM) since the last reset; reset = start over
    from its current RSS (so a larger peak at start-up does not hide what follows)."""
    if reset:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


def test_a_small_request_cannot_make_the_worker_build_a_huge_reply(worker):
    with Connection(worker.address, backend="tcp") as prober:
        assert prober.peer_metadata["remote_drafter"]["drafter"]["vocab_size"] == 1 << 20
        request = P.encode_request(opens((1, 2), k=8, want_probs=True, tokens=REPEATING),
                                   fingerprint(prober), client_id=PROBER)
        assert len(request) == 216
        pid = worker.proc.pid
        before = peak_rss_since_reset(pid, reset=True)
        replies = P.parse_reply(prober.request(request, deadline_s=30))
        grown = peak_rss_since_reset(pid) - before
        assert status_of(replies) == ["invalid", "invalid"]
        assert "reply too large" in replies[0].message and "4194304-byte" in replies[0].message
        assert grown < 4 * MiB, f"peak RSS grew {grown / MiB:.1f} MiB answering a 224-byte request"
        served = send(prober, opens((3,), k=8, tokens=REPEATING), PROBER)  # no probabilities: fits
        assert served[0].ok and served[0].tokens.tolist() == list(range(3, 11))
    stats = worker_stats(worker.address)
    assert stats["reply_size_refusals"] == 2 and stats["drafts"] >= 8


def test_quotas_come_from_flags_and_the_environment():
    per_request = 4 * 4096  # the n-gram drafter's history: its tokens only
    w = worker_process("--max-requests", "8", "--max-requests-per-client", "3",
                       env={"REMOTE_DRAFTER_MAX_HISTORY_BYTES_PER_CLIENT": str(2 * per_request + 1)})
    try:
        with Connection(w.address, backend="tcp") as conn:
            described = conn.peer_metadata["remote_drafter"]
            assert described["bytes_per_request"] == per_request
            assert described["max_requests_per_client"] == 2  # the tighter quota: bytes
            assert described["max_history_bytes_per_client"] == 2 * per_request
            replies = send(conn, opens(range(4)), HOSTILE)
        assert status_of(replies) == ["ok", "ok", "quota", "quota"]
        assert f"{2 * per_request} bytes of history" in replies[2].message
    finally:
        w.stop()


def test_quotas_that_admit_no_request_stop_the_worker_with_the_reason(capsys):
    pytest.importorskip("torch", reason="the worker needs torch")
    from remote_drafter.cli import main
    assert main(["worker", "--drafter", "ngram", "--listen", "127.0.0.1:0", "--max-requests", "8",
                 "--max-requests-per-client", "9"]) == 2
    assert "max_requests_per_client 9 is not between 1 and max_requests 8" in capsys.readouterr().err
    assert main(["worker", "--drafter", "ngram", "--listen", "127.0.0.1:0",
                 "--max-history-bytes-per-client", "100"]) == 2
    assert "below one request's 16384 bytes" in capsys.readouterr().err
    assert main(["worker", "--drafter", "ngram", "--listen", "127.0.0.1:0", "--max-requests", "0"]) == 2
    assert "max_requests 0: a worker holds at least 1 request" in capsys.readouterr().err


def test_replies_are_sized_before_drafting_entry_by_entry():
    """In-process, torch-free: a round's entries share the link's reply; those that would
    overflow it are refused before they change state, the reply fits, the counters say so."""
    drafter = NgramDrafter(vocab_size=4096)
    service = DraftService(drafter)
    service.max_reply_bytes = MiB
    each = P.reply_entry_bytes(8, 4096)  # 131,608 B: 7 fit in 1 MiB
    payload = P.encode_request(opens(range(10), k=8, want_probs=True, tokens=REPEATING),
                               drafter.manifest().fingerprint)
    reply = service.handle(payload)
    assert len(reply) <= MiB and (MiB - P.REPLY_HEADER.itemsize) // each == 7
    assert status_of(P.parse_reply(reply)) == ["ok"] * 7 + ["invalid"] * 3
    stats = service.stats()
    assert stats["reply_size_refusals"] == 3 and stats["open_requests"] == 7
    text = service.metrics.prometheus()
    assert "remote_drafter_worker_reply_size_refusals_total 3.0" in text
    assert "remote_drafter_worker_quota_refusals_total 0.0" in text
