"""verbs backend: RC queue pairs over RoCE v2 (RDMA READ for reads, SEND/RECV for messages).

pyverbs finds the device and queries its port (MTU, state), limits and GIDs. The compiled
helper (ofl._verbs_cffi, from csrc/) owns every object the data path posts on - context,
protection domain, memory registrations, the queue pair and its INIT -> RTR -> RTS walk -
because pyverbs (rdma-core < 61) hands out no usable C pointers; and it runs the data path: a gather of thousands of rows is
posted as chained work requests with one signalled completion per batch, in one call.
Asking for verbs where it cannot run raises BackendUnavailable with the reason.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import threading
import time

import numpy as np

from .. import env, wire
from ..errors import (
    BackendUnavailable,
    ConnectionLost,
    DeadlineExceeded,
    OflError,
    ProtocolError,
    RemoteError,
)
from ..region import Region

SQ_DEPTH = 512        # send work requests per QP (two signalled batches of 256 reads)
SPIN_NS = 50_000      # spin this long for a receive before sleeping on the channel
IBV_ACCESS_LOCAL_WRITE = 1
IBV_ACCESS_REMOTE_READ = 4


def _helper():
    try:
        from .. import _verbs_cffi
    except ImportError as exc:
        raise BackendUnavailable(
            "the verbs helper (ofl._verbs_cffi) was not built: install libibverbs-dev and a "
            f"C compiler, then reinstall ofl-transport ({exc})") from None
    return _verbs_cffi.ffi, _verbs_cffi.lib


class Device:
    """One opened RDMA device: context, protection domain, registered memory."""

    _lock = threading.Lock()
    _open: dict[tuple[str, int], Device] = {}

    @classmethod
    def get(cls) -> Device:
        name, port = env.OFL_IB_DEVICE.get(), env.OFL_IB_PORT.get_int()
        with cls._lock:
            if (name, port) not in cls._open:
                cls._open[(name, port)] = cls(name, port)
            return cls._open[(name, port)]

    def __init__(self, name: str, port: int):
        self.ffi, self.lib = _helper()
        try:
            from pyverbs.device import Context, get_device_list
        except ImportError as exc:
            raise BackendUnavailable(
                "the verbs backend needs pyverbs (Debian: python3-pyverbs, with its package "
                f"folder on PYTHONPATH; or PyPI pyverbs): {exc}") from None
        try:
            devices = [d.name.decode() for d in get_device_list()]
        except Exception as exc:  # noqa: BLE001 - pyverbs raises its own error types
            raise BackendUnavailable(f"no RDMA device on this host: {exc}") from None
        if not devices:
            raise BackendUnavailable("no RDMA device on this host (ibv_get_device_list is empty)")
        if name and name not in devices:
            raise BackendUnavailable(f"RDMA device {name!r} not found (have: {', '.join(devices)})")
        self.name = name or devices[0]
        self.port = port
        with Context(name=self.name) as ctx:
            port_attr = ctx.query_port(port)
            if int(port_attr.state) != 4:  # IBV_PORT_ACTIVE
                raise BackendUnavailable(f"{self.name} port {port} is not active "
                                         f"(state {int(port_attr.state)})")
            self.mtu = int(port_attr.active_mtu)
            self.max_rd_atomic = max(1, min(16, int(ctx.query_device().max_qp_rd_atom)))
            index = env.OFL_GID_INDEX.get()
            self.gid_index = int(index) if index else roce_v2_gid_index(self.name, port)
            self.gid = ipaddress.IPv6Address(ctx.query_gid(port, self.gid_index).gid).packed
        self.status = self.ffi.new("struct ofl_status *")
        out = self.ffi.new("struct ofl_device **")
        if self.lib.ofl_device_open(self.name.encode(), out, self.status):
            raise BackendUnavailable(f"cannot open {self.name}: "
                                     f"{os.strerror(self.status.sys_errno)}")
        self.handle = out[0]
        self._mrs: dict[int, tuple[Region, object, int, int]] = {}
        self._mr_lock = threading.Lock()

    def register(self, region: Region, remote_read: bool) -> tuple[int, int]:
        """Register `region` once (cached; the cache keeps it alive); returns (lkey, rkey)."""
        with self._mr_lock:
            entry = self._mrs.get(id(region))
            if entry is None:
                access = (IBV_ACCESS_REMOTE_READ if remote_read else 0) | \
                         (IBV_ACCESS_LOCAL_WRITE if region.writable else 0)
                st = self.ffi.new("struct ofl_status *")
                mr = self.lib.ofl_reg_mr(self.handle, region.address, max(region.length, 1),
                                         access, st)
                if mr == self.ffi.NULL:
                    raise OflError(f"cannot register region {region.name!r} ({region.length} B) "
                                   f"with {self.name}: {os.strerror(st.sys_errno)} (is "
                                   "`ulimit -l` large enough?)")
                entry = (region, mr, self.lib.ofl_mr_lkey(mr), self.lib.ofl_mr_rkey(mr))
                self._mrs[id(region)] = entry
            return entry[2], entry[3]

    def lkey_for(self, address: int, length: int) -> int:
        with self._mr_lock:
            for region, _, lkey, _ in self._mrs.values():
                if region.address <= address and address + length <= region.address + region.length:
                    return lkey
        raise OflError("verbs reads land in registered memory: pass a Region (e.g. "
                       "Region.from_buffer(name, array)) as the destination")

    def unregister(self, region: Region) -> None:
        with self._mr_lock:
            entry = self._mrs.pop(id(region), None)
        if entry:
            self.lib.ofl_dereg_mr(entry[1])


def roce_v2_gid_index(device: str, port: int) -> int:
    """The port's first RoCE v2 GID that holds an IPv4-mapped address."""
    base = f"/sys/class/infiniband/{device}/ports/{port}"
    try:
        indices = sorted(int(i) for i in os.listdir(f"{base}/gid_attrs/types"))
    except OSError as exc:
        raise BackendUnavailable(f"cannot list GIDs of {device} port {port}: {exc}") from None
    for i in indices:
        try:
            with open(f"{base}/gid_attrs/types/{i}") as f:
                kind = f.read().strip()
            with open(f"{base}/gids/{i}") as f:
                gid = f.read().strip()
        except OSError:
            continue
        if kind == "RoCE v2" and gid.startswith("0000:0000:0000:0000:0000:ffff:"):
            return i
    raise BackendUnavailable(f"{device} port {port} has no RoCE v2 IPv4 GID "
                             "(is an IPv4 address set on its netdev?); set OFL_GID_INDEX")


