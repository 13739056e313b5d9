"""Finding each other: the driver's key-value store, addresses, and bounded waits for peers."""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Callable

import torch.distributed as dist


def local_address_for(master_addr: str) -> str:
    """The address of the interface this host uses to reach ``master_addr``.

    A UDP "connect" only picks a route; it sends nothing. Binding gloo to this
    address avoids hostname lookups, which fail inside network namespaces.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_addr, 9))
        return s.getsockname()[0]


def master_store(addr: str, port: int, world_size: int, timeout: float) -> dist.TCPStore:
    """The store the driver hosts; ``port`` 0 picks a free one (read it back from ``.port``)."""
    return dist.TCPStore(addr, port, world_size, True, datetime.timedelta(seconds=timeout),
                         wait_for_workers=False)


def client_store(addr: str, port: int, timeout: float) -> dist.TCPStore:
    try:
        return dist.TCPStore(addr, port, None, False, datetime.timedelta(seconds=timeout))
    except (RuntimeError, TimeoutError) as exc:
        raise ConnectionError(f"could not reach the driver's store at {addr}:{port} within {timeout:.0f} s "
                              f"(is the driver running with --master-addr {addr} --master-port {port}?): "
                              f"{exc}") from None


def wait_for_keys(store: dist.Store, keys: list[str], timeout: float,
                  check: Callable[[], None] = lambda: None, poll: float = 0.05) -> list[str]:
    """Wait until every key exists; returns those still missing after ``timeout``.

    ``check`` runs on every poll and may raise (e.g. a local stage process died),
    so that a crash ends the wait at once instead of after the timeout.
    """
    deadline = time.monotonic() + timeout
    missing = list(keys)
    while True:
        missing = [k for k in missing if not store.check([k])]
        if not missing or time.monotonic() >= deadline:
            return missing
        check()
        time.sleep(poll)
