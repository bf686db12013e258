"""The transport's own floor (issue #21): the CPU that only moving one round's bytes costs, with nothing else.

    python scripts/bench_transport_floor.py                  # the all-participating preset's bytes, 4 transports
    python scripts/bench_transport_floor.py --quick          # fewer rounds: a smoke pass
    python scripts/bench_transport_floor.py --json out.json  # also write the figures for scripts/bench_report.py

#21 asks for every process's CPU per round within 1.15x the one-thread plain loop's. The loop's training is work any
design must do, so the platform's whole budget for everything else (control, bookkeeping, the exact fold, the
checkpoint, the ledger, the services) is 0.15x the loop's CPU. This script measures how much of that budget the
round's bytes alone take, on bare transports without any FairFL code in the path: a server process and two "agent"
processes on loopback, one round being each agent fetching the model once and sending its clients' updates (the
all-participating preset: 10 clients on 2 agents, MLP 784-200-200-10, 0.8 MB a model and an update). Transports:

- gRPC with mutual TLS, one unary call per update, raw bytes (no protobuf parse, no checksum), with FairFL's channel
  and server options and grpcio's blocking unary calls;
- the same without TLS;
- gRPC with mutual TLS, one call per agent carrying a partial sum of its clients' updates in double-double (hi and
  lo, 16 bytes a parameter; issue #21's planned agent-side folding): 2 calls instead of 10, and 20% fewer bytes
  (3.2 MB an agent instead of 4.0 MB);
- both gRPC shapes again, tuned: a grpc.aio server (one event loop, no thread-pool hand-off per call) and 1 MiB TCP
  read chunks on both ends (gRPC core's default starts at 8 KiB): the settings that looked cheapest, by about 10%, in
  short trials by hand at c28f3b7 (HTTP/2 max_frame_size 16 MiB, bdp_probe off and a 4 MiB write buffer changed
  nothing beyond the run-to-run noise there);
- a TLS socket (Python's ssl module, mutual TLS with the same certificates), each update received with recv_into into
  a preallocated buffer: what a bulk path beside gRPC could cost.

Every upload's reply carries the byte count the server received, which the agent checks, as it checks the model's
size. CPU per round is every process's user + system CPU over the measured rounds (after a warm-up round), divided by
them; the loop (bench_round's one-thread plain loop over the preset's rounds, its CPU per round as section 1 computes
it) and the transports are measured in 3 interleaved repetitions and the medians reported.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import socket
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import benchlib  # first: puts the repository on sys.path and pins OMP threads before torch loads
import grpc
import numpy as np
from bench_round import TARGET_CPU_RATIO, TARGET_FLOOR_RATIO, LoopTiming, loss_passes_run, plain_loop

from fairfl import tls
from fairfl.rpc_channel import CHANNEL_OPTIONS
from fairfl.rpc_security import TransportSecurity
from fairfl.rpc_server import SERVER_OPTIONS

CONFIG = benchlib.REPO / "experiments" / "bench_all_participating.yaml"
SERVICE = "bench.TransportFloor"
AGENTS = 2
CLIENTS = 10  # the preset's clients, all of them every round
ROUNDS, QUICK_ROUNDS = 200, 20
QUICK_PLAIN_ROUNDS = 6  # otherwise the preset's rounds, as section 1 runs the loop
REPEATS = 3
HEADER = struct.Struct("!BQ")  # TLS socket framing: operation, payload bytes
COUNT = struct.Struct("!Q")  # a reply's byte count: the model's size before it, the bytes received after an upload
# gRPC core reads a connection in chunks that start at 8 KiB and adapt; a round's messages are 0.8 MB or more
TUNED_OPTIONS: list[tuple[str, int]] = [
    ("grpc.experimental.tcp_read_chunk_size", 1 << 20),
    ("grpc.experimental.tcp_min_read_chunk_size", 256 << 10),
    ("grpc.experimental.tcp_max_read_chunk_size", 4 << 20),
]
IO_TIMEOUT_S = 60.0  # any one call or read: a transport that stalls fails the measurement instead of hanging it
FETCH, UPLOAD = 1, 2
TLS_RECORD = 16 * 1024


@dataclass(frozen=True)
class Transport:
    key: str
    label: str
    kind: str  # "grpc" or "socket"
    tls: bool
    partial: bool = False  # one double-double partial sum per agent instead of one message per update
    tuned: bool = False  # a grpc.aio server and TUNED_OPTIONS on both ends


TRANSPORTS = [
    Transport("grpc_mtls", "gRPC, mutual TLS, one call per update", "grpc", True),
    Transport("grpc_plain", "gRPC, plaintext, one call per update", "grpc", False),
    Transport("grpc_mtls_partial", "gRPC, mutual TLS, one partial sum (16 B/parameter) per agent", "grpc", True, True),
    Transport("grpc_mtls_tuned", "gRPC, mutual TLS, aio server, 1 MiB read chunks", "grpc", True, tuned=True),
    Transport(
        "grpc_mtls_partial_tuned",
        "gRPC, mutual TLS, aio server, 1 MiB read chunks, one partial sum per agent",
        "grpc",
        True,
        partial=True,
        tuned=True,
    ),
    Transport("socket_mtls", "TLS socket (Python ssl), recv_into a preallocated buffer", "socket", True),
]


# --- server -------------------------------------------------------------------------------------------------------


def serve_grpc(model: bytes, security: TransportSecurity | None, port_file: Path, tuned: bool) -> None:
    """Fetch returns the model, Upload the byte count it received. Tuned: a grpc.aio server, whose handlers run on its
    event loop with no thread-pool hand-off per call, and TUNED_OPTIONS."""

    def fetch(_request: bytes, _context: Any) -> bytes:
        return model

    def upload(request: bytes, _context: Any) -> bytes:
        received = np.frombuffer(request, dtype=np.uint8)  # what a receiver does first: view the bytes, no copy
        return COUNT.pack(received.nbytes)

    if not tuned:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=SERVER_OPTIONS)
        port = _serve_raw_bytes(server, security, fetch, upload)
        server.start()
        _announce(port_file, port)
        server.wait_for_termination()
        return

    async def serve() -> None:
        async def fetch_async(request: bytes, context: Any) -> bytes:
            return fetch(request, context)

        async def upload_async(request: bytes, context: Any) -> bytes:
            return upload(request, context)

        server = grpc.aio.server(options=[*SERVER_OPTIONS, *TUNED_OPTIONS])
        port = _serve_raw_bytes(server, security, fetch_async, upload_async)
        await server.start()
        _announce(port_file, port)
        await server.wait_for_termination()

    asyncio.run(serve())


def _serve_raw_bytes(server: Any, security: TransportSecurity | None, fetch: Any, upload: Any) -> int:
    """Register Fetch and Upload on a loopback port of `server` (sync or aio) and return the port."""
    handlers = {
        "Fetch": grpc.unary_unary_rpc_method_handler(fetch),  # no (de)serializers: raw bytes in and out
        "Upload": grpc.unary_unary_rpc_method_handler(upload),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    address = "127.0.0.1:0"
    if security:
        return int(server.add_secure_port(address, security.server_credentials()))
    return int(server.add_insecure_port(address))


def _announce(port_file: Path, port: int) -> None:
    """Write the port where the parent looks for it, whole (a rename), never half-written."""
    partial = port_file.with_suffix(".partial")
    partial.write_text(str(port))
    partial.replace(port_file)


def _recv_exactly(conn: ssl.SSLSocket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed mid-message")
        got += n


def serve_socket(model: bytes, certs: Path, port_file: Path) -> None:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(certs / "server" / tls.CA_CERT))
    context.load_cert_chain(certs / "server" / tls.CERT, certs / "server" / tls.KEY)
    context.verify_mode = ssl.CERT_REQUIRED
    listener = socket.create_server(("127.0.0.1", 0))
    _announce(port_file, listener.getsockname()[1])

    def handle(raw: socket.socket) -> None:
        raw.settimeout(IO_TIMEOUT_S)
        with context.wrap_socket(raw, server_side=True) as conn:
            header = bytearray(HEADER.size)
            buffer = bytearray(len(model))
            while True:
                try:
                    _recv_exactly(conn, memoryview(header))
                except (ConnectionError, OSError):
                    return
                operation, size = HEADER.unpack(header)
                if operation == FETCH:
                    conn.sendall(COUNT.pack(len(model)))
                    conn.sendall(model)
                else:
                    if size > len(buffer):
                        buffer = bytearray(size)
                    _recv_exactly(conn, memoryview(buffer)[:size])
                    conn.sendall(COUNT.pack(size))

    while True:
        raw, _ = listener.accept()
        threading.Thread(target=handle, args=(raw,), daemon=True).start()


# --- agent --------------------------------------------------------------------------------------------------------


RoundTrip = Callable[[list[np.ndarray]], None]


def run_agent(args: argparse.Namespace) -> None:
    """Warm up one round, say "ready", wait for "go", run the rounds, print this process's CPU seconds for them."""
    payloads = [
        np.random.default_rng(i).standard_normal(args.update_bytes // 4, dtype=np.float32) for i in range(args.uploads)
    ]
    round_trip = _grpc_agent(args) if args.kind == "grpc" else _socket_agent(args)
    round_trip(payloads)
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.process_time()
    for _ in range(args.rounds):
        round_trip(payloads)
    print(f"cpu {time.process_time() - started:.6f}", flush=True)


def _checked(what: str, got: int, expected: int) -> None:
    if got != expected:
        raise SystemExit(f"{what}: {got} bytes, expected {expected}")


def _grpc_agent(args: argparse.Namespace) -> RoundTrip:
    address = f"127.0.0.1:{args.port}"
    options = [*CHANNEL_OPTIONS, *(TUNED_OPTIONS if args.tuned else [])]
    if args.tls:
        security = TransportSecurity.from_dir(args.certs / "agent")
        # The server's certificate names localhost; loopback by address, so override the name checked.
        channel = grpc.secure_channel(
            address,
            security.channel_credentials(),
            options=[*options, ("grpc.ssl_target_name_override", "localhost")],
        )
    else:
        channel = grpc.insecure_channel(address, options=options)
    fetch = channel.unary_unary(f"/{SERVICE}/Fetch")
    upload = channel.unary_unary(f"/{SERVICE}/Upload")

    messages: dict[int, bytes] = {}  # grpcio sends bytes: each payload's are made once, outside the measured rounds

    def round_trip(payloads: list[np.ndarray]) -> None:
        _checked("the model fetched", len(fetch(b"", timeout=IO_TIMEOUT_S)), args.model_bytes)
        for i, payload in enumerate(payloads):
            message = messages.setdefault(i, payload.tobytes())
            (received,) = COUNT.unpack(upload(message, timeout=IO_TIMEOUT_S))
            _checked("an update the server received", received, len(message))

    return round_trip


def _socket_agent(args: argparse.Namespace) -> RoundTrip:
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(args.certs / "agent" / tls.CA_CERT))
    context.load_cert_chain(args.certs / "agent" / tls.CERT, args.certs / "agent" / tls.KEY)
    raw = socket.create_connection(("127.0.0.1", args.port), timeout=IO_TIMEOUT_S)
    conn = context.wrap_socket(raw, server_hostname="localhost")
    model = bytearray(args.model_bytes)
    count = bytearray(COUNT.size)

    def read_count() -> int:
        _recv_exactly(conn, memoryview(count))
        return int(COUNT.unpack(count)[0])

    def round_trip(payloads: list[np.ndarray]) -> None:
        conn.sendall(HEADER.pack(FETCH, 0))
        _checked("the model fetched", read_count(), args.model_bytes)
        _recv_exactly(conn, memoryview(model))
        for payload in payloads:
            conn.sendall(HEADER.pack(UPLOAD, payload.nbytes))
            conn.sendall(memoryview(payload).cast("B"))  # straight from the tensor's memory
            _checked("an update the server received", read_count(), payload.nbytes)

    return round_trip


