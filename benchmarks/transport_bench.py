"""Replication transport throughput next to raw loopback TCP, in one run.

For each slot size it measures (medians, receiver in a separate process):
  * raw TCP - a plain socket: ``sendall`` from a shared-memory mapping on this side,
              ``recv_into`` a pre-faulted shared-memory mapping on the other (the limit)
  * push    - ``Client.push`` of a committed slot to a ``Server``: authenticated
              handshake once, ``os.sendfile`` from /dev/shm, ``recv_into`` the replica
              slot, xxh3 verification of every tensor and the commit on the receiver
  * xxh3    - one core hashing the same bytes (the verification share of a push)
and prints push throughput relative to raw TCP (target >= 0.7x).

    python benchmarks/transport_bench.py --sizes 256M,1G --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import machine, median_time, mib, table  # noqa: E402

from launcher import memory  # noqa: E402
from launcher.replication.transport import Client, Server  # noqa: E402
from launcher.slots import SlotOwner  # noqa: E402

TENSOR = 64 << 20  # bytes per tensor in the benchmark slot
_SIZE = struct.Struct("<Q")


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


# -- the receiving process --------------------------------------------------------------

def serve_raw(run_id: str) -> None:
    """Receive length-prefixed transfers into a pre-faulted segment; ack each with a byte."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
    conn, _ = listener.accept()
    segment: memory.Segment | None = None
    name = f"gemini-bench-raw-{memory.run_key(run_id)}"
    try:
        with conn:
            while True:
                head = conn.recv(_SIZE.size, socket.MSG_WAITALL)
                if len(head) < _SIZE.size:
                    return
                (n,) = _SIZE.unpack(head)
                if segment is None or segment.size < n:
                    if segment is not None:
                        segment.close()
                    segment = memory.create_segment(name, n)
                with memoryview(segment.view) as view:
                    got = 0
                    while got < n:
                        k = conn.recv_into(view[got:n], n - got)
                        if k == 0:
                            return
                        got += k
                conn.sendall(b"k")
    finally:
        if segment is not None:
            segment.close()
        memory.unlink_segment(name)


def serve_push(run_id: str, secret: bytes) -> None:
    """Run a transport Server over this process's own replica slots until stdin closes."""
    owner = SlotOwner(run_id=run_id, host_id="bench-receiver", local_world_size=1)
    server = Server(owner, secret=secret, run_id=run_id, timeout=120.0)
    try:
        print(json.dumps({"port": server.address[1]}), flush=True)
        sys.stdin.read()
    finally:
        server.close()
        owner.close()


class Receiver:
    """This script, started again as the receiving process."""

    def __init__(self, kind: str, run_id: str, secret: bytes) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", kind, "--run-id", run_id],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(secret.hex() + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {kind} receiver did not start")
        self.address = ("127.0.0.1", int(json.loads(line)["port"]))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- the sending side --------------------------------------------------------------------

def fill_slot(owner: SlotOwner, nbytes: int) -> tuple[memory.Segment, bytes]:
    """A committed slot of ``nbytes`` random bytes in 64 MiB tensors, and its metadata."""
    count = (nbytes + TENSOR - 1) // TENSOR
    meta_guess = 200 * count + 100
    segment = owner.write_target(0, memory.slot_size(nbytes, meta_guess), replica=False)
    tensors = []
    with memoryview(segment.view) as view:
        for i in range(count):
            start = i * TENSOR
            end = min(start + TENSOR, nbytes)
            view[memory.HEADER_SIZE + start:memory.HEADER_SIZE + end] = os.urandom(end - start)
            digest = memory.checksum(view[memory.HEADER_SIZE + start:memory.HEADER_SIZE + end])
            tensors.append({"path": f"t{i}", "dtype": "uint8", "shape": [end - start],
                            "offset": start, "nbytes": end - start, "device": "cpu",
                            "xxh3": f"{digest:016x}"})
    meta = json.dumps({"tensors": tensors, "blocks": [], "tree": {}}).encode()
    return segment, meta


