"""Every error ofl raises derives from OflError, so callers can fail closed on one type."""


class OflError(Exception):
    """Base class of all transport errors."""


class ConfigurationError(OflError, ValueError):
    """An ofl variable holds a value ofl cannot use; the message names the variable (and
    never a secret's value)."""


class BackendUnavailable(OflError):
    """The requested backend cannot run here (e.g. verbs without an RDMA device)."""


class ProtocolError(OflError):
    """A peer sent bytes that do not form a valid frame or message."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version; the connection is refused."""


class RemoteError(OflError):
    """The peer answered a request with an error reply (it keeps serving)."""


class OutOfRange(OflError):
    """A read names bytes outside a registered region; refused before touching memory."""


class DeadlineExceeded(OflError, TimeoutError):
    """No complete reply before the call's deadline."""


class ConnectionLost(OflError, ConnectionError):
    """The link broke (peer died, closed, or a deadline forced it shut)."""


class PeerRejected(OflError):
    """The caller's verify_peer hook refused the server's handshake metadata."""


class AuthenticationFailed(OflError):
    """The server admits only peers that prove its shared key (OFL_AUTH_KEY), and this
    client's proof was missing or wrong."""
