"""bench_wire's two halves: the proxy counts every byte it forwards, exactly, and the denominator counts what had to
move (one model per agent and version it needed, one update per accepted result)."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_wire import raw_tensor_bytes
from benchlib import ByteCountingProxy

from fairfl.v1 import control_pb2


class Server:
    """Reads `expect` bytes from each connection, then answers `reply` bytes and closes it."""

    def __init__(self, expect: int, reply: bytes) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.expect, self.reply = expect, reply
        self.received: list[bytes] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            data = bytearray()
            while len(data) < self.expect:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
            self.received.append(bytes(data))
            conn.sendall(self.reply)

    def close(self) -> None:
        self.listener.close()


def exchange(address: str, payload: bytes, reply_size: int) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(payload)
        got = bytearray()
        while len(got) < reply_size:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            got += chunk
        return bytes(got)


def wait_for(proxy: ByteCountingProxy, expected: tuple[int, int]) -> tuple[int, int]:
    deadline = time.monotonic() + 10
    while proxy.counts() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return proxy.counts()


def test_proxy_forwards_and_counts_every_byte_each_way() -> None:
    up, down = 3 * (1 << 20) + 17, (1 << 20) + 5  # several buffers' worth, odd sizes
    payloads = [os.urandom(up) for _ in range(3)]
    reply = os.urandom(down)
    server = Server(up, reply)
    try:
        with ByteCountingProxy(server.address) as proxy:
            threads = [
                threading.Thread(target=lambda p=p: results.append(exchange(proxy.address, p, down))) for p in payloads
            ]
            results: list[bytes] = []
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert results == [reply] * 3  # forwarded intact
            assert sorted(server.received) == sorted(payloads)
            assert wait_for(proxy, (3 * up, 3 * down)) == (3 * up, 3 * down)
            assert proxy.connections == 3 and proxy.total == 3 * (up + down)
            time.sleep(0.1)
            assert proxy.counts() == (3 * up, 3 * down)  # nothing counted twice after the fact
    finally:
        server.close()


def round_event(number: int, selected: list[int], accepted: int, sha: str, evaluated: bool = False):
    return control_pb2.RoundEvent(
        round=number, selected=selected, results_accepted=accepted, model_sha256=sha, evaluated=evaluated
    )


def test_raw_bytes_count_one_model_per_agent_and_version_and_one_update_per_result() -> None:
    ranges = {"agent-0": (0, 4), "agent-1": (5, 9)}
    rounds = [
        round_event(1, [0, 1, 2], 3, "v2"),  # agent-0 needs v1 (the initial model)
        round_event(2, [3, 6], 2, "v3", evaluated=True),  # both need v2; evaluation: both need v3
        round_event(3, [7, 8], 2, "v4"),  # agent-1 needs v3 again: it has it
        round_event(4, [1, 9], 1, "v5"),  # agent-0 needs v4, agent-1 v4; one result was lost
    ]
    raw = raw_tensor_bytes(rounds, ranges, model_bytes=100, num_clients=10)
    # (agent-0, v1), (agent-0, v2), (agent-1, v2), (agent-0, v3), (agent-1, v3), (agent-0, v4), (agent-1, v4)
    assert raw["model_fetches_needed"] == 7
    assert raw["down"] == 700
    assert raw["up"] == (3 + 2 + 2 + 1) * 100


def test_agents_without_run_clients_need_no_model_for_evaluation() -> None:
    ranges = {"agent-0": (0, 4), "agent-1": (5, 9)}
    raw = raw_tensor_bytes([round_event(1, [0], 1, "v2", evaluated=True)], ranges, model_bytes=10, num_clients=5)
    assert raw["model_fetches_needed"] == 2  # agent-0: v1 to train, v2 to evaluate; agent-1 hosts none of the 5


def test_replicated_agents_each_need_a_round_model_when_the_round_has_a_task_for_each() -> None:
    ranges = {"agent-0": (0, 9), "agent-1": (0, 9)}  # runtime.placement replicated: both host every client
    rounds = [round_event(1, [0, 1, 2], 3, "v2"), round_event(2, [3], 1, "v3", evaluated=True)]
    raw = raw_tensor_bytes(rounds, ranges, model_bytes=10, num_clients=10)
    # round 1: both need v1 (three tasks over two agents); round 2: one task, one agent needs v2; evaluation: both v3
    assert raw["model_fetches_needed"] == 5
