"""Where a deployment's processes run: all on this host's loopback (`Local`, what ``fedasync
deploy`` does), or each role on its own host of a namespace federation (`OnHosts`: the
coordinator's SuperLink, flwr CLI and ServerApp on one host, each silo's SuperNode and worker
on its hospital's), reached at that host's address, with TLS certificates that name it.

A role is ``coordinator`` or ``silo-<s>``; the deployment asks its placement for each
process's command line (`argv`), the SuperLink's address and port, each SuperNode's local port
for its worker, whether the SuperLink listens yet (`listening`, from the coordinator's side),
and the addresses the SuperLink's certificate must name (`cert_hosts`).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Protocol

from simulations.hosts import HostFederation, namespace_pids

LINK_PORT = 9092
"""The SuperLink's port on a host of its own (a fresh network stack: always free)."""
NODE_PORT = 9094
"""Each SuperNode's ClientAppIo port on its hospital's host."""


class Placement(Protocol):
    """Where each role's processes run, and at which address the SuperLink is."""

    link_host: str
    cert_hosts: list[str]
    erasure_watches: bool
    """Whether each silo's erasure watch (``fedasync node --erasure-service``) runs in the
    deployment's own process (it reaches the service on the coordinator's loopback)."""

    def argv(self, role: str, argv: list[str]) -> list[str]:
        """``argv`` as ``role`` runs it."""

    def link_port(self) -> int:
        """The port the SuperLink listens on."""

    def node_ports(self, silos: int) -> list[int]:
        """Each SuperNode's ClientAppIo port (for its warm worker)."""

    def listening(self, port: int) -> bool:
        """Whether the SuperLink accepts connections on ``port`` (from the coordinator)."""

    def coordinator_pids(self, marked: list[int]) -> list[int]:
        """The coordinator's live processes (SuperLink, SuperExec, ServerApp, flwr CLI), of
        ``marked`` (the deployment's) where the placement cannot tell otherwise."""


class Local:
    """Every process on this host, the SuperLink on 127.0.0.1."""

    link_host = "127.0.0.1"
    cert_hosts: list[str] = []
    erasure_watches = True

    def argv(self, role: str, argv: list[str]) -> list[str]:
        """``argv`` unchanged."""
        return argv

    def link_port(self) -> int:
        """A free port on the loopback."""
        from simulations.flower_commands import free_ports

        return free_ports(1)[0]

    def node_ports(self, silos: int) -> list[int]:
        """Distinct free ports on the loopback."""
        from simulations.flower_commands import free_ports

        return free_ports(silos)

    def listening(self, port: int) -> bool:
        """A connect to 127.0.0.1:``port`` succeeds."""
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", port)) == 0

    def coordinator_pids(self, marked: list[int]) -> list[int]:
        """Those of ``marked`` running a coordinator's program (by their command line)."""
        return [pid for pid in marked if program_names(pid) & COORDINATOR_PROGRAMS]


class OnHosts:
    """The coordinator on host ``coordinator`` of ``fed``, silo s on host ``hospital<s>``."""

    erasure_watches = False
    """The erasure service listens on the coordinator's host, which this machine's own
    network does not reach: the silos' watches (which stop a training job an erasure
    interrupts) are not run; an erasure then starts when its silo's job in flight ends."""

    def __init__(self, fed: HostFederation) -> None:
        self.fed = fed
        self.link_host = fed.address("coordinator")
        self.cert_hosts = [self.link_host]

    def host_of(self, role: str) -> str:
        """The host ``role`` runs on."""
        return "coordinator" if role == "coordinator" else f"hospital{role.split('-', 1)[1]}"

    def argv(self, role: str, argv: list[str]) -> list[str]:
        """``argv`` inside the role's namespace."""
        return self.fed.argv(self.host_of(role), argv)

    def link_port(self) -> int:
        """`LINK_PORT`."""
        return LINK_PORT

    def node_ports(self, silos: int) -> list[int]:
        """`NODE_PORT` for every silo (each on its own host)."""
        return [NODE_PORT] * silos

    def listening(self, port: int) -> bool:
        """A connect from the coordinator's host to its address succeeds."""
        return self.fed.connects("coordinator", self.link_host, port)

    def coordinator_pids(self, marked: list[int]) -> list[int]:
        """Every process on the coordinator's host."""
        return namespace_pids(self.fed.hosts["coordinator"].namespace)


COORDINATOR_PROGRAMS = {"flower-superlink", "flower-superexec", "flwr-serverapp", "flwr"}
"""The programs a coordinator runs (a silo's are flower-supernode and its ClientApp workers)."""


def program_names(pid: int) -> set[str]:
    """The program names in ``pid``'s command line (empty when it is gone)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return set()
    return {Path(a.decode(errors="replace")).name for a in args[:3] if a}
