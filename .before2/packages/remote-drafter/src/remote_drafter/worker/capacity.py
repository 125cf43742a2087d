"""The worker's capacity settings: how many requests it holds and for whom (the flags of
`remote-drafter worker` and of drafter-tp2's launcher, which passes them on to its ranks),
turned into ServiceConfig's fields. Torch-free."""

from __future__ import annotations

import argparse

from remote_drafter import env


def add_capacity_args(p: argparse.ArgumentParser) -> None:
    """What a worker holds and for whom (this worker's and drafter-tp2's flags)."""
    p.add_argument("--max-requests", type=int, default=256,
                   help="requests held at once; more opens are refused with a clear reply")
    p.add_argument("--max-requests-per-client", type=quota,
                   default=env.REMOTE_DRAFTER_MAX_REQUESTS_PER_CLIENT.get(),
                   help="requests one client may hold, so one client cannot take the slots "
                        "another needs; a client here is one peer address, all its connections "
                        "and client ids (every engine rank on one host shares it); more opens get "
                        "status 'quota' (auto: half of --max-requests; default: "
                        "$REMOTE_DRAFTER_MAX_REQUESTS_PER_CLIENT, else auto)")
    p.add_argument("--max-history-bytes-per-client", type=quota,
                   default=env.REMOTE_DRAFTER_MAX_HISTORY_BYTES_PER_CLIENT.get(),
                   help="bytes of history one client (one peer address, as above) may hold, "
                        "each request charged what its history can grow to (status: "
                        "bytes_per_request) when it opens (auto: no bound beyond the request "
                        "quota; default: $REMOTE_DRAFTER_MAX_HISTORY_BYTES_PER_CLIENT, else auto)")
    p.add_argument("--idle-timeout-s", type=float, default=600,
                   help="release a request not seen for this long")


def capacity_argv(args) -> list[str]:
    """add_capacity_args' flags as given (a launcher passing them on to its ranks)."""
    def auto(value):
        return "auto" if value is None else str(value)
    return ["--max-requests", str(args.max_requests), "--idle-timeout-s", str(args.idle_timeout_s),
            "--max-requests-per-client", auto(args.max_requests_per_client),
            "--max-history-bytes-per-client", auto(args.max_history_bytes_per_client)]


def capacity_config(args) -> dict:
    """ServiceConfig's capacity fields from add_capacity_args' flags."""
    per_client = args.max_requests_per_client
    if per_client is None:  # auto: half the slots, so one peer cannot take them all
        per_client = max(args.max_requests // 2, 1)
    return {"max_requests": args.max_requests, "idle_timeout_s": args.idle_timeout_s,
            "max_requests_per_client": per_client,
            "max_history_bytes_per_client": args.max_history_bytes_per_client}


def quota(text: str) -> int | None:
    """A per-client (per peer address) quota flag: a number, or auto (None)."""
    return None if text == "auto" else int(text)
