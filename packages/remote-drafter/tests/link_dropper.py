"""A fault drill between an engine and a worker: a TCP relay that closes a link (both sides)
once it has carried `every` chunks from the engine, triggered by the traffic itself, never by
a clock. The engine then sees its link to the worker dropped every few rounds."""

import socket
import threading


class LinkDropper:
    def __init__(self, upstream: str, every: int):
        host, _, port = upstream.rpartition(":")
        self.upstream, self.every, self.drops = (host, int(port)), every, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                engine, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                worker = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                engine.close()  # the worker is gone: so is the link
                continue
            worker.settimeout(None)
            threading.Thread(target=self._pump, args=(engine, worker, self.every), daemon=True).start()
            threading.Thread(target=self._pump, args=(worker, engine, None), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, every: int | None) -> None:
        chunks = 0
        try:
            while data := source.recv(1 << 20):
                sink.sendall(data)
                chunks += 1
                if every and chunks >= every:
                    with self._lock:
                        self.drops += 1
                    break
        except OSError:
            pass
        for s in (source, sink):  # one side ended: the link ends on both
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()
