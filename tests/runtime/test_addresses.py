"""Which address the coordinator advertises across hosts, and its address line."""

from __future__ import annotations

import pytest

from elche.core.errors import ConfigError
from elche.runtime.addresses import ADVERTISE_ENV, advertised_host, interface_address
from elche.runtime.groups import parse_address_line, store_host


def test_elche_advertise_beats_the_interface_and_the_route() -> None:
    env = {ADVERTISE_ENV: "node7.lab", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    assert advertised_host(env) == "node7.lab"


def test_loopback_is_never_advertised_to_other_hosts() -> None:
    with pytest.raises(ConfigError, match=ADVERTISE_ENV) as caught:
        advertised_host({"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"})
    assert "GLOO_SOCKET_IFNAME=lo gave 127.0.0.1" in str(caught.value)
    with pytest.raises(ConfigError, match="nothing to go by"):
        advertised_host({})


def test_an_interface_that_is_absent_has_no_address() -> None:
    assert interface_address("lo") == "127.0.0.1"
    assert interface_address("no-such-if0") is None


def test_the_address_line_carries_the_group_store_port_when_there_is_one() -> None:
    assert parse_address_line(["tcp://10.0.0.1:5555", "groups=41234"]) == (
        "tcp://10.0.0.1:5555",
        41234,
    )
    assert parse_address_line(["tcp://127.0.0.1:5555"]) == ("tcp://127.0.0.1:5555", None)
    assert store_host("tcp://[::1]:5555") == "::1"
