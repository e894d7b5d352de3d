"""Free TCP ports on 127.0.0.1 for processes started from here: a rehearsal's pods (their
rendezvous and metrics endpoints), and the tests' and benchmarks' servers.

Why not bind port 0 and hand its number on: the kernel takes port-0 binds and the local
port of every outgoing connection from the same ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), so between the check and the moment the
process it was meant for binds it, any connection may take that number. A rehearsal's other
pods open dozens of them at that moment (gloo's pairs, the store's clients): seen as a pod
that exits with ``--prometheus_port: ... (Address already in use)`` and a failed job. A
port below that range is only ever taken by a bind that names it, so one found free there
stays free; each is handed out once per process, as the pods it goes to may not have bound
it yet.
"""

from __future__ import annotations

import random
import socket
import threading

_given: set[int] = set()
_lock = threading.Lock()
_LOWEST = 10000  # above the well-known and most registered services' ports


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS's range starts at 49152


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(count: int = 1) -> int:
    """A port P of 127.0.0.1 below the ephemeral range with P .. P + count - 1 all free now
    and never given out before by this process (``count``: a run's local ranks serve
    metrics on consecutive ports)."""
    high = _ephemeral_low() - count
    if high <= _LOWEST:
        raise OSError(f"no ports below the ephemeral range ({_ephemeral_low()}) to give out")
    with _lock:
        start = random.randrange(_LOWEST, high)
        for offset in range(high - _LOWEST):
            port = _LOWEST + (start - _LOWEST + offset) % (high - _LOWEST)
            block = range(port, port + count)
            if any(p in _given for p in block) or not all(_bindable(p) for p in block):
                continue
            _given.update(block)
            return port
    raise OSError(f"no {count} free consecutive ports on 127.0.0.1 below {_ephemeral_low()}")
