"""free_port picks outside the kernel's ephemeral range and Ray's worker ports, and never a port someone holds."""
from __future__ import annotations

import socket

from cpuserve.serving import ports


def test_picks_between_rays_worker_ports_and_the_ephemeral_range():
    start = ports._ephemeral_start()
    picked = {ports.free_port() for _ in range(50)}
    if start - ports.RAY_WORKER_PORTS_END >= 1000:
        assert all(ports.RAY_WORKER_PORTS_END <= p < start for p in picked), picked
    assert len(picked) > 1  # random, not one port for every caller


def test_never_a_port_another_socket_listens_on(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        choices = iter([taken, taken, taken + 1 if taken + 1 < 65536 else taken - 1])
        monkeypatch.setattr(ports.random, "randrange", lambda a, b: next(choices))
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: 65536)
        assert ports.free_port() != taken


def test_never_a_port_it_handed_out_before_even_while_nothing_binds_it(monkeypatch):
    # a config's gRPC, HTTP and metrics ports are picked in a row and bound later: the random draw repeating a port
    # made two of them equal in a CI run (ServeConfig: "ports must differ")
    # two free ports below the kernel's ephemeral range, where no other process is handed one meanwhile
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: 32768)
    monkeypatch.setattr(ports, "_handed_out", set())
    first, other = ports.free_port(), ports.free_port()
    draws = iter([first, first, first])
    monkeypatch.setattr(ports.random, "randrange", lambda a, b: next(draws, other))
    monkeypatch.setattr(ports, "_handed_out", set())
    assert [ports.free_port(), ports.free_port()] == [first, other]


def test_reads_the_kernels_range_and_falls_back_to_linuxs_default(tmp_path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t60999\n")
    assert ports._ephemeral_start(path) == 40000
    assert ports._ephemeral_start(tmp_path / "missing") == 32768


def test_says_which_range_it_searched_when_every_try_fails(monkeypatch):
    def refuse(host, port):
        raise OSError(98, "Address already in use")

    monkeypatch.setattr(ports, "_bound_port", refuse)
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: 32768)
    try:
        ports.free_port(tries=3)
    except RuntimeError as e:
        assert "20000-32767" in str(e) and "3 tries" in str(e)
    else:
        raise AssertionError("free_port returned a port although every bind failed")
