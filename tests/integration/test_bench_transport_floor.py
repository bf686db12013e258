"""scripts/bench_transport_floor.py's measurement: each bare transport moves a round's bytes between real processes
(a server and two agents, every upload's byte count confirmed by the server) and reports their CPU; an agent that gets
other bytes than expected fails the measurement instead of hanging it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench_transport_floor import TRANSPORTS, Transport, make_certificates, measure, round_shape


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


@pytest.mark.parametrize("transport", TRANSPORTS, ids=lambda t: t.key)
def test_an_agent_getting_other_bytes_than_expected_fails_the_measurement_without_hanging(
    transport: Transport, certificates: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import bench_transport_floor

    original = bench_transport_floor._child

    def lying_child(role: str, transport: Transport, certs: Path, extra: list[str], **popen: Any) -> Any:
        if role == "agent":  # the agent expects one byte more than the server sends
            at = extra.index("--model-bytes") + 1
            extra = [*extra[:at], str(int(extra[at]) + 1), *extra[at + 1 :]]
        return original(role, transport, certs, extra, **popen)

    monkeypatch.setattr(bench_transport_floor, "_child", lying_child)
    with pytest.raises(SystemExit, match="warm-up"):
        measure(transport, certificates, numel=1_000, rounds=2, work=tmp_path)


def test_a_round_is_each_clients_float32_update_or_one_double_double_partial_sum_an_agent() -> None:
    by_key = {t.key: round_shape(t, numel=1_000) for t in TRANSPORTS}
    assert by_key["grpc_mtls"] == by_key["grpc_plain"] == by_key["socket_mtls"] == (5, 4_000)  # 10 clients, 2 agents
    assert by_key["grpc_mtls_partial"] == by_key["grpc_mtls_partial_tuned"] == (1, 16_000)  # hi and lo, float64 each
    assert by_key["grpc_mtls_tuned"] == (5, 4_000)


def test_the_conclusions_say_how_far_over_or_under_each_budget_the_transports_are() -> None:
    from bench_transport_floor import conclusions

    totals = {"grpc_mtls": 0.023, "grpc_plain": 0.010, "grpc_mtls_partial_tuned": 0.0175, "socket_mtls": 0.014}
    notes = conclusions(numel=1000, rounds=10, budgets={"cpu": 0.016, "time": 0.022}, totals=totals)
    assert "7.0 ms over #21's CPU budget (16.0 ms)" in notes[1]
    assert "1.0 ms over the round-time target's bound (22.0 ms)" in notes[1]
    # the cheapest with mutual TLS, not plaintext's
    assert "(grpc_mtls_partial_tuned), takes 17.5 ms: 1.5 ms over #21's CPU budget (16.0 ms), 5.5 ms less" in notes[2]
    assert "2.0 ms under the CPU budget (16.0 ms)" in notes[3]
    assert "8.0 ms under the round-time bound (22.0 ms)" in notes[3]
