"""Who a server lets in, and how each side proves the shared key.

* An allow-list of peer addresses or networks, checked at accept, before the peer takes a
  connection slot (ofl servers and the HTTP metrics endpoints alike).
* Closed by default: a server on an address other hosts can reach needs an allow-list or a
  key, or an explicit insecure flag (logged, shown in status); loopback needs neither.
* The key proof, both ways. A client that holds a key says so in its HELLO with a fresh
  nonce (`"auth": AUTH_SCHEME, "nonce": ...`); a server with the key answers with a
  CHALLENGE carrying its own proof over the client's nonce and a fresh nonce of its own;
  the client checks the server's proof before it proves anything, then replies with a
  PROOF over the server's nonce. Proofs are HMAC-SHA256(key, label + nonce), with one label
  per direction so neither side's proof can be replayed as the other's. The key never
  crosses the wire and a recorded proof is worthless on the next connection. A keyed
  client refuses a server that proves nothing or proves wrong; a server without a key
  answers HELLO_OK at once, and a client without a key never advertises one, so peers
  with no key on either side still talk.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import stat

from . import env
from .errors import ConfigurationError

AUTH_SCHEME = "hmac-sha256"
PROOF_LABEL = b"ofl key proof v1\0"  # the client's proof
SERVER_PROOF_LABEL = b"ofl server proof v1\0"
NONCE_BYTES = 32
MIN_KEY_CHARS = 32

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_allow(text: str) -> list[Network]:
    """OFL_ALLOW's value as networks (an address is a network of one); [] = any peer."""
    networks = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ConfigurationError(f"OFL_ALLOW: {entry!r} is neither an address nor a network "
                             "(e.g. 10.0.0.2 or 10.0.1.0/24)") from None
    return networks


def peer_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """A peer's address as the server knows it (an IPv4-mapped IPv6 address as IPv4)."""
    address = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return address


def admitted(host: str, networks: list[Network]) -> bool:
    return not networks or any(peer_address(host) in net for net in networks)


def exposure(bound_host: str, networks: list[Network], key: bytes | None, insecure: bool) -> str:
    """How a listener bound to `bound_host` is reachable: "loopback", "allow-list", "key",
    "allow-list and key", or "insecure". ConfigurationError when other hosts could reach it
    with neither an allow-list nor a key and insecure is not set."""
    if peer_address(bound_host).is_loopback:
        return "loopback"
    if networks or key:
        return " and ".join(n for n, on in (("allow-list", networks), ("key", key)) if on)
    if insecure:
        return "insecure"
    raise ConfigurationError(
        f"refusing to listen on {bound_host}, an address other hosts can reach, with neither "
        "an allow-list (OFL_ALLOW) nor a shared key (OFL_AUTH_KEY or OFL_AUTH_KEY_FILE): any "
        "peer could use this server. Set one of them, listen on 127.0.0.1, or pass --insecure "
        "(OFL_INSECURE=1) to admit every peer anyway")


def check_listen(host: str, insecure: bool | None = None) -> str:
    """exposure() of a listener about to bind `host` (a name is resolved as the bind would),
    with this process's OFL_ALLOW, key and OFL_INSECURE: a server that loads for minutes
    calls it first, so a refused address costs no load."""
    import socket
    bound = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][4][0]
    return exposure(bound, parse_allow(env.OFL_ALLOW.get()), configured_key(),
                    env.OFL_INSECURE.get() == "1" if insecure is None else insecure)


def load_key(text: str) -> bytes | None:
    """OFL_AUTH_KEY's value as HMAC key bytes, None when empty. The error names the
    variable and the length, never the value."""
    if not text:
        return None
    if len(text) < MIN_KEY_CHARS:
        raise ConfigurationError(f"OFL_AUTH_KEY holds {len(text)} characters; use at least "
                         f"{MIN_KEY_CHARS} (generate one with: openssl rand -hex 32)")
    return text.encode()


def configured_key(key: str | None = None) -> bytes | None:
    """The shared key: `key` when given, else OFL_AUTH_KEY, else OFL_AUTH_KEY_FILE's content;
    None when none is set."""
    if key is not None:
        return load_key(key)
    text, path = env.OFL_AUTH_KEY.get(), env.OFL_AUTH_KEY_FILE.get()
    if text and path:
        raise ConfigurationError("both OFL_AUTH_KEY and OFL_AUTH_KEY_FILE are set: set one")
    return load_key(read_key_file(path) if path else text)


def read_key_file(path: str) -> str:
    """The key in `path`, refused when the file is missing or others may read it."""
    try:
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigurationError(f"OFL_AUTH_KEY_FILE {path} may be read by others (mode "
                                     f"{stat.S_IMODE(mode):04o}): chmod 600 {path}")
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        raise ConfigurationError(f"OFL_AUTH_KEY_FILE {path}: {exc.strerror}") from None


def proof(key: bytes, nonce: bytes, label: bytes = PROOF_LABEL) -> str:
    return hmac.new(key, label + nonce, hashlib.sha256).hexdigest()


def proof_matches(key: bytes, nonce: bytes, claimed: object, label: bytes = PROOF_LABEL) -> bool:
    return isinstance(claimed, str) and hmac.compare_digest(claimed.encode(),
                                                            proof(key, nonce, label).encode())


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def hex_nonce(value: object) -> bytes | None:
    """A nonce read from the wire (hex of NONCE_BYTES bytes), None when it is not one."""
    if not isinstance(value, str) or len(value) != 2 * NONCE_BYTES:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        return None
