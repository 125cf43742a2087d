"""`async-handoff`: check the handoff on this host before enabling it.

  async-handoff selftest                           # the proxy and its flags alone (echo in process)
  OFL_ALLOW=10.0.0.1 ofl serve --listen 10.0.0.2:7471   # on the peer host: an echo server
  async-handoff selftest --adapter async_handoff.adapters:OflMessageAdapter \\
      --adapter-config '{"address": "10.0.0.2:7471", "backend": "tcp"}' --rounds 2048
  async-handoff counters --listen 127.0.0.1:9496   # a running engine's handoff counters
  async-handoff env
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ofl.cli import positive_int
from ofl.env import describe

from . import env
from .handoff import Handoff, HandoffConfig


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object, {...}")
    return value


def cmd_selftest(args) -> int:
    h = Handoff(HandoffConfig.from_env(), args.adapter, args.adapter_config)
    t = time.perf_counter()
    h.start()
    print(f"proxy: {json.dumps(h.proxy_status)}")
    print(f"started in {time.perf_counter() - t:.2f} s; host flags mlock "
          f"{'ok' if h.metrics.mlocked._value.get() else 'FAILED'}")
    if not h.enabled:
        print(f"NOT ready: {h.reason}")
        h.close()
        return 1
    failed = wrong = 0
    for i in range(args.rounds):
        payload = i.to_bytes(8, "little")
        ticket = h.submit(payload)
        reply = None
        end = time.monotonic() + h.config.round_deadline_ms / 1000
        while reply is None and time.monotonic() < end:
            reply = h.wait(ticket)
        failed += reply is None
        wrong += reply is not None and bytes(reply) != payload
    c = h.counters()
    h.close()
    print(f"{args.rounds} rounds: {int(c['rounds_ok'])} ok, {failed} without a reply, {wrong} with a "
          f"reply other than the payload (the peer must echo); watchdog fires "
          f"{int(c['watchdog_fires'])}, respawns {int(c['respawns'])}")
    if failed:
        print(f"rounds without a reply: {int(c['rounds_failed'])} failed, {int(c['rounds_timed_out'])} "
              f"timed out, {int(c['rounds_bad'])} bad (is the peer up and an echo server?)")
    return 0 if failed == wrong == 0 and c["watchdog_fires"] == 0 else 1


def cmd_counters(args) -> int:
    from .exposition import read
    try:
        print(json.dumps(read(args.listen), indent=2))
    except OSError as exc:
        print(f"async-handoff counters: nothing answers at {args.listen} ({exc}); is the engine "
              "running with ASYNC_HANDOFF_METRICS_LISTEN set to it?", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="async-handoff", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("selftest", help="start a proxy, run rounds through it, report",
                       description="Start a proxy as an engine would, run rounds of 8-byte payloads "
                       "through it and check each reply equals its payload; exit 1 on any failed "
                       "round or watchdog fire. The default adapter echoes in the proxy's own "
                       "process (the proxy and the host flags alone); OflMessageAdapter sends each "
                       "round to an echo peer over a link (`ofl serve` there), which checks the "
                       "link too. A drafter worker is not an echo peer.")
    s.add_argument("--adapter", default="async_handoff.adapters:NullAdapter",
                   help="module:Class of the adapter (default: %(default)s, an in-process echo)")
    s.add_argument("--adapter-config", type=json_object, default={},
                   help='its configuration, a JSON object (OflMessageAdapter: {"address": '
                        '"HOST:PORT", "backend": "tcp"})')
    s.add_argument("--rounds", type=positive_int, default=2048, help="rounds to run (%(default)s)")
    s.set_defaults(func=cmd_selftest)
    c = sub.add_parser("counters", help="a running Handoff's counters (ASYNC_HANDOFF_METRICS_LISTEN)",
                       description="Read the counters an engine's Handoff serves on "
                       "ASYNC_HANDOFF_METRICS_LISTEN: rounds ok/failed/timed out/bad, stale "
                       "replies, watchdog fires, respawns, enabled, mlocked (JSON).")
    c.add_argument("--listen", required=True, help="HOST:PORT of ASYNC_HANDOFF_METRICS_LISTEN")
    c.set_defaults(func=cmd_counters)
    e = sub.add_parser("env", help="the environment variables read, with defaults")
    e.set_defaults(func=lambda a: print(describe(env.ALL)) or 0)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
