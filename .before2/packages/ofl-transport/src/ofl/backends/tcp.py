"""tcp backend: reads are READ frames answered from the server's region (see Server)."""

from __future__ import annotations

from ..region import Region


class ServerBackend:
    reads_over_channel = True

    def publish(self, region: Region) -> dict:
        return {}

    def accept(self, hello: dict, server) -> tuple[None, dict]:
        return None, {}

    def close(self) -> None:
        pass


class ClientBackend:
    def hello_extras(self) -> dict:
        return {}

    def setup(self, conn, reply: dict) -> None:
        pass

    def register_local(self, region: Region) -> None:
        """Only verbs needs destinations registered with the device."""

    def read(self, conn, desc, offsets, lengths, dest, deadline) -> None:
        conn.channel_read(desc, offsets, lengths, dest, deadline)

    def request(self, conn, parts, deadline) -> bytes:
        return conn.channel_request(parts, deadline)

    def close(self) -> None:
        pass