def recommit(segment: memory.Segment, meta: bytes, run_id: str, step: int, nbytes: int) -> None:
    """Commit the same bytes as a new step (so the receiver does not already hold it)."""
    memory.set_state(segment.view, memory.SlotState.WRITING)
    memory.write_commit(segment.view, step=step, seq=step + 1, rank=0, world_size=1,
                        run_id=run_id, data_len=nbytes, meta=meta)


def bench_raw(segment: memory.Segment, nbytes: int, run_id: str, repeat: int) -> float:
    receiver = Receiver("raw", run_id, b"")
    try:
        with socket.create_connection(receiver.address) as sock, \
                memoryview(segment.view) as view, \
                view[memory.HEADER_SIZE:memory.HEADER_SIZE + nbytes] as data:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def send() -> None:
                sock.sendall(_SIZE.pack(nbytes))
                sock.sendall(data)
                if sock.recv(1) != b"k":
                    raise RuntimeError("raw receiver failed")

            return median_time(send, repeat=repeat, warmup=1)
    finally:
        receiver.close()


def bench_push(segment: memory.Segment, meta: bytes, nbytes: int, run_id: str,
               secret: bytes, repeat: int) -> float:
    receiver = Receiver("push", run_id, secret)
    client = Client(receiver.address, secret=secret, run_id=run_id, timeout=120.0)
    steps = iter(range(1, 10**9))
    times = []
    try:
        for i in range(repeat + 2):  # two warm-ups: the receiver creates both replica slots
            step = next(steps)
            recommit(segment, meta, run_id, step, nbytes)
            start = time.perf_counter()
            if client.push(segment) != step:
                raise RuntimeError("push did not commit")
            if i >= 2:
                times.append(time.perf_counter() - start)
    finally:
        client.close()
        receiver.close()
    return sorted(times)[len(times) // 2]


def bench_size(nbytes: int, repeat: int) -> list[object]:
    run_id = f"bench-transport-{os.getpid()}-{nbytes}"
    secret = secrets.token_bytes(32)
    owner = SlotOwner(run_id=run_id, host_id="bench-sender", local_world_size=1)
    try:
        segment, meta = fill_slot(owner, nbytes)
        recommit(segment, meta, run_id, 0, nbytes)
        t_raw = bench_raw(segment, nbytes, run_id, repeat)
        t_push = bench_push(segment, meta, nbytes, run_id, secret, repeat)
        with memoryview(segment.view) as view, \
                view[memory.HEADER_SIZE:memory.HEADER_SIZE + nbytes] as data:
            t_hash = median_time(lambda: memory.checksum(data), repeat=repeat)
    finally:
        owner.close()
        for name in memory.list_segments(memory.PREFIX + memory.run_key(run_id)):
            memory.unlink_segment(name)
    gbps = lambda t: f"{nbytes / t / 1e9:.2f} GB/s"  # noqa: E731
    return [mib(nbytes), f"{t_raw * 1e3:.0f} ms ({gbps(t_raw)})",
            f"{t_push * 1e3:.0f} ms ({gbps(t_push)})", f"{t_hash * 1e3:.0f} ms ({gbps(t_hash)})",
            f"{t_raw / t_push:.2f}x"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256M,1G")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--serve", choices=["raw", "push"], help=argparse.SUPPRESS)
    parser.add_argument("--run-id", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        secret = bytes.fromhex(sys.stdin.readline().strip())
        if args.serve == "raw":
            serve_raw(args.run_id)
        else:
            serve_push(args.run_id, secret)
        return
    rows = []
    for text in args.sizes.split(","):
        rows.append(bench_size(parse_size(text), args.repeat))
        print(f"measured {text}", file=sys.stderr, flush=True)
    print(f"machine: {machine()}")
    print(f"medians of {args.repeat} runs; receiver in a separate process over loopback TCP\n")
    print(table(["slot", "raw TCP (sendall -> recv_into)",
                 "push (sendfile -> recv_into + verify + commit)", "xxh3, one core",
                 "push / raw"], rows))


if __name__ == "__main__":
    main()
