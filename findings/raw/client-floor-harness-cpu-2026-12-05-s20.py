"""Session 20's trial (VM, CPU): the client's share of a round (DrafterClient.propose less the
service's handle, both timed in process) as served, against a propose that does only what a
round must on the client's side (each request's continue entry made from its history's
views, the request encoded, the reply parsed, the drafts mapped: no budget, ordering, counters
or reply checks), the stub drafter at batch 16, requests in service; p50s over 1,500 rounds.
From the repository root:
    python findings/raw/client-floor-harness-cpu-2026-12-05-s20.py full|floor
"""

import statistics
import sys
import time

sys.path.insert(0, "packages/remote-drafter/benchmarks")
import worker_cost  # noqa: E402

from remote_drafter.bench import drive_rounds  # noqa: E402
from remote_drafter.engine import protocol as P  # noqa: E402
from remote_drafter.engine.client import DrafterClient, Drafts  # noqa: E402
from remote_drafter.engine.transport import LocalTransport  # noqa: E402
from remote_drafter.worker.service import DraftService, ServiceConfig  # noqa: E402

mode = sys.argv[1]
drafter = worker_cost.stub_drafter("bfloat16")
service = DraftService(drafter, ServiceConfig(max_requests=64))
client = DrafterClient(LocalTransport(service), f"64:{drafter.max_depth}", deadline_s=30.0, row_dtype="bfloat16")
times: dict[str, list[float]] = {"propose": [], "handle": []}
timing = [False]
served_propose, served_handle = client.propose, service.handle


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


def timed(name: str, served, essential=None):
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            plain = not client.releases and not any(r.needs_open or r.deferred for r in client.requests.values())
            if essential is not None and timing[0] and mode == "floor" and plain:
                return essential(*args, **kwargs)
            return served(*args, **kwargs)
        finally:
            if timing[0]:
                times[name].append(time.perf_counter() - t0)
    return call


client.propose = timed("propose", served_propose, essential_propose)
service.handle = timed("handle", served_handle)
drive_rounds(client, 16, 1500, drafter.max_depth, drafter.vocab_size, drafter.feature, "sync", 0.0, seed=16,
             row_dtype="bfloat16", warm_rounds=worker_cost.in_service(drafter.window),
             timing_starts=lambda: timing.__setitem__(0, True))
propose, handle = statistics.median(times["propose"]), statistics.median(times["handle"])
print(mode, f"propose p50 {propose * 1e3:.4f} ms, handle p50 {handle * 1e3:.4f} ms, "
      f"the client's share {(propose - handle) * 1e3:.4f} ms")
