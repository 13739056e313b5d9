"""The cluster key and the mutual HMAC challenge every pipeline connection starts with.

Before either side reads a single frame, both prove they hold the cluster key
without sending it (HMAC-SHA256 over fresh random nonces from both sides):

    server -> client   MAGIC + nonce_s                              (40 bytes)
    client -> server   nonce_c + HMAC(key, "client" + nonce_s + nonce_c)   (64 bytes)
    server -> client   HMAC(key, "server" + nonce_c + nonce_s)              (32 bytes)

The labels make the two proofs different, so neither side can reflect the
other's. All reads are fixed-size and bounded by ``HANDSHAKE_TIMEOUT``: a
stranger can hold a connection for that long at most and never gets a byte
parsed. The key is never sent, logged or put on a command line; the link is
authenticated, not encrypted (see docs/ARCHITECTURE.md, trust model).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket

KEY_ENV = "PIPESERVE_CLUSTER_KEY"
MAGIC = b"PIPESRV1"
NONCE = 32
DIGEST = 32
HANDSHAKE_TIMEOUT = 10.0


class AuthError(ConnectionError):
    """The peer did not prove it holds the cluster key (or is not a pipeserve peer)."""


def cluster_key(configured: str | None, nnodes: int) -> bytes:
    """The key for this run: the configured one, else ``$PIPESERVE_CLUSTER_KEY``, else
    (one host only) a random one that only this process and its children know."""
    key = configured or os.environ.get(KEY_ENV)
    if key:
        return key.encode()
    if nnodes > 1:
        raise ValueError(f"a pipeline over {nnodes} hosts needs a shared secret: set --cluster-key (or "
                         f"${KEY_ENV}) on the driver and ${KEY_ENV} for every `pipeserve worker`")
    return secrets.token_hex(32).encode()


def server_handshake(sock: socket.socket, key: bytes) -> None:
    nonce_s = os.urandom(NONCE)
    with _deadline(sock):
        sock.sendall(MAGIC + nonce_s)
        answer = _read_exact(sock, NONCE + DIGEST)
        nonce_c, proof = answer[:NONCE], answer[NONCE:]
        if not hmac.compare_digest(proof, _mac(key, b"client", nonce_s, nonce_c)):
            raise AuthError("the peer does not know the cluster key")
        sock.sendall(_mac(key, b"server", nonce_c, nonce_s))


def client_handshake(sock: socket.socket, key: bytes) -> None:
    with _deadline(sock):
        hello = _read_exact(sock, len(MAGIC) + NONCE)
        if hello[:len(MAGIC)] != MAGIC:
            raise AuthError("the peer is not a pipeserve pipeline port")
        nonce_s, nonce_c = hello[len(MAGIC):], os.urandom(NONCE)
        sock.sendall(nonce_c + _mac(key, b"client", nonce_s, nonce_c))
        proof = _read_exact(sock, DIGEST)
        if not hmac.compare_digest(proof, _mac(key, b"server", nonce_c, nonce_s)):
            raise AuthError("the driver (or stage) refused our cluster key, or does not know it: "
                            f"check ${KEY_ENV} on both sides")


def _mac(key: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, label + first + second, hashlib.sha256).digest()


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise AuthError("the connection closed during the handshake (wrong cluster key?)")
        buf += chunk
    return bytes(buf)


class _deadline:
    """Bound every handshake read/write, then restore blocking mode."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def __enter__(self) -> None:
        self.sock.settimeout(HANDSHAKE_TIMEOUT)

    def __exit__(self, exc_type, exc, tb) -> None:
        self.sock.settimeout(None)
        if isinstance(exc, socket.timeout):
            raise AuthError(f"no handshake within {HANDSHAKE_TIMEOUT:g} s") from None
