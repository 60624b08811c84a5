"""Suite-wide guards: nothing may reach the network at run time (datasets and weights are local), and
nothing depends on or writes into the user's working folder (a recipe's default run folder
``runs/<recipe>-<dataset>/`` would otherwise meet the folder of the user's own main-job run).

Every test runs with outbound connections refused: a connect to anything but the loopback interface
(the distributed tests' gloo rendezvous) raises at once, and the attempt is recorded so that a test
that swallowed the error still fails.
"""
import ipaddress
import socket

import pytest

_attempts = []


def _is_loopback(address) -> bool:
    if isinstance(address, (str, bytes)):  # AF_UNIX paths
        return True
    host = address[0]
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name that would need a DNS lookup


@pytest.fixture(autouse=True)
def no_outbound_network(monkeypatch, request):
    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def guarded(real):
        def connect(self, address):
            if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address):
                _attempts.append(address)
                raise OSError(f"test suite: outbound connection to {address!r} refused (nothing may download)")
            return real(self, address)
        return connect

    def getaddrinfo(host, *args, **kwargs):
        if host is not None and not _is_loopback((host,)):
            _attempts.append(host)
            raise socket.gaierror(f"test suite: name lookup of {host!r} refused (nothing may download)")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", guarded(real_connect))
    monkeypatch.setattr(socket.socket, "connect_ex", guarded(real_connect_ex))
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    before = len(_attempts)
    yield
    tried = _attempts[before:]
    if tried and request.node.get_closest_marker("network_attempt_expected") is None:
        pytest.fail(f"the test tried to reach the network: {tried[:3]}")


@pytest.fixture(autouse=True)
def run_in_a_fresh_folder(tmp_path, monkeypatch):
    """Every test (and the recipe processes it starts) runs in its own empty working folder."""
    monkeypatch.chdir(tmp_path)
