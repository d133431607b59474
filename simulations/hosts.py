"""A federation of hosts on one machine: each host (the coordinator, each hospital) in its own
Linux network namespace with its own address, joined through a bridge, as separate machines
are through a switch.

How it is built (iproute2, as root): a bridge ``fab<tag>`` in the root namespace; per host a
namespace ``fa-<tag>-<host>`` and a veth pair, one end (``eth0``) moved into the namespace
with the host's address (``10.<net>.0.<n>/24``) and its loopback up, the other end
(``fav<tag><n>``) a port of the bridge. Nothing routes between the bridge and the machine's own
network: the hosts reach one another and nothing else.

Faults, each as a real network shows it:
- `partition`: the host's bridge port goes down, so every packet to or from the host vanishes
  (no RST, no ICMP: a dropped VPN); `heal` brings it back, and open TCP connections carry on
  once their retransmissions get through.
- `limit`: a token-bucket filter (``tc tbf``) on both directions of the host's link, e.g. a
  site behind 10 Mbit/s. (Delay and loss would take ``netem``, which this kernel lacks.)

Processes run inside a host with `argv` (``ip netns exec``) and are started and stopped by the
caller's `fedasync.processes.Processes`, by pid; `down` also kills whatever is left in the
namespaces (``ip netns pids``) before it deletes them, the bridge and the veths, so a
federation leaves nothing behind, and `sweep` removes those of a federation whose owner died.
`available` says, in one line, why namespaces cannot be made here (not root, no ``ip``).
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("fedasync.hosts")

PREFIX = "fa-"
"""Every namespace a federation makes is named ``fa-<tag>-<host>``."""
NET_BASE = 77
"""Federations' addresses are 10.<NET_BASE + k>.0.0/24 (k from the tag)."""


class HostsError(RuntimeError):
    """A namespace, link or filter could not be made, changed or removed (the command's
    words)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise HostsError(f"ip {' '.join(args)}: {out.stderr.strip()[:300]}")
    return out


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise HostsError(f"tc {' '.join(args)}: {out.stderr.strip()[:300]}")
    return out


def available() -> str | None:
    """None when this machine can make namespaces, veths and a bridge; else the missing
    capability in one line (a test skips with it)."""
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    if shutil.which("tc") is None:
        return "the 'tc' command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); this process is not root"
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' fails here: {made.stderr.strip()[:200]}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass(frozen=True)
class Host:
    """One host of the federation: its name, namespace, address and links."""

    name: str
    namespace: str
    address: str
    port: str
    """The veth end on the bridge (in the root namespace)."""
    inside: str = "eth0"
    """The veth end in the host's namespace, carrying its address."""


