"""The Engram server: shards loaded into RAM, published over ofl, one listener per link.

On verbs a client reads rows with one-sided RDMA READ: this process's CPU is not in the
data path. On tcp/shm ofl answers the gathers. The manifest (layers, row ranges, a digest
per shard) travels in every handshake, so a client refuses a server holding other tables.
It binds only to the addresses it is given; ofl's admission and limits (OFL_ALLOW, the
shared key, connection, idle and frame bounds) apply to every listener, so a listener other
hosts can reach is refused without an allow-list or a key unless `insecure`; health() says
how each link admits. The optional HTTP endpoint is ofl.http's bounded MetricsServer.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import time
from collections.abc import Callable

from ofl import ProtocolError, Region, Server
from ofl.http import MetricsServer
from ofl.server import parse_address
from ofl.stats import Stats
from ofl.wire import decode_json

from . import __version__
from .geometry import ROW_BYTES
from .shard import ShardReader

log = logging.getLogger("remote_engram.server")
COPY_ROWS = 1 << 18

Progress = Callable[[str, int, int], None]


class LoadedShard:
    def __init__(self, path: str, backend: str, in_ram: bool, mlock: bool, hugepages: bool,
                 progress: Progress | None):
        reader = ShardReader(path)
        self.path = path
        self.header = reader.header
        self.name = os.path.basename(path).removesuffix(".bin")
        self.digest = reader.digest()
        nbytes = self.header.rows * ROW_BYTES
        self.hugepages = "off"
        t = time.perf_counter()
        if not in_ram:
            # Serve from the page cache through the file mapping.
            self.region = Region.from_file(self.name, path, offset=4096, length=nbytes)
            reader.close()
        else:
            # shm clients map the region by path, so it must be file-backed; other backends
            # take anonymous memory (no /dev/shm size limit).
            self.region = (Region.allocate(self.name, nbytes) if backend == "shm"
                           else Region.from_buffer(self.name, mmap.mmap(-1, max(nbytes, 1))))
            self.hugepages = self.region.advise_hugepages() if hugepages else "off"
            dest = self.region.array[:nbytes].reshape(self.header.rows, ROW_BYTES)
            for start in range(0, self.header.rows, COPY_ROWS):
                end = min(start + COPY_ROWS, self.header.rows)
                dest[start:end] = reader.table[start:end]
                if progress:
                    progress(self.name, end, self.header.rows)
            reader.close()
        self.mlock = self.region.lock() if mlock and in_ram else "off"
        self.load_seconds = time.perf_counter() - t

    def manifest_entry(self) -> dict:
        h = self.header
        return {"region": self.name, "layer": h.layer, "lo": h.lo, "hi": h.hi,
                "total_rows": h.total_rows, "row_bytes": h.row_bytes, "digest": self.digest}


class EngramServer:
    def __init__(self, shard_paths: list[str], *, backend: str, listen: list[str],
                 identity: str = "engram-server", in_ram: bool = True, mlock: bool = True,
                 hugepages: bool = False, progress: Progress | None = None,
                 read_delay_s: float = 0.0, insecure: bool | None = None):
        """`insecure`: admit any peer on a reachable address with no allow-list or key
        (None: OFL_INSECURE decides, as for any ofl.Server)."""
        if not shard_paths:
            raise ValueError("no shards given")
        self.backend = backend
        self.stats = Stats("engram_server", {"identity": identity})
        self.shards: list[LoadedShard] = []
        self.servers: list[Server] = []
        self._http: MetricsServer | None = None
        try:
            # The listeners first, so a refused one (its exposure, its backend) fails before
            # the tables load, which takes minutes at full size. Nothing is answered before
            # start(): a peer that connects meanwhile waits, then times out as if it were down.
            for address in listen:
                host, port = parse_address(address, 7480)
                self.servers.append(Server(backend, host, port, identity=identity,
                                           handler=self.handle, read_delay_s=read_delay_s,
                                           insecure=insecure))
            for path in shard_paths:
                self.shards.append(LoadedShard(path, backend, in_ram, mlock, hugepages, progress))
            names = [s.name for s in self.shards]
            if len(set(names)) != len(names):
                raise ValueError(f"duplicate shard names: {names}")
            self.manifest = {"format": "DSV41EN1", "row_bytes": ROW_BYTES, "version": __version__,
                             "shards": [s.manifest_entry() for s in self.shards]}
            for srv in self.servers:
                srv.metadata = self.manifest  # handed to every client in the handshake
                for shard in self.shards:
                    srv.register(shard.region)
        except BaseException:  # free what was opened or loaded before the failure
            self.stop()
            raise

    @property
    def resident_bytes(self) -> int:
        return sum(s.region.length for s in self.shards)

    def health(self) -> dict:
        return {"ok": True, "backend": self.backend, "shards": len(self.shards),
                "resident_bytes": self.resident_bytes,
                "mlock": {s.name: s.mlock for s in self.shards},
                "hugepages": {s.name: s.hugepages for s in self.shards},
                "load_seconds": {s.name: round(s.load_seconds, 3) for s in self.shards},
                "links": ["%s:%d" % s.address for s in self.servers],
                "admission": {"%s:%d" % s.address: s.admission_status() for s in self.servers}}

    def metrics(self) -> str:
        text = self.stats.prometheus() + "".join(s.stats.prometheus() for s in self.servers)
        locked = sum(s.region.length for s in self.shards if s.mlock == "ok")
        return (text + "# TYPE engram_server_resident_bytes gauge\n"
                f"engram_server_resident_bytes {self.resident_bytes}\n"
                "# TYPE engram_server_mlocked_bytes gauge\n"
                f"engram_server_mlocked_bytes {locked}\n")

    def handle(self, payload: bytes, peer: str) -> bytes:
        """Control messages: {"op": "manifest" | "health" | "metrics"}, from any admitted peer."""
        try:
            op = decode_json(payload, "control message").get("op")
        except ProtocolError:
            op = None
        self.stats.add("control_messages")
        if op == "manifest":
            return json.dumps(self.manifest).encode()
        if op == "health":
            return json.dumps(self.health()).encode()
        if op == "metrics":
            return self.metrics().encode()
        raise ValueError('expected a JSON object {"op": "manifest" | "health" | "metrics"}')

    def start(self, metrics_listen: str | None = None) -> EngramServer:
        for srv in self.servers:
            srv.start()
        if metrics_listen:
            self._http = MetricsServer(*parse_address(metrics_listen, 9480), self.metrics,
                                       self.health, name="engram-server")
        return self

    def stop(self) -> None:
        for srv in self.servers:
            srv.stop()
        if self._http:
            self._http.shutdown()
            self._http.server_close()
        for s in self.shards:
            s.region.close()
