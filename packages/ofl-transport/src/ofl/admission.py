"""Who a server lets in: an allow-list of peer addresses or networks (checked at accept,
before the peer takes a connection slot) and an optional shared key the handshake proves.

The key proof: a client that holds a key says so in its HELLO (`"auth": AUTH_SCHEME`); a
server with a key answers with a CHALLENGE carrying a fresh random nonce, and the client
replies with a PROOF, HMAC-SHA256(key, PROOF_LABEL + nonce). The key never crosses the wire
and a recorded proof is worthless on the next connection. A server without a key answers
HELLO_OK at once whatever the HELLO says, and a client without a key never advertises one,
so peers from before keys existed still talk to peers without a key.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

from .errors import ConfigurationError

AUTH_SCHEME = "hmac-sha256"
PROOF_LABEL = b"ofl key proof v1\0"
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


def admitted(host: str, networks: list[Network]) -> bool:
    if not networks:
        return True
    address = ipaddress.ip_address(host.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return any(address in net for net in networks)


def load_key(text: str) -> bytes | None:
    """OFL_AUTH_KEY's value as HMAC key bytes, None when empty. The error names the
    variable and the length, never the value."""
    if not text:
        return None
    if len(text) < MIN_KEY_CHARS:
        raise ConfigurationError(f"OFL_AUTH_KEY holds {len(text)} characters; use at least "
                         f"{MIN_KEY_CHARS} (generate one with: openssl rand -hex 32)")
    return text.encode()


def proof(key: bytes, nonce: bytes) -> str:
    return hmac.new(key, PROOF_LABEL + nonce, hashlib.sha256).hexdigest()


def proof_matches(key: bytes, nonce: bytes, claimed: object) -> bool:
    return isinstance(claimed, str) and hmac.compare_digest(claimed.encode(), proof(key, nonce).encode())