class QueuePair:
    """An RC queue pair plus registered message slots (one send slot, `depth` receive slots)."""

    def __init__(self, device: Device, depth: int, max_message_bytes: int):
        self.device, self.ffi, self.lib = device, device.ffi, device.lib
        self.status = self.ffi.new("struct ofl_status *")
        out = self.ffi.new("struct ofl_qp **")
        self._check(self.lib.ofl_qp_create(device.handle, SQ_DEPTH, depth, out, self.status),
                    "create the queue pair")
        self.q = out[0]
        self.psn = secrets.randbelow(1 << 24)
        self.slot_bytes = wire.HEADER_SIZE + max_message_bytes
        self.depth = depth
        self.recv = Region.allocate("ofl-recv", self.slot_bytes * depth)
        self.send = Region.allocate("ofl-send", self.slot_bytes)
        self.recv_lkey = device.register(self.recv, remote_read=False)[0]
        self.send_lkey = device.register(self.send, remote_read=False)[0]
        self.completion = self.ffi.new("struct ofl_completion *")
        self._send_ids = 0

    def info(self) -> dict:
        return {"qpn": int(self.lib.ofl_qp_num(self.q)), "psn": self.psn,
                "gid": self.device.gid.hex(), "mtu": self.device.mtu,
                "rd_atomic": self.device.max_rd_atomic}

    def connect(self, remote: dict) -> None:
        try:
            qpn, psn, gid = int(remote["qpn"]), int(remote["psn"]), bytes.fromhex(remote["gid"])
            mtu = min(int(remote["mtu"]), self.device.mtu)
            rd_atomic = min(int(remote["rd_atomic"]), self.device.max_rd_atomic)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"bad verbs queue-pair info {remote!r}: {exc}") from None
        if len(gid) != 16 or not (0 < qpn < 1 << 24) or not (0 <= psn < 1 << 24) or mtu < 1:
            raise ProtocolError(f"bad verbs queue-pair info {remote!r}")
        gid_buf = self.ffi.new("uint8_t[16]", gid)
        self._check(self.lib.ofl_qp_connect(self.q, self.device.port, self.device.gid_index,
                                            self.psn, qpn, psn, gid_buf, mtu, rd_atomic,
                                            self.status), "connect the queue pair")
        for i in range(self.depth):
            self.post_recv(i)

    def post_recv(self, slot: int) -> None:
        addr = self.recv.address + slot * self.slot_bytes
        if self.lib.ofl_post_recv(self.q, addr, self.slot_bytes, self.recv_lkey, slot):
            raise ConnectionLost("ibv_post_recv refused a receive buffer")

    def gather(self, remote_addr: int, rkey: int, offsets: np.ndarray, lengths,
               dest: np.ndarray, deadline: float) -> None:
        fixed = isinstance(lengths, int)
        dest_addr = int(dest.ctypes.data)
        lkey = self.device.lkey_for(dest_addr, len(dest))
        offs = self.ffi.from_buffer("uint64_t[]", offsets)
        lens = self.ffi.NULL if fixed else self.ffi.from_buffer("uint32_t[]", lengths)
        rc = self.lib.ofl_read_gather(self.q, remote_addr, rkey, offs, lens,
                                      lengths if fixed else 0, len(offsets), dest_addr, lkey,
                                      _deadline_ns(deadline), self.status)
        self._check(rc, f"gather {len(offsets)} ranges")

    def send_frame(self, kind: wire.Kind, rid: int, parts: list, deadline: float) -> None:
        """`parts`: the payload's bytes-like pieces, copied one after another into the slot."""
        length = sum(len(p) for p in parts)
        n = wire.HEADER_SIZE + length
        if n > self.slot_bytes:
            raise OflError(f"message of {length} bytes exceeds the slot size")
        buf = self.send.array
        buf[:wire.HEADER_SIZE] = np.frombuffer(wire.pack_header(kind, rid, length), np.uint8)
        at = wire.HEADER_SIZE
        for part in parts:
            buf[at:at + len(part)] = np.frombuffer(part, np.uint8)
            at += len(part)
        self._send_ids += 1
        rc = self.lib.ofl_send(self.q, self.send.address, n, self.send_lkey, self._send_ids,
                               _deadline_ns(deadline), self.status)
        self._check(rc, "send a message")

    def recv_frame(self, deadline: float, max_payload: int) -> tuple[wire.Header, bytes]:
        """Wait for one message; returns its header and payload and re-posts the slot."""
        rc = self.lib.ofl_wait_recv(self.q, _deadline_ns(deadline), SPIN_NS, self.completion,
                                    self.status)
        self._check(rc, "receive a message")
        slot, n = int(self.completion.wr_id), int(self.completion.byte_len)
        base = slot * self.slot_bytes
        raw = bytes(self.recv.view[base:base + n])
        self.post_recv(slot)
        header = wire.unpack_header(raw[:wire.HEADER_SIZE], max_payload)
        if header.length != n - wire.HEADER_SIZE:
            raise ProtocolError(f"message says {header.length} bytes, {n - wire.HEADER_SIZE} came")
        return header, raw[wire.HEADER_SIZE:]

    def _check(self, rc: int, what: str) -> None:
        if rc == self.lib.OFL_OK:
            return
        st = self.status
        if rc == self.lib.OFL_ETIMEDOUT:
            raise DeadlineExceeded(f"verbs: deadline passed while waiting to {what}")
        if rc == self.lib.OFL_EWC:
            reason = self.ffi.string(self.lib.ibv_wc_status_str(st.wc_status)).decode()
            raise ConnectionLost(f"verbs: cannot {what}: completion error '{reason}' "
                                 f"(wr_id {st.wr_id})")
        if rc == self.lib.OFL_ESYS:
            raise ConnectionLost(f"verbs: cannot {what}: {os.strerror(st.sys_errno)}")
        raise ConnectionLost(f"verbs: cannot {what} (helper error {rc}, errno {st.sys_errno})")

    def close(self) -> None:
        if self.q is not None:
            self.lib.ofl_qp_destroy(self.q)  # flushes: no DMA lands after this returns
            self.q = None
        for region in (self.recv, self.send):
            self.device.unregister(region)
            region.close()


