"""Session 20's trial (VM, CPU): DraftService._round as served against a round that does only
what a round must (each session looked up, its history extended and snapshotted, the batch
drafted, the replies encoded: no checks, counters, quotas or reply budget), the stub drafter
at batch 16, requests in service, the service in process; the _round p50 over 1,500 rounds.
From the repository root:
    python findings/raw/service-floor-harness-cpu-2026-12-05-s20.py full|floor
"""

import copy
import statistics
import sys
import time

sys.path.insert(0, "packages/remote-drafter/benchmarks")
import worker_cost  # noqa: E402

from remote_drafter.bench import drive_rounds  # noqa: E402
from remote_drafter.engine import protocol as P  # noqa: E402
from remote_drafter.engine.client import DrafterClient  # noqa: E402
from remote_drafter.engine.transport import LocalTransport  # noqa: E402
from remote_drafter.models.base import DraftRequest  # noqa: E402
from remote_drafter.worker.service import DraftService, ServiceConfig  # noqa: E402

mode = sys.argv[1]
drafter = worker_cost.stub_drafter("bfloat16")
service = DraftService(drafter, ServiceConfig(max_requests=64))
client = DrafterClient(LocalTransport(service), f"64:{drafter.max_depth}", deadline_s=30.0, row_dtype="bfloat16")
times: list[float] = []
timing = [False]
served_round = service._round


def essential_round(request, peer):
    batch = []
    for e in request.entries:
        session = service.sessions[(peer, request.client_id, e.request_id)]
        session.history.extend(e.tokens, e.rows)
        batch.append((e, DraftRequest(copy.copy(session.history), e.k, session.temperature, session.seed)))
    drafts = drafter.draft([r for _, r in batch], False)
    return P.encode_reply([P.Reply(e.request_id, P.STATUS_OK, d.tokens[:e.k])
                           for (e, _), d in zip(batch, drafts)], drafter.vocab_size)


def timed_round(request, peer, started):
    t0 = time.perf_counter()
    try:
        if timing[0] and mode == "floor" and all(e.op == P.OP_CONTINUE for e in request.entries):
            return essential_round(request, peer)
        return served_round(request, peer, started)
    finally:
        if timing[0]:
            times.append(time.perf_counter() - t0)


service._round = timed_round
drive_rounds(client, 16, 1500, drafter.max_depth, drafter.vocab_size, drafter.feature, "sync", 0.0, seed=16,
             row_dtype="bfloat16", warm_rounds=worker_cost.in_service(drafter.window),
             timing_starts=lambda: timing.__setitem__(0, True))
print(mode, "_round p50 ms", round(statistics.median(times) * 1e3, 4))
