"""scripts/bench_transport_floor.py's measurement: each bare transport moves a round's bytes between real processes
(a server and two agents) and reports their CPU; an agent that gets the wrong bytes fails the measurement."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_transport_floor import TRANSPORTS, Transport, crypto_floor, make_certificates, measure


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("floor-certs")
    make_certificates(directory)
    return directory


@pytest.mark.parametrize("transport", TRANSPORTS, ids=lambda t: t.key)
def test_each_transport_moves_the_rounds_and_reports_every_process_cpu(
    transport: Transport, certificates: Path, tmp_path: Path
) -> None:
    cpu = measure(transport, certificates, numel=50_000, rounds=3, work=tmp_path)
    assert set(cpu) == {"server", "agents"}
    assert cpu["agents"] > 0.0  # two agents' own clocks over three rounds of 200 KB messages
    assert cpu["server"] >= 0.0  # /proc's clock ticks are 10 ms: a light server may read 0


def test_a_server_sending_the_wrong_model_size_fails_the_measurement(
    certificates: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bench_transport_floor

    original = bench_transport_floor._child

    def lying_child(role: str, transport: Transport, certs: Path, extra: list[str], **popen: object):  # type: ignore[no-untyped-def]
        if role == "agent":  # the agent expects one byte more than the server sends
            at = extra.index("--model-bytes") + 1
            extra = [*extra[:at], str(int(extra[at]) + 1), *extra[at + 1 :]]
        return original(role, transport, certs, extra, **popen)

    monkeypatch.setattr(bench_transport_floor, "_child", lying_child)
    grpc_mtls = next(t for t in TRANSPORTS if t.key == "grpc_mtls")
    with pytest.raises(SystemExit, match="warm-up"):
        measure(grpc_mtls, certificates, numel=1_000, rounds=2, work=tmp_path)


def test_the_cipher_floor_grows_with_the_bytes() -> None:
    small, large = crypto_floor(64 * 1024, repeats=3), crypto_floor(64 * 1024 * 1024, repeats=1)
    assert large > small >= 0.0


def test_the_conclusions_say_how_far_over_or_under_each_budget_the_transports_are() -> None:
    from bench_transport_floor import conclusions

    notes = conclusions(
        numel=1000, rounds=10, budgets={"cpu": 0.016, "time": 0.022}, totals={"grpc_mtls": 0.023, "socket_mtls": 0.014}
    )
    assert "7.0 ms over #21's CPU budget (16.0 ms)" in notes[1]
    assert "1.0 ms over the round-time target's bound (22.0 ms)" in notes[1]
    assert "2.0 ms under the CPU budget (16.0 ms)" in notes[2]
    assert "8.0 ms under the round-time bound (22.0 ms)" in notes[2]
