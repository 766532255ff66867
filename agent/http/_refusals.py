"""Refused connections, logged so that a noisy peer cannot flood the log.

Every refusal of the listener (a TLS handshake that failed, a client certificate
that is not the master's) is worth a WARNING with the peer's address: it is either a
misconfigured master or someone probing the node. A peer retrying in a tight loop
must not turn that into thousands of lines a second, so each address gets at most one
line per interval, and the next line it gets says how many were left out.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RefusalLog", "peer_address"]


@dataclass
class _Peer:
    logged_at: float
    left_out: int = 0


def peer_address(peername: object) -> tuple[str, str]:
    """(the key a peer is limited by: its host without the port, how it is shown)."""
    if isinstance(peername, tuple) and len(peername) >= 2:
        host, port = str(peername[0]), peername[1]
        # Each connection has its own source port; the limit is per machine.
        return host, (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    if peername:
        return str(peername), str(peername)
    return "", "an unknown address"


class RefusalLog:
    """Logs each refusal at WARNING, at most once per ``interval`` seconds per peer.

    Peers are remembered only while that matters: an entry whose interval has passed
    with nothing left out is dropped, and at most ``max_peers`` are kept (the oldest
    go first), so a flood from many addresses costs bounded memory.
    """

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        max_peers: int = 4096,
    ) -> None:
        self._log = logger
        self.interval = interval
        self.clock = clock
        self._max_peers = max_peers
        self._peers: OrderedDict[str, _Peer] = OrderedDict()  # oldest line first

    def refused(self, peername: object, what: str, reason: str) -> bool:
        """Log (or count) one refusal of ``peername``; returns whether a line was written.

        The line reads ``<what> from <address>: <reason>``.
        """
        key, shown = peer_address(peername)
        now = self.clock()
        entry = self._peers.get(key)
        if entry is not None and now - entry.logged_at < self.interval:
            entry.left_out += 1
            return False
        left_out = entry.left_out if entry is not None else 0
        self._peers[key] = _Peer(logged_at=now)
        self._peers.move_to_end(key)
        self._forget(now)
        more = f" ({left_out} more from this address since its last line)" if left_out else ""
        self._log.warning("%s from %s: %s%s", what, shown, reason, more)
        return True

    def _forget(self, now: float) -> None:
        while self._peers:
            _key, oldest = next(iter(self._peers.items()))
            quiet = now - oldest.logged_at >= self.interval and not oldest.left_out
            if len(self._peers) <= self._max_peers and not quiet:
                return
            self._peers.popitem(last=False)

    def __len__(self) -> int:
        return len(self._peers)