# --- the parent: one measurement per transport -------------------------------------------------------------------


def _child(role: str, transport: Transport, certs: Path, extra: list[str], **popen: Any) -> subprocess.Popen[str]:
    argv = [sys.executable, __file__, "--role", role, "--kind", transport.kind, "--certs", str(certs), *extra]
    if transport.tls:
        argv.append("--tls")
    if transport.tuned:
        argv.append("--tuned")
    return subprocess.Popen(argv, text=True, **popen)


def round_shape(transport: Transport, numel: int) -> tuple[int, int]:
    """(messages, bytes a message) an agent uploads a round: its clients' float32 updates, or one double-double partial
    sum of them (hi and lo, float64 each)."""
    return (1, numel * 16) if transport.partial else (CLIENTS // AGENTS, numel * 4)


def _read_line(process: subprocess.Popen[str], what: str, timeout_s: float) -> str:
    """A child's next line of output, or SystemExit naming `what` when none comes in time (a stalled transport)."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    if not ready:
        raise SystemExit(f"bench_transport_floor: {what}: no answer in {timeout_s:g} s")
    return process.stdout.readline().strip()


def measure(transport: Transport, certs: Path, numel: int, rounds: int, work: Path) -> dict[str, float]:
    """CPU seconds per round of the server and of the agents (summed) for one transport."""
    model_bytes = numel * 4
    uploads, update_bytes = round_shape(transport, numel)
    port_file = work / f"{transport.key}.port"
    port_file.unlink(missing_ok=True)  # an earlier repetition's: its server is gone
    server = _child("server", transport, certs, ["--model-bytes", str(model_bytes), "--port-file", str(port_file)])
    agents: list[subprocess.Popen[str]] = []
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bench_transport_floor: the {transport.key} server did not start")
            time.sleep(0.05)
        port = port_file.read_text()
        extra = ["--port", port, "--rounds", str(rounds), "--uploads", str(uploads)]
        extra += ["--update-bytes", str(update_bytes), "--model-bytes", str(model_bytes)]
        agents = [
            _child("agent", transport, certs, extra, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            for _ in range(AGENTS)
        ]
        for agent in agents:
            if _read_line(agent, f"a {transport.key} agent's warm-up round", IO_TIMEOUT_S) != "ready":
                raise SystemExit(f"bench_transport_floor: a {transport.key} agent failed its warm-up round")
        server_started = benchlib.cpu_seconds(server.pid)
        for agent in agents:
            assert agent.stdin is not None
            agent.stdin.write("go\n")
            agent.stdin.flush()
        agent_cpu = 0.0
        for agent in agents:
            line = _read_line(agent, f"a {transport.key} agent's rounds", rounds * IO_TIMEOUT_S).split()
            if agent.wait(timeout=IO_TIMEOUT_S) != 0 or len(line) != 2 or line[0] != "cpu":
                raise SystemExit(f"bench_transport_floor: a {transport.key} agent failed")
            agent_cpu += float(line[1])
        server_cpu = benchlib.cpu_seconds(server.pid) - server_started
    finally:
        for process in [*agents, server]:
            if process.poll() is None:
                process.kill()
                process.wait()
    return {"server": server_cpu / rounds, "agents": agent_cpu / rounds}


def plain_loop_cpu(config: Any, rounds: int) -> float:
    """The one-thread plain loop's CPU seconds per round on the preset, as section 1 computes it (bench_round's
    LoopTiming: rounds 2 to the last, the final evaluation amortised over them): the training #21's 1.15x is
    measured against."""
    everyone = list(range(config.data.num_clients))
    loop = plain_loop(config, [everyone] * rounds)
    return LoopTiming.of(loop, loss_passes_run(config)).cpu


def crypto_floor(round_bytes: int, repeats: int = 5) -> float:
    """CPU seconds to seal and open `round_bytes` with AES-256-GCM in TLS-sized records (16 KiB) with OpenSSL (via
    `cryptography`), best of `repeats`: what mutual TLS cannot avoid, whatever carries the bytes."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    cipher, nonce, record = AESGCM(AESGCM.generate_key(256)), os.urandom(12), os.urandom(TLS_RECORD)
    records = -(-round_bytes // TLS_RECORD)
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        for _ in range(records):
            cipher.decrypt(nonce, cipher.encrypt(nonce, record, None), None)
        best = min(best, time.process_time() - started)
    return best


def make_certificates(directory: Path) -> None:
    authority = tls.LocalCertificates(directory)
    authority.issue("server", tls.ROLE_SERVICE)
    authority.issue("agent", tls.ROLE_AGENT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds: a smoke pass")
    parser.add_argument("--json", type=Path, help="also write the figures here (scripts/bench_report.py)")
    parser.add_argument("--role", choices=["server", "agent"], help=argparse.SUPPRESS)
    parser.add_argument("--kind", choices=["grpc", "socket"], help=argparse.SUPPRESS)
    parser.add_argument("--tls", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tuned", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--certs", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--uploads", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--update-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model-bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "server":
        model = np.random.default_rng(0).standard_normal(args.model_bytes // 4, dtype=np.float32).tobytes()
        if args.kind == "socket":
            serve_socket(model, args.certs, args.port_file)
        else:
            security = TransportSecurity.from_dir(args.certs / "server") if args.tls else None
            serve_grpc(model, security, args.port_file, args.tuned)
        return 0
    if args.role == "agent":
        run_agent(args)
        return 0
    return report(args)


def report(args: argparse.Namespace) -> int:
    from aggregator_service.engine import initial_model

    started = time.perf_counter()
    config = benchlib.load_config(CONFIG)
    layout, _ = initial_model(config)
    rounds, repeats = (QUICK_ROUNDS, 1) if args.quick else (ROUNDS, REPEATS)
    plains: list[float] = []
    cpu: dict[str, list[dict[str, float]]] = {t.key: [] for t in TRANSPORTS}
    with tempfile.TemporaryDirectory(prefix="fairfl-floor-") as tmp:
        work = Path(tmp)
        make_certificates(work)
        for _ in range(repeats):  # interleaved: the machine's drift moves the loop and the transports alike
            plains.append(plain_loop_cpu(config, QUICK_PLAIN_ROUNDS if args.quick else config.rounds))
            for transport in TRANSPORTS:
                cpu[transport.key].append(measure(transport, work, layout.numel, rounds, work))
    plain = statistics.median(plains)
    # Round time / ideal floor >= CPU per round / the one-thread loop's CPU, approximately (a round cannot end before
    # its CPU work is done on the cores the floor divides over; the floor is the loop's work, which its CPU
    # approximates), so the time target bounds the CPU too, more loosely.
    budgets = {"cpu": (TARGET_CPU_RATIO - 1.0) * plain, "time": (TARGET_FLOOR_RATIO - 1.0) * plain}
    round_bytes = (AGENTS + CLIENTS) * layout.numel * 4  # the model down to each agent, ten updates up
    figures = [
        benchlib.figure(
            f"plain loop, 1 torch thread: CPU per round (the preset's training; {_runs(plains, 1e3, 'ms')})",
            plain * 1e3,
            "ms",
        ),
        benchlib.figure(
            f"#21's CPU budget for everything but training: {TARGET_CPU_RATIO - 1:.2f}x the plain loop's CPU",
            budgets["cpu"] * 1e3,
            "ms",
            key="budget_ms",
        ),
        benchlib.figure(
            f"the round-time target's looser bound: {TARGET_FLOOR_RATIO - 1:.2f}x the plain loop's CPU",
            budgets["time"] * 1e3,
            "ms",
        ),
        benchlib.figure(
            f"AES-256-GCM seal + open of one round's {round_bytes / 1e6:.1f} MB in 16 KiB records, one thread",
            crypto_floor(round_bytes) * 1e3,
            "ms",
            key="cipher_ms",
        ),
    ]
    totals: dict[str, float] = {}
    for transport in TRANSPORTS:
        runs = cpu[transport.key]
        per_run = [c["server"] + c["agents"] for c in runs]
        shares = [total / ((TARGET_CPU_RATIO - 1.0) * p) for total, p in zip(per_run, plains, strict=True)]
        totals[transport.key] = total = statistics.median(per_run)
        server, agents = (statistics.median(c[role] for c in runs) for role in ("server", "agents"))
        figures += [
            benchlib.figure(
                f"{transport.label}: CPU per round, all processes ({_runs(per_run, 1e3, 'ms')}; the medians of the "
                f"server's and the agents' own: {server * 1e3:.1f} and {agents * 1e3:.1f} ms)",
                total * 1e3,
                "ms",
                key=f"{transport.key}_ms",
            ),
            benchlib.figure(
                f"{transport.label}: share of the CPU budget (the medians' ratio; each repetition against its own "
                f"loop: {', '.join(f'{x:.2f}' for x in shares)})",
                total / budgets["cpu"],
                "x",
                key=f"{transport.key}_of_budget",
            ),
        ]
    details = {"numel": layout.numel, "rounds": rounds, "agents": AGENTS, "plain_cpu_s": plains, "cpu_s": cpu}
    benchlib.write_result(
        args.json,
        "transport_floor",
        figures,
        started,
        quick=args.quick,
        notes=conclusions(layout.numel, rounds, budgets, totals),
        details=details,
    )
    return 0


def _runs(values: list[float], scale: float, unit: str) -> str:
    """'median of N interleaved runs: a, b, c <unit>' (the values times `scale`), or '1 run'."""
    if len(values) == 1:
        return "1 run"
    return f"median of {len(values)} interleaved runs: " + ", ".join(f"{v * scale:.3g}" for v in values) + f" {unit}"


def conclusions(numel: int, rounds: int, budgets: dict[str, float], totals: dict[str, float]) -> list[str]:
    """What the figures say about #21's gRPC targets, in words computed from them."""

    def against(total: float, budget: str, what: str) -> str:
        left = budgets[budget] - total
        word = "over" if left < 0 else "under"
        return f"{abs(left) * 1e3:.1f} ms {word} {what} ({budgets[budget] * 1e3:.1f} ms)"

    mtls, socket_ = totals["grpc_mtls"], totals["socket_mtls"]
    best = min((t for t in TRANSPORTS if t.kind == "grpc" and t.tls and t.key in totals), key=lambda t: totals[t.key])
    cpu_budget, time_bound = "#21's CPU budget", "the round-time target's bound"
    return [
        f"One round: each of {AGENTS} agent processes fetches the model ({numel * 4 / 1e6:.2f} MB) and sends "
        f"{CLIENTS // AGENTS} updates of the same size (or one partial sum of {numel * 16 / 1e6:.2f} MB); {rounds} "
        "rounds after a warm-up; the server only receives (no protobuf, no checksum, no fold, no bookkeeping).",
        f"The round's bytes alone over gRPC with mutual TLS take {mtls * 1e3:.1f} ms of CPU before any FairFL code "
        f"runs: {against(mtls, 'cpu', cpu_budget)} and {against(mtls, 'time', time_bound)} (approximately: a round "
        "takes at least its CPU divided over the cores, and the ideal floor is the loop's work divided over them, "
        "which the loop's CPU approximates).",
        f"The cheapest gRPC shape with mutual TLS measured, {best.label} ({best.key}), takes "
        f"{totals[best.key] * 1e3:.1f} ms: {against(totals[best.key], 'cpu', cpu_budget)}, "
        f"{(mtls - totals[best.key]) * 1e3:.1f} ms less than one call per update with FairFL's settings.",
        f"A TLS socket beside gRPC would move the same bytes for {socket_ * 1e3:.1f} ms: "
        f"{against(socket_, 'cpu', 'the CPU budget')} and {against(socket_, 'time', 'the round-time bound')}, what "
        "would be left for everything else a round does (tasks, polls and heartbeats, the exact fold, the "
        "checkpoint, the ledger record, selection; section 1b measures them).",
    ]


if __name__ == "__main__":
    sys.exit(main())
