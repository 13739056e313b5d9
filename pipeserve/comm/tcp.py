"""Our own TCP transport: authenticated connections, typed frames, one reader thread each.

Every rank may listen (the driver on the address it is given; a stage on the
address it uses to reach the driver) and connects to the ranks it sends to:
stages to the driver and to their next stage. A connection is usable only
after the mutual HMAC handshake (``comm/auth.py``) and a ``HELLO`` frame that
says which rank is calling; before that nothing is parsed. Each connection
has a reader thread that decodes frames (``comm/messages.py``) into one queue,
so ``recv`` returns messages from any rank in arrival order per rank; or,
once an owner calls ``set_receiver``, hands each message to the owner's
function on that reader thread (no queue, no wake-up of a receiving thread:
one request pays that wake-up on every hop of every token). A
connection that closes becomes a ``LOST`` message from its rank; a new
``HELLO`` for a rank replaces its old connection (a restarted stage).
Between two stages the lower rank connects (``link``), so two stages never
dial each other at once; the higher one waits for that connection to send.
Tensors travel as raw bytes right after their frame's header (CUDA tensors
are staged through host memory).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from pipeserve.comm.auth import AuthError, client_handshake, server_handshake
from pipeserve.comm.messages import PREFIX, Hello, NodeInfo, Peer, decode_header, encode_frame, parse_prefix
from pipeserve.comm.transport import Kind, Message, Transport
from pipeserve.worker.step_wire import WireError

logger = logging.getLogger(__name__)

FIRST_FRAME_TIMEOUT = 10.0
LINK_WAIT = 30.0      # a higher rank waits this long for the lower one to connect


class Connection:
    def __init__(self, sock: socket.socket, rank: int) -> None:
        self.sock, self.rank = sock, rank
        self.lock = threading.Lock()
        self.closed = False        # closed by us: no LOST note

    def send(self, kind: Kind, obj: Any, tensor: torch.Tensor | None) -> None:
        head, raw = encode_frame(kind, obj, tensor)
        with self.lock:
            if raw is None or not raw.nbytes:
                self.sock.sendall(head)
                return
            # One call for both buffers: two would put a small frame in two packets, and the
            # reader would wake up for each (a wake-up of an idle core is ~0.1 ms here).
            sent = self.sock.sendmsg([head, raw])
            if sent < len(head):
                self.sock.sendall(head[sent:])
                sent = len(head)
            if sent < len(head) + raw.nbytes:
                self.sock.sendall(raw[sent - len(head):])

    def read(self) -> tuple[Kind, Any, torch.Tensor | None, float]:
        prefix = _read_exact(self.sock, PREFIX.size)
        arrived = time.time()
        header_len, tensor_len = parse_prefix(prefix)
        header = _read_exact(self.sock, header_len)
        kind, obj, dtype, shape = decode_header(header, tensor_len)
        tensor = None
        if dtype is not None:
            if tensor_len:   # one torch call on a filled buffer: this path runs cold after a compute
                buf = bytearray(tensor_len)
                _read_into(self.sock, memoryview(buf))
                # contiguous, so a view (~30 us cold against reshape's ~60: benchmarks/cold_step_ops.py)
                tensor = torch.frombuffer(buf, dtype=dtype).view(shape)
            else:
                tensor = torch.empty(shape, dtype=dtype)
        return kind, obj, tensor, arrived

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class TcpTransport(Transport):
    def __init__(self, rank: int, world_size: int, key: bytes, device: torch.device | None = None,
                 node_info: NodeInfo | None = None) -> None:
        """``node_info``: the driver's answer to a worker node's NODE question (driver only)."""
        self.rank, self.world_size, self.key = rank, world_size, key
        self.device = device or torch.device("cpu")
        self.node_info = node_info
        self.inbox: queue.Queue[Message] = queue.Queue()
        self._receiver: Callable[[Message], None] | None = None
        self._receiver_lock = threading.Lock()
        self.peers: dict[int, Peer] = {}          # where ranks listen (for connecting on first send)
        self._conns: dict[int, Connection] = {}
        # Ranks whose connection closed (until one replaces it): a send to one fails at once
        # rather than waiting LINK_WAIT for a link that this generation will not see again.
        self._lost: set[int] = set()
        self._lock = threading.Condition()
        self._listener: socket.socket | None = None
        self._closed = False

    # -- connections -----------------------------------------------------------
    def listen(self, host: str, port: int = 0) -> int:
        """Accept connections on ``host:port`` (0: a free port); returns the port."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise ConnectionError(f"cannot listen on {host}:{port}: {exc}") from None
        sock.listen(64)
        self._listener = sock
        threading.Thread(target=self._accept_loop, name=f"rank{self.rank}-accept", daemon=True).start()
        return sock.getsockname()[1]

    def connect(self, rank: int, host: str, port: int, hello: Hello, timeout: float = 10.0) -> None:
        """Open (or replace) the connection to ``rank``: handshake, then our HELLO."""
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_handshake(sock, self.key)
            conn = Connection(sock, rank)
            conn.send(Kind.HELLO, hello, None)
        except BaseException:
            sock.close()
            raise
        self._register(conn)

    def ask(self, host: str, port: int, kind: Kind, obj: Any, timeout: float = 10.0) -> Any:
        """One question on a fresh connection (a worker node's NODE): its answer's payload."""
        with socket.create_connection((host, port), timeout=timeout) as sock:
            client_handshake(sock, self.key)
            conn = Connection(sock, 0)
            conn.send(kind, obj, None)
            sock.settimeout(timeout)
            answer, payload, _, _ = conn.read()
        if answer != kind:
            raise ConnectionError(f"the driver answered {answer.name} to {kind.name}")
        return payload

    def set_peers(self, peers: list[Peer]) -> None:
        """Where other ranks listen; a changed address drops the old connection."""
        for peer in peers:
            old = self.peers.get(peer.rank)
            self.peers[peer.rank] = peer
            if old is not None and (old.host, old.port) != (peer.host, peer.port):
                self.disconnect(peer.rank)

    def link(self, rank: int) -> None:
        """Make sure a connection to stage ``rank`` exists: dial it if we are the lower rank."""
        if rank not in self._conns and self.rank < rank:
            self._dial(rank)

    def disconnect(self, rank: int) -> None:
        with self._lock:
            conn = self._conns.pop(rank, None)
        if conn is not None:
            conn.close()

    def connected(self, rank: int) -> bool:
        return rank in self._conns

    def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)   # wakes the accept thread; frees the port
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
            self._lock.notify_all()
        for conn in conns:
            conn.close()

    # -- Transport ---------------------------------------------------------------
    def send(self, dst: int, kind: Kind, obj: Any = None, tensor: torch.Tensor | None = None) -> None:
        conn = self._conns.get(dst) or self._await_link(dst)
        try:
            conn.send(kind, obj, tensor)
        except OSError as exc:
            self._drop(conn)
            raise ConnectionError(f"rank {self.rank} -> rank {dst}: {exc}") from None

    def recv(self, timeout: float | None = None) -> Message:
        start = time.time()
        try:
            message = self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no message within {timeout:g} s") from None
        message.arrived = max(message.arrived, start)   # queued while we computed: no wait, no transfer
        return message

    def set_receiver(self, receiver: Callable[[Message], None]) -> None:
        """From now on, call ``receiver`` with each message on the thread that read it (one
        per connection: in order per rank, concurrently across ranks) instead of queueing
        it for ``recv``. Messages queued already go to it first, in order."""
        with self._receiver_lock:
            while not self.inbox.empty():
                receiver(self.inbox.get_nowait())
            self._receiver = receiver

    # -- internals -----------------------------------------------------------------
    def _deliver(self, message: Message) -> None:
        with self._receiver_lock:
            receiver = self._receiver
            if receiver is None:
                self.inbox.put(message)
                return
        receiver(message)

    def _await_link(self, dst: int) -> Connection:
        if self.rank < dst and dst in self.peers:
            self._dial(dst)
        deadline = time.monotonic() + LINK_WAIT
        with self._lock:
            while dst not in self._conns:
                if dst in self._lost:
                    raise ConnectionError(f"rank {self.rank}'s connection to rank {dst} was lost")
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise ConnectionError(f"rank {self.rank} has no connection to rank {dst} (waited "
                                          f"{LINK_WAIT:g} s for it)")
                self._lock.wait(min(left, 0.5))
            return self._conns[dst]

    def _dial(self, dst: int) -> None:
        peer = self.peers.get(dst)
        if peer is None:
            raise ConnectionError(f"rank {self.rank} does not know where rank {dst} listens")
        try:
            self.connect(dst, peer.host, peer.port, Hello(self.rank, os.getpid()))
        except OSError as exc:
            raise ConnectionError(f"rank {self.rank} cannot connect to rank {dst} at {peer.host}:{peer.port}: "
                                  f"{exc}") from None

    def _register(self, conn: Connection) -> None:
        with self._lock:
            old = self._conns.get(conn.rank)
            self._conns[conn.rank] = conn
            self._lost.discard(conn.rank)
            self._lock.notify_all()
        if old is not None:
            old.close()
        threading.Thread(target=self._read_loop, args=(conn,), name=f"rank{self.rank}-from{conn.rank}",
                         daemon=True).start()

    def _drop(self, conn: Connection) -> bool:
        """Forget ``conn``; True when it was the current connection of its rank."""
        with self._lock:
            if self._conns.get(conn.rank) is conn:
                del self._conns[conn.rank]
                self._lost.add(conn.rank)
                self._lock.notify_all()     # a sender waiting for this rank's link gives up now
                return True
            return False

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(sock, addr), name=f"rank{self.rank}-admit",
                             daemon=True).start()

    def _admit(self, sock: socket.socket, addr: tuple) -> None:
        """Handshake, then the first frame must say who calls; anything else closes the socket."""
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server_handshake(sock, self.key)
            sock.settimeout(FIRST_FRAME_TIMEOUT)
            conn = Connection(sock, -1)
            kind, obj, tensor, arrived = conn.read()
            sock.settimeout(None)
            if kind == Kind.NODE and self.node_info is not None:
                conn.send(Kind.NODE, self.node_info, None)
                sock.close()
                return
            if kind != Kind.HELLO or tensor is not None or not 0 <= obj.rank < self.world_size \
                    or obj.rank == self.rank:
                raise WireError(f"expected HELLO from a rank of this pipeline, got {kind.name}")
        except (AuthError, WireError, OSError) as exc:
            logger.warning("rank %d refused a connection from %s:%s: %s", self.rank, addr[0], addr[1], exc)
            sock.close()
            return
        conn.rank = obj.rank
        if obj.host:
            self.peers[obj.rank] = Peer(obj.rank, obj.host, obj.port)
        self._register(conn)
        self._deliver(Message(obj.rank, Kind.HELLO, obj, None, arrived))

    def _read_loop(self, conn: Connection) -> None:
        while True:
            try:
                kind, obj, tensor, arrived = conn.read()
            except (OSError, ConnectionError, WireError) as exc:
                current = self._drop(conn)
                if isinstance(exc, WireError):
                    logger.error("rank %d: bad frame from rank %d, closing: %s", self.rank, conn.rank, exc)
                    conn.close()
                    conn.closed = False
                if current and not conn.closed and not self._closed:
                    self._deliver(Message(conn.rank, Kind.LOST, str(exc) or type(exc).__name__, None,
                                          time.time()))
                return
            if tensor is not None and self.device.type != "cpu":
                tensor = tensor.to(self.device)
            self._deliver(Message(conn.rank, kind, obj, tensor, arrived))


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _read_into(sock, memoryview(buf))
    return bytes(buf)


def _read_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed")
        got += n
