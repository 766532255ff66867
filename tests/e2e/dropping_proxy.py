"""A TCP proxy between the master and an agent that loses answers on purpose.

It forwards TLS records whole in both directions and reads only their five-byte
headers (the bytes inside stay encrypted, end to end). An *answer* begins with the
first application-data record the agent sends after the master sent some: the agent
issues no session tickets (docs/decisions.md D57), so after the handshake nothing
else comes from it unasked. Armed, the proxy lets a number of answers through and
then cuts both connections as the next one begins: the agent has done the work, the
master never hears of it.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

APPLICATION_DATA = 23


@dataclass
class _Link:
    asked: bool = False  # the master sent application data since the last answer began


class DroppingProxy:
    """Listens on 127.0.0.1 (``port``) and forwards to ``upstream_port``."""

    def __init__(self, *, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.dropped = 0
        self.answers = 0
        self._pass: int | None = None  # None: not armed
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dropping-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> DroppingProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the proxy did not start")
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def lose_answer(self, *, after: int = 0) -> None:
        """Let ``after`` answers through, then lose the next one (once)."""
        with self._lock:
            self._pass = after

    @property
    def armed(self) -> bool:
        with self._lock:
            return self._pass is not None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def listen() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            self._ready.set()

        self._loop.run_until_complete(listen())
        self._loop.run_forever()

    def _drop_now(self) -> bool:
        """Called as an answer begins: True when this one is to be lost."""
        with self._lock:
            self.answers += 1
            if self._pass is None:
                return False
            if self._pass > 0:
                self._pass -= 1
                return False
            self._pass = None
            self.dropped += 1
            return True

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        link = _Link()
        cut = asyncio.Event()

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, up: bool) -> None:
            try:
                while not cut.is_set():
                    header = await src.readexactly(5)
                    body = await src.readexactly(int.from_bytes(header[3:5], "big"))
                    if header[0] == APPLICATION_DATA:
                        if up:
                            link.asked = True
                        elif link.asked:
                            link.asked = False
                            if self._drop_now():
                                cut.set()
                                return
                    dst.write(header + body)
                    await dst.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                cut.set()  # and the other direction ends with its socket
                writer.close()
                up_writer.close()

        await asyncio.gather(pump(reader, up_writer, up=True), pump(up_reader, writer, up=False))
