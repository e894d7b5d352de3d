"""Ports handed to processes started here (a rehearsal's pods, the tests' servers) stay theirs.

A port found by binding port 0 comes from the ephemeral range, which the kernel hands to every
other port-0 bind and outgoing connection until its owner binds it: a rehearsal's pod 2 once
exited with ``--prometheus_port: ... Address already in use`` because another pod's gloo took
its number. Ports below that range are never taken that way.
"""

from __future__ import annotations

import socket

from torchrec_cloud.ports import free_port


def _ephemeral() -> range:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = map(int, f.read().split())
    return range(low, high + 1)


def test_ports_are_outside_the_kernels_choice_free_and_never_given_twice() -> None:
    ports = [free_port(count=2) for _ in range(50)]
    given = [p + r for p in ports for r in range(2)]
    assert len(set(given)) == len(given)
    assert not set(given) & set(_ephemeral())
    for port in ports[:5]:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", port))
            b.bind(("127.0.0.1", port + 1))
    # What the kernel chooses is in the ephemeral range, so it can never be one of them.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] in _ephemeral()