def _deadline_ns(deadline: float) -> int:
    return int(deadline * 1e9)  # time.monotonic() and CLOCK_MONOTONIC share a clock


class ServerBackend:
    reads_over_channel = False

    def __init__(self):
        self.device = Device.get()
        self.regions: list[Region] = []

    def publish(self, region: Region) -> dict:
        _, rkey = self.device.register(region, remote_read=True)
        self.regions.append(region)
        return {"addr": region.address, "rkey": rkey}

    def accept(self, hello: dict, server) -> tuple[ServerSession, dict]:
        remote = hello.get("verbs")
        if not isinstance(remote, dict):
            raise ProtocolError("HELLO for the verbs backend carries no queue-pair info")
        qp = QueuePair(self.device, server_depth(), server.max_message_bytes)
        try:
            qp.connect(remote)
        except BaseException:
            qp.close()
            raise
        return ServerSession(qp), {"verbs": qp.info()}

    def close(self) -> None:
        for region in self.regions:
            self.device.unregister(region)
        self.regions.clear()


def server_depth() -> int:
    return env.OFL_MAX_INFLIGHT.get_int()


class ServerSession:
    """Answers the messages of one verbs connection on its own thread."""

    def __init__(self, qp: QueuePair):
        self.qp = qp
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, server, peer: str) -> None:
        self._thread = threading.Thread(target=self._loop, args=(server, peer), daemon=True,
                                        name="ofl-verbs-session")
        self._thread.start()

    def _loop(self, server, peer: str) -> None:
        limit = server.max_message_bytes
        while not self._stop.is_set():
            try:
                header, payload = self.qp.recv_frame(time.monotonic() + 0.2, limit)
            except DeadlineExceeded:
                continue
            except ProtocolError as exc:
                server.stats.add("protocol_errors")
                self._reply(wire.Kind.ERROR, 0, wire.encode_json({"error": str(exc)}))
                continue
            except OflError:
                return  # QP in error: the peer is gone
            if header.kind != wire.Kind.MESSAGE:
                server.stats.add("bad_requests")
                self._reply(wire.Kind.ERROR, header.request_id, wire.encode_json(
                    {"error": f"{header.kind.name} is not a request this server takes"}))
                continue
            reply = server.answer(payload, peer)
            if isinstance(reply, str):
                self._reply(wire.Kind.ERROR, header.request_id, wire.encode_json({"error": reply}))
            else:
                self._reply(wire.Kind.MESSAGE_REPLY, header.request_id, reply)

    def _reply(self, kind: wire.Kind, rid: int, payload: bytes) -> None:
        try:
            self.qp.send_frame(kind, rid, [payload], time.monotonic() + 5)
        except OflError:
            self._stop.set()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.qp.close()


