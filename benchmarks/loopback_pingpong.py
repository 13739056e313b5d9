"""One hop's latency on loopback: a 1 KiB message bounced between two processes, the sender
idle (spinning on the clock) for --gap-ms between rounds, as a stage is between a token's
hand-offs. Blocking receives (the stages' readers) against receivers that poll a
non-blocking socket (spinning), over TCP and a Unix socket pair:

    python benchmarks/loopback_pingpong.py [--rounds 500] [--gap-ms 3]

Prints, per mode, the round trip less the gap (two hops) and the sender's own time in send.
"""

from __future__ import annotations

import argparse
import os
import socket
import time


def _receive(sock: socket.socket, n: int, spin: bool) -> bytes:
    buf = b""
    while len(buf) < n:
        if not spin:
            buf += sock.recv(n - len(buf))
            continue
        try:
            buf += sock.recv(n - len(buf), socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass
    return buf


def _pair(unix: bool) -> tuple[socket.socket, socket.socket]:
    if unix:
        return socket.socketpair()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    server.close()
    for s in (client, accepted):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return accepted, client


def run(unix: bool, spin: bool, rounds: int, gap_s: float, size: int = 1024) -> tuple[float, float]:
    """(round trip less the gap, time in send), in microseconds per round."""
    mine, theirs = _pair(unix)
    pid = os.fork()
    if pid == 0:
        mine.close()
        for _ in range(rounds):
            theirs.sendall(_receive(theirs, size, spin))
        os._exit(0)
    theirs.close()
    message, in_send = b"x" * size, 0.0
    start = time.perf_counter()
    for _ in range(rounds):
        t0 = time.perf_counter()
        mine.sendall(message)
        in_send += time.perf_counter() - t0
        _receive(mine, size, spin)
        idle = time.perf_counter()
        while time.perf_counter() - idle < gap_s:
            pass
    elapsed = time.perf_counter() - start
    os.waitpid(pid, 0)
    mine.close()
    return (elapsed / rounds - gap_s) * 1e6, in_send / rounds * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--gap-ms", type=float, default=3.0)
    args = ap.parse_args()
    for unix in (False, True):
        for spin in (False, True):
            rtt, send = run(unix, spin, args.rounds, args.gap_ms / 1000)
            print(f"{'unix' if unix else 'tcp ':4} {'spinning' if spin else 'blocking':8}  "
                  f"round trip {rtt:7.1f} us  send {send:6.1f} us")


if __name__ == "__main__":
    main()
