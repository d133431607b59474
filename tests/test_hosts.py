"""The federation of hosts on one machine (simulations.hosts): each host in its own network
namespace with its own address; a partition drops packets without a reset and a healed link
carries on the same TCP connection; a tbf limit bounds the rate; nothing is left behind.

Skipped, naming the missing capability, where namespaces cannot be made (not root, no ip)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from simulations.hosts import HostFederation, available, list_namespaces, sweep

WHY = available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"no network namespaces: {WHY}")

ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7000)); s.listen(4); print("ready", flush=True)
while True:
    c, _ = s.accept()
    while data := c.recv(1 << 16):
        c.sendall(b"ok" if data.startswith(b"ping") else b"")
    c.close()
"""

SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7001)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0
while data := c.recv(1 << 16):
    n += len(data)
c.sendall(str(n).encode()); c.close()
"""

CLIENT = """
import socket, sys, time
addr, what = sys.argv[1], sys.argv[2]
if what == "connect":  # a fresh connection while cut off: a timeout, never a refusal or reset
    try:
        socket.create_connection((addr, 7000), timeout=1.5)
        print("connected")
    except TimeoutError:
        print("timeout")
    except OSError as e:
        print(type(e).__name__)
elif what == "send":  # bytes to the sink; its count back, and the seconds it took
    c = socket.create_connection((addr, 7001), timeout=30)
    t0 = time.monotonic(); c.sendall(b"x" * int(sys.argv[3])); c.shutdown(socket.SHUT_WR)
    n = c.recv(64); print(n.decode(), time.monotonic() - t0)
"""


def _start(fed: HostFederation, host: str, code: str) -> subprocess.Popen:
    argv = fed.argv(host, [sys.executable, "-c", code, fed.address(host)])
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def _run(fed: HostFederation, host: str, *args: str) -> str:
    argv = fed.argv(host, [sys.executable, "-c", CLIENT, *args])
    return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.strip()


@pytest.fixture
def fed():
    federation = HostFederation(["coordinator", "hospital0", "hospital1"]).up()
    try:
        yield federation
    finally:
        left = federation.down()
        assert left == [], f"left behind: {left}"


def test_each_host_has_its_own_namespace_and_address_and_they_reach_one_another(fed):
    names = set(list_namespaces())
    assert {h.namespace for h in fed.hosts.values()} <= names
    assert len({h.address for h in fed.hosts.values()}) == 3
    echo = _start(fed, "coordinator", ECHO)
    try:
        out = subprocess.run(
            fed.argv(
                "hospital0",
                [
                    sys.executable,
                    "-c",
                    "import socket,sys; c=socket.create_connection((sys.argv[1],7000),timeout=5);"
                    "c.sendall(b'ping'); print(c.recv(8).decode())",
                    fed.address("coordinator"),
                ],
            ),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.stdout.strip() == "ok", out.stderr[-500:]
        # the machine's own namespace has no route to them: they are apart from its network
        assert (
            fed.address("coordinator")
            not in subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        )
    finally:
        echo.kill()
        echo.wait()


def test_connects_probes_from_inside_a_host_without_moving_the_caller(fed):
    # Prepare: a listener on the coordinator's address, inside its namespace
    echo = _start(fed, "coordinator", ECHO)
    own_namespace = os.readlink("/proc/thread-self/ns/net")
    try:
        addr = fed.address("coordinator")
        # Execute / Assert: reached from a hospital and from the coordinator itself, not on a
        # port nobody listens on, and not from a partitioned hospital
        assert fed.connects("hospital0", addr, 7000)
        assert fed.connects("coordinator", addr, 7000)
        assert not fed.connects("hospital0", addr, 7009)
        fed.partition("hospital1")
        try:
            assert not fed.connects("hospital1", addr, 7000, timeout_s=0.3)
        finally:
            fed.heal("hospital1")
        # the caller's own thread never left the machine's namespace (a connect from it would
        # not tell: this machine's network may answer any 10.x address through a proxy)
        assert os.readlink("/proc/thread-self/ns/net") == own_namespace
    finally:
        echo.kill()
        echo.wait()


def test_a_partition_drops_packets_without_a_reset_and_a_healed_link_carries_on(fed):
    echo = _start(fed, "coordinator", ECHO)
    talk = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 7000), timeout=5)
c.sendall(b"ping"); print(c.recv(8).decode(), flush=True)
sys.stdin.readline()          # the link is cut now
c.settimeout(1.0); c.sendall(b"ping")
try:
    print("reply", c.recv(8).decode(), flush=True)
except TimeoutError:
    print("silence", flush=True)
except OSError as e:
    print(type(e).__name__, flush=True)
sys.stdin.readline()          # the link is back: the same connection carries on
c.settimeout(30)
print(c.recv(8).decode(), flush=True)
"""
    p = subprocess.Popen(
        fed.argv("hospital0", [sys.executable, "-c", talk, fed.address("coordinator")]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdin is not None and p.stdout is not None
    try:
        assert p.stdout.readline().strip() == "ok"
        fed.partition("hospital0")
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "silence"  # no reset, no refusal: nothing
        assert _run(fed, "hospital0", fed.address("coordinator"), "connect") == "timeout"
        assert _run(fed, "hospital1", fed.address("coordinator"), "connect") == "connected"
        fed.heal("hospital0")
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "ok"  # the ping sent while cut off, answered
        assert p.wait(timeout=30) == 0
    finally:
        p.kill()
        echo.kill()
        echo.wait()


def test_a_rate_limit_bounds_the_hosts_throughput_and_is_removed(fed):
    size = 2_000_000  # bytes: 1.6 s at 10 Mbit/s
    sink = _start(fed, "coordinator", SINK)
    fed.limit("hospital0", 10)
    try:
        n, seconds = _run(fed, "hospital0", fed.address("coordinator"), "send", str(size)).split()
    finally:
        sink.kill()
        sink.wait()
    assert int(n) == size
    # a lower bound on the time: a slow machine only takes longer; 10 Mbit/s allows no faster
    assert float(seconds) >= 0.8 * size * 8 / 10e6
    fed.unlimit("hospital0")
    out = subprocess.run(
        ["tc", "qdisc", "show", "dev", fed.hosts["hospital0"].port],
        capture_output=True,
        text=True,
    )
    assert "tbf" not in out.stdout


def test_down_removes_the_namespaces_links_and_processes_and_sweep_the_orphans():
    fed = HostFederation(["a", "b"]).up()
    p = subprocess.Popen(fed.argv("a", ["sleep", "60"]))
    time.sleep(0.2)
    assert fed.down() == []
    assert p.wait(timeout=10) != 0  # killed with its namespace
    assert not fed.leftovers()
    orphan = HostFederation(["x"]).up()  # its owner "dies": only sweep finds it
    gone = sweep(orphan.tag)
    assert any(orphan.tag in g for g in gone) and orphan.leftovers() == []
