"""Session 19's trial harness (with deferred-copy-trial-cpu-2026-12-05-s19.patch applied):
DraftService.handle and settle timed at batch 16 around drive_rounds, the stub drafter, the
service in process. `copy` runs the histories as before, `borrow` the trial. From the
repository root: python findings/raw/deferred-copy-trial-harness-cpu-2026-12-05-s19.py copy|borrow
"""

import statistics
import sys
import time

sys.path.insert(0, "packages/remote-drafter/benchmarks")
import worker_cost  # noqa: E402

from remote_drafter.bench import drive_rounds  # noqa: E402
from remote_drafter.engine import history  # noqa: E402
from remote_drafter.engine.client import DrafterClient  # noqa: E402
from remote_drafter.engine.transport import LocalTransport  # noqa: E402
from remote_drafter.worker.service import DraftService, ServiceConfig  # noqa: E402

if sys.argv[1] == "copy":  # the rows copied inside the round, as before the trial
    extend = history.History.extend
    history.History.extend = lambda self, tokens, rows, borrow=False: extend(self, tokens, rows, False)
drafter = worker_cost.stub_drafter("bfloat16")
service = DraftService(drafter, ServiceConfig(max_requests=64))
client = DrafterClient(LocalTransport(service), f"64:{drafter.max_depth}", deadline_s=30.0, row_dtype="bfloat16")
times: dict[str, list[float]] = {"handle": [], "settle": [], "propose": []}
timing = [False]


def timed(owner, name: str) -> None:
    f = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            if timing[0]:
                times[name].append(time.perf_counter() - started)
    setattr(owner, name, wrapper)


timed(service, "handle")
timed(service, "settle")
timed(client, "propose")
drive_rounds(client, 16, 400, drafter.max_depth, drafter.vocab_size, drafter.feature, "sync", 0.0, seed=16,
             row_dtype="bfloat16", warm_rounds=worker_cost.in_service(drafter.window),
             timing_starts=lambda: timing.__setitem__(0, True))
print(sys.argv[1], {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items() if v})