class HostFederation:
    """Hosts named ``names`` (e.g. ``coordinator``, ``hospital0``) on one bridge; `up` makes
    them, `down` removes them (and a ``with`` block does both). ``tag``: a few letters that
    name this federation's namespaces and links (default: random)."""

    def __init__(self, names: list[str], tag: str | None = None) -> None:
        if not names or len(set(names)) != len(names):
            raise ValueError(f"hosts need distinct names, got {names}")
        if len(names) > 250:
            raise ValueError("at most 250 hosts on one bridge")
        self.tag = tag or uuid.uuid4().hex[:6]
        if not (self.tag.isalnum() and len(self.tag) <= 6):
            raise ValueError(f"tag {self.tag[:20]!r}: at most 6 letters or digits")
        net = NET_BASE + zlib.crc32(self.tag.encode()) % 100
        self.subnet = ipaddress.ip_network(f"10.{net}.0.0/24")
        self.bridge = f"fab{self.tag}"
        self.hosts = {
            name: Host(
                name=name,
                namespace=f"{PREFIX}{self.tag}-{name}",
                address=str(self.subnet.network_address + i + 1),
                port=f"fav{self.tag}{i}",
            )
            for i, name in enumerate(names)
        }
        self.limits: dict[str, float] = {}
        self.partitioned: set[str] = set()

    # ---------------------------------------------------------------- life cycle
    def up(self) -> HostFederation:
        """Make the bridge, each host's namespace, its veth pair and address. On any failure
        what was made is removed and HostsError raised."""
        try:
            _ip("link", "add", "name", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for h in self.hosts.values():
                _ip("netns", "add", h.namespace)
                _ip("link", "add", h.port, "type", "veth", "peer", "name", f"{h.port}p")
                _ip("link", "set", f"{h.port}p", "netns", h.namespace)
                _ip("-n", h.namespace, "link", "set", f"{h.port}p", "name", h.inside)
                _ip("-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", h.inside)
                _ip("-n", h.namespace, "link", "set", h.inside, "up")
                _ip("-n", h.namespace, "link", "set", "lo", "up")
                _ip("link", "set", h.port, "master", self.bridge)
                _ip("link", "set", h.port, "up")
        except BaseException:
            self.down()
            raise
        log.info(
            "hosts up on %s: %s",
            self.bridge,
            ", ".join(f"{h.name}={h.address}" for h in self.hosts.values()),
        )
        return self

    def down(self) -> list[str]:
        """Kill what runs in the namespaces, delete them, the veths and the bridge; what could
        not be removed (empty when nothing is left)."""
        for h in self.hosts.values():
            for pid in namespace_pids(h.namespace):
                _kill(pid)
        for h in self.hosts.values():
            if h.namespace in list_namespaces():
                _ip("netns", "del", h.namespace, check=False)
            _ip("link", "del", h.port, check=False)  # gone with its peer when the ns went
        _ip("link", "del", self.bridge, check=False)
        left = self.leftovers()
        if left:
            log.warning("hosts %s: could not remove %s", self.tag, left)
        return left

    def leftovers(self) -> list[str]:
        """This federation's namespaces and links that still exist."""
        mine = f"{PREFIX}{self.tag}-"
        names = [n for n in list_namespaces() if n.startswith(mine)]
        links = _ip("-o", "link", "show", check=False).stdout
        names += [
            name
            for name in (self.bridge, *(h.port for h in self.hosts.values()))
            if f": {name}:" in links or f": {name}@" in links
        ]
        return names

    def __enter__(self) -> HostFederation:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ---------------------------------------------------------------- running and faults
    def argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.hosts[host].namespace, *argv]

    def address(self, host: str) -> str:
        """``host``'s address."""
        return self.hosts[host].address

    def connects(self, host: str, address: str, port: int, timeout_s: float = 0.5) -> bool:
        """Whether a TCP connect from inside ``host`` to ``address:port`` succeeds, within
        ``timeout_s``. The socket is made in ``host``'s namespace by a thread of its own that
        enters it (setns) and ends with the probe: no process per probe, and the caller's
        threads stay in the machine's namespace."""
        answer: list[bool | BaseException] = []

        def probe() -> None:
            try:
                with open(f"/run/netns/{self.hosts[host].namespace}", "rb") as ns:
                    _setns_net(ns.fileno())
                with socket.socket() as s:
                    s.settimeout(timeout_s)
                    answer.append(s.connect_ex((address, port)) == 0)
            except BaseException as e:  # handed to the caller's thread
                answer.append(e)

        t = threading.Thread(target=probe, name=f"connects-{host}", daemon=True)
        t.start()
        t.join()
        if isinstance(answer[0], BaseException):
            raise answer[0]
        return answer[0]

    def partition(self, host: str) -> None:
        """Cut ``host`` off: its bridge port down, every packet to or from it dropped."""
        _ip("link", "set", self.hosts[host].port, "down")
        self.partitioned.add(host)
        log.info("host %s partitioned (%s down)", host, self.hosts[host].port)

    def heal(self, host: str) -> None:
        """Bring ``host``'s link back."""
        _ip("link", "set", self.hosts[host].port, "up")
        self.partitioned.discard(host)
        log.info("host %s healed", host)

    def crash(self, host: str) -> list[int]:
        """``host`` goes down at once, as a machine that loses power: SIGKILL to every process
        in its namespace (nothing ends cleanly, nothing is flushed); the pids killed. Its
        network stays: a restarted process listens at the same address."""
        pids = namespace_pids(self.hosts[host].namespace)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.05)  # (a zombie keeps its /proc entry until its parent reaps it)
            if all(_zombie(p) for p in pids if Path(f"/proc/{p}").exists()):
                break
        log.info("host %s crashed: %d processes killed", host, len(pids))
        return pids

    def limit(self, host: str, mbit: float, burst_kb: int = 64) -> None:
        """``host``'s link limited to ``mbit`` Mbit/s in both directions (``tc tbf``)."""
        h = self.hosts[host]
        rate = f"{mbit}mbit"
        for where in (["dev", h.port], ["-n", h.namespace, "dev", h.inside]):
            ns = where[:2] if where[0] == "-n" else []
            dev = where[len(ns) :]
            _tc(*ns, "qdisc", "replace", *dev, "root", "tbf", "rate", rate,
                "burst", f"{burst_kb}kb", "latency", "400ms")  # fmt: skip
        self.limits[host] = mbit
        log.info("host %s limited to %s Mbit/s", host, mbit)

    def unlimit(self, host: str) -> None:
        """Remove ``host``'s rate limit."""
        h = self.hosts[host]
        _tc("qdisc", "del", "dev", h.port, "root", check=False)
        _tc("-n", h.namespace, "qdisc", "del", "dev", h.inside, "root", check=False)
        self.limits.pop(host, None)


