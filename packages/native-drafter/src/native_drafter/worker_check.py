"""`remote-drafter worker --kernels native` against `--kernels torch`: both started as the
operator starts them, the same requests sent to each through the engine's client, batched
and one request per round; the drafts compared token for token (the GPU script on real
states, the CI test on a tiny drafter under the Triton interpreter)."""

from __future__ import annotations

from remote_drafter.engine.client import DrafterClient
from remote_drafter.engine.identity import expectation
from remote_drafter.engine.transport import RemoteTransport
from remote_drafter.worker.server import spawn_worker

ROUNDS = 16  # rounds per batch before a request without drafts counts as not drafted


def drafts_from_worker(address: str, target: str, requests, depth: int, batch: int) -> tuple[list, dict]:
    """Each request's draft tokens (None where the worker gave none), `batch` requests per
    client; no commits between its rounds, so a request's drafts stay the same."""
    out, described = [], {}
    for lo in range(0, len(requests), batch):
        client = DrafterClient(RemoteTransport(address, "tcp", expectation(target, None)),
                               f"{len(requests)}:{depth}", deadline_s=120)
        try:
            chunk = requests[lo:lo + batch]
            for i, r in enumerate(chunk):
                client.add_request(i, r.history.tokens, r.history.rows, r.temperature, r.seed)
            drafts: dict[int, list] = {}
            for _ in range(ROUNDS):  # a round carries what fits the link: later opens wait a round
                got = client.propose()
                drafts.update({i: d.tokens.tolist() for i, d in got.items() if i not in drafts})
                if len(drafts) == len(chunk):
                    break
            out += [drafts.get(i) for i in range(len(chunk))]
            described = client.transport.info(120).described["drafter"]
        finally:
            client.close()
    return out, described


def compare_workers(checkpoint: str, target: str, requests, device: str, depth: int, env=None) -> dict:
    drafts = {}
    for kernels in ("torch", "native"):
        proc, address = spawn_worker(["--listen", "127.0.0.1:0", "--drafter", checkpoint, "--target", target,
                                      "--device", device, "--kernels", kernels], env=env)
        try:
            batched, described = drafts_from_worker(address, target, requests, depth, len(requests))
            single, _ = drafts_from_worker(address, target, requests, depth, 1)
        finally:
            proc.terminate()
            proc.wait(60)
        if described.get("kernels", "torch") != kernels:
            raise RuntimeError(f"the worker started with --kernels {kernels} describes {described}")
        drafts[kernels] = batched + single
    pairs = list(zip(drafts["torch"], drafts["native"]))
    return {"entries": len(pairs), "drafted": sum(a is not None and b is not None for a, b in pairs),
            "identical": sum(a == b and a is not None for a, b in pairs), "drafts": drafts}
