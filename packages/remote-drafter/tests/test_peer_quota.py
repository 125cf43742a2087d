"""Quotas keyed on what the worker knows, not on what a peer says: a real worker over ofl
tcp on loopback, its peers on other addresses of 127.0.0.0/8 (other hosts, to the worker).

(a) The quota was charged per client id, a number the sender writes in each message: a peer
rotating ids took every slot. Now it is charged per peer address, across all that peer's
connections and ids; the opens past it get `quota`, counted, and the worker keeps serving.
(b) Two peers each get their own quota, and name their own requests: the same client and
request ids from another address reach nothing of the first peer's.
(c) Closed by default: on an address other hosts can reach, with neither OFL_ALLOW nor a
key, the worker refuses to start in one line; with --insecure it serves and says so.
Every wait is on a reply or a process's exit, never a sleep."""

import subprocess
import sys

import numpy as np
import pytest

from remote_drafter.engine import protocol as P
from remote_drafter.engine.identity import Manifest
from remote_drafter.engine.transport import worker_stats
from remote_drafter.worker.server import spawn_worker

testing = pytest.importorskip("remote_drafter.testing", reason="the worker needs torch")

ADMISSION = ("OFL_ALLOW", "OFL_AUTH_KEY", "OFL_AUTH_KEY_FILE", "OFL_INSECURE")
SLOTS = 8
SHARE = SLOTS // 2  # the worker's default quota: half the slots
CLIENT = 7
REPEATING = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2)  # the n-gram drafter proposes 4, 5, 6 after 3
OTHER = (5, 6, 7, 5, 6)  # ... and 5, 6, 7 after 7


@pytest.fixture
def no_admission(monkeypatch):
    """No allow-list, key or insecure flag from the environment the workers inherit."""
    for name in ADMISSION:
        monkeypatch.setenv(name, "")


@pytest.fixture
def worker(no_admission):
    """`remote-drafter worker --drafter ngram --max-requests 8` on 127.0.0.1."""
    w = testing.WorkerProcess("ngram", None, "tcp", 0, "--max-requests", str(SLOTS))
    yield w
    w.stop()


def peer(source: str, worker) -> testing.ConnectionFrom:
    return testing.ConnectionFrom(source, worker.address, backend="tcp")


def send(conn, entries, client_id: int) -> list[P.Reply]:
    fingerprint = Manifest.from_json(conn.peer_metadata["remote_drafter"]["manifest"]).fingerprint
    payload = P.encode_request(entries, fingerprint, client_id=client_id)
    return P.parse_reply(conn.request(payload, deadline_s=30))


def opens(ids, tokens=REPEATING) -> list[P.Entry]:
    return [P.Entry(i, P.OP_OPEN, np.array(tokens, np.int32), None, 0, length=len(tokens))
            for i in ids]


def step(request_id: int, token: int, length: int) -> P.Entry:
    """A continue: one committed token, `length` after it, three drafts wanted."""
    return P.Entry(request_id, P.OP_CONTINUE, np.array([token], np.int32), None, 3, length=length)


def status_of(replies) -> list[str]:
    return [P.STATUS_NAMES[r.status] for r in replies]