CLONE_NEWNET = 0x40000000
"""setns(2)'s network-namespace type (``os.setns`` and ``os.CLONE_NEWNET`` are Python 3.12+)."""


def _setns_net(fd: int) -> None:
    """Move the calling thread into the network namespace open at ``fd``."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def list_namespaces() -> list[str]:
    """The names of the machine's network namespaces."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(namespace: str) -> list[int]:
    """The processes running in ``namespace``."""
    out = _ip("netns", "pids", namespace, check=False).stdout
    return [int(x) for x in out.split() if x.isdigit()]


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] == "Z"
    except (OSError, IndexError):
        return True


def _kill(pid: int, grace_s: float = 3.0) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def sweep(tag: str | None = None) -> list[str]:
    """Remove every federation's namespaces (``fa-*``; only ``tag``'s when given), the
    processes in them, and their bridges and veths: what a federation whose owner died left.
    The names removed."""
    prefix = f"{PREFIX}{tag}-" if tag else PREFIX
    gone = []
    for ns in list_namespaces():
        if ns.startswith(prefix) and not ns.startswith(f"{PREFIX}probe-"):
            for pid in namespace_pids(ns):
                _kill(pid)
            _ip("netns", "del", ns, check=False)
            gone.append(ns)
    links = _ip("-o", "link", "show", check=False).stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
        if name.startswith((f"fab{tag or ''}", f"fav{tag or ''}")):
            _ip("link", "del", name, check=False)
            gone.append(name)
    return gone


def main(argv: list[str] | None = None) -> int:
    """``python -m simulations.hosts up NAME... [--tag T] | down --tag T | sweep``: make a
    federation of hosts (printing each host's namespace and address), remove one, or remove
    every federation's leftovers."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m simulations.hosts", description=main.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="make hosts (e.g. coordinator hospital0 hospital1)")
    up.add_argument("names", nargs="+")
    up.add_argument("--tag", default=None)
    down = sub.add_parser("down", help="remove a federation and what runs in it")
    down.add_argument("--tag", required=True)
    sub.add_parser("sweep", help="remove every federation's namespaces and links")
    args = ap.parse_args(argv)
    why = available()
    if why is not None:
        print(f"hosts: {why}")
        return 2
    if args.cmd == "up":
        fed = HostFederation(args.names, args.tag).up()
        for h in fed.hosts.values():
            print(f"{h.name}\t{h.namespace}\t{h.address}")
        print(f"tag {fed.tag}: run a command on a host with 'ip netns exec <namespace> ...'")
    else:
        gone = sweep(args.tag if args.cmd == "down" else None)
        print("removed: " + (", ".join(gone) or "nothing"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
