"""Session 20's trial (VM, CPU): one side of a round as served against a form of it that does
only what a round must, the stub drafter at batch 16, requests in service, in process; p50s
over 1,500 rounds. From the repository root:
    python findings/raw/round-floor-harness-cpu-2026-12-05-s20.py service|client full|floor|no-snapshot [on|off|freeze]

service: DraftService._round; its essential form looks each session up, extends and
snapshots its history, drafts the batch and encodes the replies (no checks, counters,
quotas, reply budget, locks, idle-expiry time stamps or per-reply server time).
client: the client's share of the round (DrafterClient.propose less the service's handle);
its essential form makes each continue entry from its history's views, encodes the request,
parses the reply and maps the drafts (no budget, ordering, counters or reply checks).
no-snapshot: as served, but the service drafts from each live history instead of a
snapshot of it (copy.copy made the identity: unsafe, a trial of what the snapshots cost).
on|off|freeze: the cyclic garbage collector as it is, disabled, or with every object made
before the first timed round frozen out of its collections (default: on).
"""

import copy
import gc
import statistics
import sys
import time

sys.path.insert(0, "packages/remote-drafter/benchmarks")
import worker_cost  # noqa: E402

from remote_drafter.bench import drive_rounds  # noqa: E402
from remote_drafter.engine import protocol as P  # noqa: E402
from remote_drafter.engine.client import DrafterClient, Drafts  # noqa: E402
from remote_drafter.engine.transport import LocalTransport  # noqa: E402
from remote_drafter.models.base import DraftRequest  # noqa: E402
from remote_drafter.worker.service import DraftService, ServiceConfig  # noqa: E402

side, mode = sys.argv[1], sys.argv[2]
collector = sys.argv[3] if len(sys.argv) > 3 else "on"
drafter = worker_cost.stub_drafter("bfloat16")
service = DraftService(drafter, ServiceConfig(max_requests=64))
client = DrafterClient(LocalTransport(service), f"64:{drafter.max_depth}", deadline_s=30.0, row_dtype="bfloat16")
times: dict[str, list[float]] = {"_round": [], "propose": [], "handle": []}
timing = [False]


def essential_round(request, peer, started):
    batch = []
    for e in request.entries:
        session = service.sessions[(peer, request.client_id, e.request_id)]
        session.history.extend(e.tokens, e.rows)
        batch.append((e, DraftRequest(copy.copy(session.history), e.k, session.temperature, session.seed)))
    drafts = drafter.draft([r for _, r in batch], False)
    return P.encode_reply([P.Reply(e.request_id, P.STATUS_OK, d.tokens[:e.k])
                           for (e, _), d in zip(batch, drafts)], drafter.vocab_size)


def essential_propose(k=None):
    info = client.transport.info(client.deadline_s)
    k = min(client.depth(k), info.max_depth)
    entries = []
    for rid, r in client.requests.items():
        entries.append(client._entry(rid, r, k, info))
        r.pending_tokens = r.pending_rows = 0
    payload = P.request_parts(entries, info.fingerprint, client.row_dtype, client_id=client.client_id)
    replies = P.parse_reply(client.transport.call(payload, client.deadline_s))
    return {e.request_id: Drafts(r.tokens, None, False) for e, r in zip(entries, replies) if len(r.tokens)}


def plain_round() -> bool:
    """Every request a continue: what the essential forms handle."""
    return not client.releases and not any(r.needs_open or r.deferred for r in client.requests.values())


def timed(owner, name: str, essential=None):
    served = getattr(owner, name)

    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            if essential is not None and timing[0] and mode == "floor" and plain_round():
                return essential(*args, **kwargs)
            return served(*args, **kwargs)
        finally:
            if timing[0]:
                times[name].append(time.perf_counter() - t0)
    setattr(owner, name, call)


def start_timing() -> None:
    timing[0] = True
    if collector == "off":
        gc.disable()
    elif collector == "freeze":
        gc.freeze()


collections = [0]
gc.callbacks.append(lambda phase, info: collections.__setitem__(0, collections[0] + (phase == "start")))
if mode == "no-snapshot":
    copy.copy = lambda history: history
if side == "service":
    timed(service, "_round", essential_round)
else:
    timed(client, "propose", essential_propose)
    timed(service, "handle")
drive_rounds(client, 16, 1500, drafter.max_depth, drafter.vocab_size, drafter.feature, "sync", 0.0, seed=16,
             row_dtype="bfloat16", warm_rounds=worker_cost.in_service(drafter.window),
             timing_starts=start_timing)
head = f"{side} {mode} gc={collector} ({collections[0]} collections in the run)"
if side == "service":
    print(head, f"_round p50 {statistics.median(times['_round']) * 1e3:.4f} ms")
else:
    propose, handle = statistics.median(times["propose"]), statistics.median(times["handle"])
    print(head, f"propose p50 {propose * 1e3:.4f} ms, handle p50 {handle * 1e3:.4f} ms, "
          f"the client's share {(propose - handle) * 1e3:.4f} ms")