class ClientBackend:
    def __init__(self):
        self.device = Device.get()
        self.qp: QueuePair | None = None
        self._ids = 0
        self._locals: list[Region] = []

    def hello_extras(self) -> dict:
        self.qp = QueuePair(self.device, 2, env.OFL_MAX_MESSAGE_BYTES.get_int())
        return {"verbs": self.qp.info()}

    def setup(self, conn, reply: dict) -> None:
        remote = reply.get("verbs")
        if not isinstance(remote, dict):
            raise ProtocolError("HELLO_OK for the verbs backend carries no queue-pair info")
        self.qp.connect(remote)
        for desc in conn.regions.values():
            if not isinstance(desc.extras.get("addr"), int) or not isinstance(
                    desc.extras.get("rkey"), int):
                raise ProtocolError(f"region {desc.name!r}: bad verbs descriptor {desc.extras!r}")

    def register_local(self, region: Region) -> None:
        if region not in self._locals:
            self.device.register(region, remote_read=False)
            self._locals.append(region)

    def read(self, conn, desc, offsets, lengths, dest, deadline) -> None:
        self.qp.gather(desc.extras["addr"], desc.extras["rkey"], offsets, lengths, dest, deadline)

    def request(self, conn, parts: list, deadline: float) -> bytes:
        self._ids += 1
        self.qp.send_frame(wire.Kind.MESSAGE, self._ids, parts, deadline)
        header, body = self.qp.recv_frame(deadline, conn.max_message_bytes + wire.MAX_CONTROL_BYTES)
        if header.kind == wire.Kind.ERROR:
            raise RemoteError(f"{conn.where()}: {wire.error_text(body)}")
        if header.kind != wire.Kind.MESSAGE_REPLY or header.request_id != self._ids:
            raise ProtocolError(f"expected MESSAGE_REPLY #{self._ids}, got {header.kind.name} "
                                f"#{header.request_id}")
        return body

    def close(self) -> None:
        if self.qp is not None:
            self.qp.close()
            self.qp = None
        # Local registrations stay with the device: the caller owns those regions.
