"""Finding the driver: addresses, and a stage's bounded wait to join."""

from __future__ import annotations

import socket
import time

from pipeserve.comm.auth import AuthError
from pipeserve.comm.messages import Hello, NodeInfo
from pipeserve.comm.tcp import TcpTransport
from pipeserve.comm.transport import Kind

RETRY_S = 0.2


def local_address_for(master_addr: str) -> str:
    """The address of the interface this host uses to reach ``master_addr``.

    A UDP "connect" only picks a route; it sends nothing. Listening on this
    address avoids hostname lookups, which fail inside network namespaces.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_addr, 9))
        return s.getsockname()[0]


def join_driver(transport: TcpTransport, addr: str, port: int, hello: Hello, timeout: float):
    """Connect to the driver (retrying while it is not up yet), say HELLO, return its SpecWire.

    Raises ``AuthError`` at once when the keys differ, ``ConnectionError`` when the
    driver could not be reached or did not answer within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        _retry(lambda: transport.connect(0, addr, port, hello), deadline, addr, port, timeout)
        while True:
            left = deadline - time.monotonic()
            try:
                message = transport.recv(timeout=max(left, 0.01))
            except TimeoutError:
                raise ConnectionError(f"the driver at {addr}:{port} sent no pipeline spec within {timeout:g} s") \
                    from None
            if message.src == 0 and message.kind == Kind.SPEC:
                return message.obj
            if message.src == 0 and message.kind == Kind.LOST:
                break
        # Closed before the spec: a driver ending the generation this stage reached (a stage
        # started again after a crash may call while the failed one is being torn down; the
        # next one listens on the same port), or one that has all its stages. Call again.
        if time.monotonic() + RETRY_S >= deadline:
            raise ConnectionError(f"the driver at {addr}:{port} closed the connection before sending the "
                                  f"pipeline spec, until {timeout:g} s had passed (it may already have all "
                                  f"its stages)")
        time.sleep(RETRY_S)


def ask_driver(transport: TcpTransport, addr: str, port: int, question: NodeInfo, timeout: float) -> NodeInfo:
    """A worker node's question: how many stages does the pipeline have?"""
    deadline = time.monotonic() + timeout
    return _retry(lambda: transport.ask(addr, port, Kind.NODE, question), deadline, addr, port, timeout)


def _retry(attempt, deadline: float, addr: str, port: int, timeout: float):
    while True:
        try:
            return attempt()
        except AuthError:
            raise
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ConnectionError(f"could not reach the driver at {addr}:{port} within {timeout:g} s (is it "
                                      f"running with --master-addr {addr} --master-port {port}?): {exc}") from None
            time.sleep(RETRY_S)
