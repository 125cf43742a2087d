"""Where a worker listens and whom it admits (the flags of `remote-drafter worker` and of
drafter-tp2's launcher, which passes them on to its ranks). Closed by default: loopback
only; an address other hosts can reach needs ofl's admission (OFL_ALLOW or a shared key),
else the worker refuses to start unless --insecure. Torch-free."""

from __future__ import annotations

import argparse

DEFAULT_PORT = 7490  # the Engram server has 7480 on the same host
DEFAULT_LISTEN = f"127.0.0.1:{DEFAULT_PORT}"


def add_exposure_args(p: argparse.ArgumentParser, listener: str = "HOST:PORT") -> None:
    """--listen (what `listener` names) and --insecure."""
    p.add_argument("--listen", default=DEFAULT_LISTEN, help=(
        f"{listener} (port 0: any free). The default, {DEFAULT_LISTEN}, admits this host only. "
        "For an engine on another host listen on an address it reaches and set OFL_ALLOW (the "
        "engine hosts) or OFL_AUTH_KEY_FILE (a shared key; ofl's README, Admission): on such "
        "an address without either the worker refuses to start, unless --insecure"))
    p.add_argument("--insecure", action="store_true", default=None, help=(
        "admit any peer with no allow-list or key on a non-loopback address; logged as a "
        "warning and shown in status (admission: insecure). Default: $OFL_INSECURE (1 = on)"))


def listen_refusal(args) -> str | None:
    """Why ofl would refuse the --listen address (exposed with no admission), asked before
    the drafter loads, so a refused worker costs no load; None when it would serve."""
    from ofl.admission import check_listen
    from ofl.errors import ConfigurationError
    from ofl.server import parse_address
    try:
        check_listen(parse_address(args.listen, DEFAULT_PORT)[0], args.insecure)
    except ConfigurationError as exc:
        return str(exc)
    return None


def exposure_argv(args) -> list[str]:
    """add_exposure_args' flags as given (a launcher passing them on to its ranks)."""
    return ["--listen", args.listen, *(["--insecure"] if args.insecure else [])]