def test_a_peer_rotating_client_ids_holds_one_quota(worker):
    with peer("127.0.0.2", worker) as first, peer("127.0.0.2", worker) as second:
        # each open under a fresh client id, on alternate connections of one address
        grabbed = [status_of(send(conn, opens([0]), client_id=100 + i))[0]
                   for i, conn in enumerate([first, second] * SLOTS)]
        assert grabbed == ["ok"] * SHARE + ["quota"] * (2 * SLOTS - SHARE)
        refused = send(first, opens([0]), client_id=999)[0]
        assert "holds 4 requests" in refused.message and "client ids" in refused.message

        with peer("127.0.0.3", worker) as other:  # the rest of the slots are still there
            served = send(other, opens([0, 1, 2, 3]), CLIENT)
            assert status_of(served) == ["ok"] * SHARE
            assert send(other, [step(0, 3, len(REPEATING) + 1)], CLIENT)[0].tokens.tolist() == [4, 5, 6]

        # the rotating peer is still served: a release frees one of its own slots
        assert status_of(send(second, [P.Entry(0, P.OP_RELEASE)], client_id=100)) == ["released"]
        assert status_of(send(second, opens([0]), client_id=1000)) == ["ok"]

    stats = worker_stats(worker.address)
    assert stats["quota_refusals"] == 2 * SLOTS - SHARE + 1 and stats["capacity_refusals"] == 0
    assert stats["open_requests"] == 2 * SHARE and stats["peers_holding_requests"] == 2
    assert sorted(stats["peers"].values(), key=lambda p: p["quota_refusals"]) == [
        {"requests": SHARE, "history_bytes": SHARE * stats["bytes_per_request"],
         "quota_refusals": 0, "client_ids": 1},
        {"requests": SHARE, "history_bytes": SHARE * stats["bytes_per_request"],
         "quota_refusals": 2 * SLOTS - SHARE + 1, "client_ids": SHARE}]
    assert not {"127.0.0.2", "127.0.0.3"} & stats["peers"].keys()  # digests, not addresses
    assert stats["admission"]["exposure"] == "loopback"


def test_two_peers_have_their_own_quota_and_requests(worker):
    with peer("127.0.0.2", worker) as a, peer("127.0.0.3", worker) as b:
        assert status_of(send(a, opens(range(SLOTS)), CLIENT)) == ["ok"] * SHARE + ["quota"] * SHARE
        # the same client id from another address: a quota of its own (the worker's other
        # half), and request 0 twice
        assert status_of(send(b, opens([0, 10, 11, 12], OTHER), CLIENT)) == ["ok"] * SHARE

        # b cannot reach a's requests 1 and 2: continuing one is unknown, releasing the
        # other releases nothing of a's
        assert status_of(send(b, [step(1, 3, len(REPEATING) + 1), P.Entry(2, P.OP_RELEASE)],
                              CLIENT)) == ["unknown_request", "released"]
        assert send(a, [step(2, 3, len(REPEATING) + 1)], CLIENT)[0].tokens.tolist() == [4, 5, 6]

        # request 0 is two requests, each continuing its own peer's history
        assert send(a, [step(0, 3, len(REPEATING) + 1)], CLIENT)[0].tokens.tolist() == [4, 5, 6]
        assert send(b, [step(0, 7, len(OTHER) + 1)], CLIENT)[0].tokens.tolist() == [5, 6, 7]

    stats = worker_stats(worker.address)
    assert stats["open_requests"] == SLOTS and stats["unknown_requests"] == 1
    assert sorted((p["requests"], p["quota_refusals"]) for p in stats["peers"].values()) == [
        (SHARE, 0), (SHARE, SHARE)]


def test_an_exposed_worker_without_admission_refuses_to_start_in_one_line(no_admission):
    refused = subprocess.run([sys.executable, "-m", "remote_drafter.cli", "worker", "--drafter",
                              "ngram", "--listen", "0.0.0.0:0"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stdout == ""
    (line,) = refused.stderr.splitlines()
    assert line.startswith("remote-drafter worker: refusing to listen on 0.0.0.0")
    assert all(name in line for name in ("OFL_ALLOW", "OFL_AUTH_KEY", "--insecure")), line


def test_an_exposed_worker_with_insecure_serves_and_says_so(no_admission):
    proc, address = spawn_worker(["--drafter", "ngram", "--listen", "0.0.0.0:0", "--insecure"],
                                 stderr=subprocess.PIPE)
    try:
        assert address.startswith("0.0.0.0:")
        admission = worker_stats(address.replace("0.0.0.0", "127.0.0.1"))["admission"]
        assert (admission["exposure"], admission["allow"], admission["key"]) == ("insecure", [], False)
    finally:
        proc.terminate()
        _, log = proc.communicate(timeout=30)
    assert "OFL_INSECURE" in log  # the warning, on the worker's log
