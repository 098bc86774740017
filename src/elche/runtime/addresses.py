"""Which address the coordinator binds and which one it tells the ranks.

On one host the coordinator binds loopback and is reached there. Across
hosts (a launcher's ranks on several machines) it binds every interface,
``tcp://0.0.0.0:0``, and advertises one address of rank 0's host that the
other hosts reach, chosen in this order:

1. ``ELCHE_ADVERTISE`` (an address or host name), when set: the user knows
   best (a NAT, a DNS name, one of several networks);
2. the address of ``GLOO_SOCKET_IFNAME``'s interface, when that names one:
   the interface the user already chose for the ranks' collectives;
3. the source address of rank 0's route to ``MASTER_ADDR``: the interface
   this host uses towards the rendezvous host, which is rank 0's own
   address when rank 0 is there and the one the others reach otherwise
   (under ``c10d`` rendezvous rank 0 may sit on any host).

A loopback address found by 2 or 3 is passed over, and when nothing else is
found a ``ConfigError`` names ``ELCHE_ADVERTISE``: the other hosts could not
reach it. ``ELCHE_ADVERTISE`` is taken as given, loopback too (several
launchers on one machine).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping

from elche.core.errors import ConfigError

__all__ = ["ADVERTISE_ENV", "BIND_ENV", "EVERY_INTERFACE", "advertised_host", "interface_address"]

ADVERTISE_ENV = "ELCHE_ADVERTISE"  # the address the coordinator tells other hosts
BIND_ENV = "ELCHE_BIND"  # the ZeroMQ endpoint the coordinator binds (default: loopback)
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"  # torch's: the interface gloo uses
EVERY_INTERFACE = "tcp://0.0.0.0:0"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface ``name`` on this host, or None (absent, or Linux only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            request = struct.pack("256s", name.encode()[:15])
            answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])


def _route_source(target: str) -> str | None:
    """The local address this host sends from towards ``target``, or None."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((target, 9))  # UDP: no packet leaves, the kernel picks the route
        return str(probe.getsockname()[0])
    return None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def advertised_host(env: Mapping[str, str]) -> str:
    """The host other hosts reach the coordinator at (see the module docstring).

    Raises:
        ConfigError: (field ``ELCHE_ADVERTISE``) nothing but loopback was found.
    """
    given = env.get(ADVERTISE_ENV, "").strip()
    if given:
        return given
    candidates: list[tuple[str, str | None]] = []
    ifname = env.get(GLOO_IFNAME_ENV, "").split(",")[0].strip()
    if ifname:
        candidates.append((f"{GLOO_IFNAME_ENV}={ifname}", interface_address(ifname)))
    master = env.get("MASTER_ADDR", "").strip()
    if master:
        candidates.append((f"the route to MASTER_ADDR={master}", _route_source(master)))
    for _, host in candidates:
        if host is not None and not _is_loopback(host):
            return host
    tried = ", ".join(f"{how} gave {host}" for how, host in candidates) or "nothing to go by"
    raise ConfigError(
        ADVERTISE_ENV,
        f"the ranks are on several hosts but no address of this host that they reach was "
        f"found ({tried}); set {ADVERTISE_ENV} to this host's address on their network",
    )
