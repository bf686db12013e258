"""The in-process transport's worker pool (runtime.inprocess_workers) against its serial path (one worker).

Several workers must not change anything the engine sees: the final model bit for bit, the results in client-id
order, `on_result` called once per result (as each finishes; in client-id order with a quorum), the quorum's "lowest
k client ids" with no task started beyond what the serial loop would run, rejected results, a stop, and a failing
task. The pool's threads end with the run.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aggregator_service.engine import RoundEngine, initial_model, task_seed
from fairfl.compose import inprocess, worker_processes
from fairfl.compose.compare import runner
from fairfl.compose.compare.runner import RunningChildren
from fairfl.compose.compare.spec import ComparisonSpec, RunSpec
from fairfl.compose.inprocess import InProcessTransport, worker_count
from fairfl.compose.local_privacy import LocalPrivacy
from fairfl.compose.local_selection import LocalClusterer, LocalSelector
from fairfl.compose.worker_processes import WorkerProcess
from fairfl.config import ConfigError, ExperimentConfig, experiment_from_dict
from fairfl.data.datasets import DatasetNotFoundError, load_dataset
from fairfl.protocol import UPDATE, ClientResult
from fairfl.v1 import control_pb2, federation_pb2

NUM_CLIENTS = 8


@pytest.fixture(autouse=True)
def _forked_workers_can_train() -> None:
    """Worker processes are forked from this pytest process. On a machine with CUDA, once any test has run a backward
    pass here (this module's first one does), PyTorch's autograd fails in every child forked after it (pool_kind then
    refuses processes), so these tests need CUDA hidden there: `CUDA_VISIBLE_DEVICES= pytest <this file>`."""
    if not worker_processes.autograd_survives_fork():
        pytest.skip("a backward pass ran in this process with CUDA visible: forked workers cannot train here")


def _config(rounds: int = 3, **sections: Any) -> ExperimentConfig:
    cfg: dict[str, Any] = {
        "name": "pool",
        "seed": 11,
        "rounds": rounds,
        "data": {"dataset": "synthetic", "num_clients": NUM_CLIENTS, "partition": "shards", "shards_per_client": 2},
        "model": {"name": "mlp", "params": {"hidden": [16, 8]}},
        "training": {"local_steps": 4, "batch_size": 10, "lr": 0.05},
        "selection": {"clients_per_round": 6},
        "strategy": {"name": "fedavg"},
        "evaluation": {"every": 1},
    }
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    return experiment_from_dict(cfg)


def _pool_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("inprocess-")]


def _worker_processes() -> list[Any]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("fairfl-inprocess-worker")]


def _run(config: ExperimentConfig, workers: int, pool: Any = "threads") -> tuple[Any, list[control_pb2.RunEvent]]:
    events: list[control_pb2.RunEvent] = []
    transport = InProcessTransport(workers=workers, pool=pool)
    engine = RoundEngine(
        f"w{workers}",
        config,
        transport,
        LocalSelector(config.selection.method),
        LocalPrivacy(),
        events.append,
        clusterer=LocalClusterer(),
    )
    summary = engine.run()
    assert not _pool_threads(), "the pool's threads must end with the run"
    assert not _worker_processes(), "the pool's processes must end with the run"
    assert transport.runtimes == [] and transport.processes == []
    return summary, events


def _rounds(events: list[control_pb2.RunEvent]) -> list[control_pb2.RoundEvent]:
    rounds = [e.round for e in events if e.HasField("round")]
    for r in rounds:  # wall-clock fields differ between any two runs
        r.ClearField("duration_seconds")
        r.ClearField("selection_seconds")
    return rounds


def _fashion_mnist() -> None:
    try:
        load_dataset("fashion_mnist", "test")
    except DatasetNotFoundError as err:
        pytest.skip(f"Fashion-MNIST is not installed: {err}")


CASES: dict[str, Callable[[], ExperimentConfig]] = {
    "fedavg": lambda: _config(),
    # Two exchanges a round: a probe returning F_i and a gradient, then training aligned with the fair gradient.
    "fedeba_plus": lambda: _config(strategy={"name": "fedeba_plus", "params": {"alpha": 0.9, "tau": 0.1}}),
    # Over-selection: 6 tasked, the first 4 results (the 4 lowest client ids in-process) count.
    "fedavg_quorum": lambda: _config(runtime={"over_selection": 0.5}, selection={"clients_per_round": 4}),
    # Equitable-FL: FedProx steps, activation payloads and clustering (the grouped partition needs Fashion-MNIST).
    "equitable": lambda: (
        _fashion_mnist(),
        _config(
            data={
                "dataset": "fashion_mnist",
                "num_clients": 6,
                "partition": "label_groups",
                "group_sizes": [2, 4],
                "group_classes": [4, 6],
                "samples_per_class": 30,
                "test_per_client": 60,
            },
            training={"local_epochs": 1, "batch_size": 20, "lr": 0.05, "local_steps": None},
            strategy={"name": "equitable", "params": {"num_clusters": 2, "mu": 0.01}},
            selection={"clients_per_round": 4},
        ),
    )[1],
}


@pytest.mark.integration
@pytest.mark.parametrize("pool", ["threads", "processes"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_two_workers_train_the_same_model_as_one(case: str, pool: str) -> None:
    config = CASES[case]()
    serial, serial_events = _run(config, 1)
    pooled, pooled_events = _run(config, 2, pool)
    assert serial.state == pooled.state == control_pb2.RUN_STATE_COMPLETED, (serial.message, pooled.message)
    assert torch.equal(pooled.final_params, serial.final_params)
    assert not torch.equal(serial.final_params, initial_model(config)[1]), "training must have moved the model"
    assert _rounds(pooled_events) == _rounds(serial_events)  # selections, weights, metrics, evaluations, counts
    if case == "fedavg_quorum":
        for r in _rounds(pooled_events):
            assert len(r.selected) == 6 and r.results_accepted == 4 and len(r.aggregation_weights) == 4


# --- execute(): the engine's view of one phase ------------------------------------------------------------------------


Hook = Callable[["_Phase", int], None]
Alter = Callable[[ClientResult], None]


class _Phase:
    """A started transport, one TRAIN phase's tasks over every client, and a record of the tasks that ran: `before`
    is called as a task starts, `alter` may change its result."""

    def __init__(
        self, workers: int, monkeypatch: pytest.MonkeyPatch, before: Hook | None = None, alter: Alter | None = None
    ) -> None:
        self.config = _config()
        # Threads: the hooks below record into this process's lists (the orchestration is the same for both pools).
        self.transport, tasks = _started_phase(workers, "threads", self.config)
        self.tasks = tasks[::-1]  # the engine's order does not matter: ids decide
        self.started: list[int] = []
        self.finished: list[int] = []
        self.done = {cid: threading.Event() for cid in range(NUM_CLIENTS)}
        lock = threading.Lock()
        for runtime in self.transport.runtimes:

            def recording(task: federation_pb2.Task, run: Callable[..., ClientResult] = runtime.run) -> ClientResult:
                with lock:
                    self.started.append(task.client_id)
                if before is not None:
                    before(self, task.client_id)
                result = run(task)
                if alter is not None:
                    alter(result)
                with lock:
                    self.finished.append(task.client_id)
                self.done[task.client_id].set()
                return result

            monkeypatch.setattr(runtime, "run", recording)

    def execute(self, quorum: int | None = None, stop_after: int | None = None) -> tuple[Any, list[int]]:
        order: list[int] = []

        def on_result(result: ClientResult) -> None:
            order.append(result.client_id)
            if result.client_id == stop_after:
                self.transport.stop.set()

        return self.transport.execute(self.tasks, 60.0, quorum=quorum, on_result=on_result), order


@pytest.fixture
def phases(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., _Phase]]:
    made: list[_Phase] = []

    def make(workers: int, before: Hook | None = None, alter: Alter | None = None) -> _Phase:
        made.append(_Phase(workers, monkeypatch, before, alter))
        return made[-1]

    yield make
    for phase in made:
        phase.transport.end_run("phase")
    assert not _pool_threads()


def _updates(outcome: Any) -> list[tuple[int, bytes]]:
    return [(r.client_id, r.payloads[UPDATE].numpy().tobytes()) for r in outcome.results]


def test_the_pool_shares_one_copy_of_the_data(phases: Callable[..., _Phase]) -> None:
    a, b = phases(2).transport.runtimes
    assert a.model is not b.model
    for cid in range(NUM_CLIENTS):
        ca, cb = a.clients[cid], b.clients[cid]
        assert isinstance(ca.x_train, torch.Tensor) and isinstance(cb.x_train, torch.Tensor)
        assert ca.x_train.data_ptr() == cb.x_train.data_ptr() and ca.y_train.data_ptr() == cb.y_train.data_ptr()
        assert ca.x_test.data_ptr() == cb.x_test.data_ptr()


def test_a_phase_runs_free_each_result_folded_as_it_finishes_and_listed_in_id_order(
    phases: Callable[..., _Phase],
) -> None:
    def hold_the_lowest(phase: _Phase, cid: int) -> None:  # client 0 finishes only after client 1 has
        if cid == 0:
            assert phase.done[1].wait(30), "client 1 never ran alongside client 0"

    pooled = phases(2, hold_the_lowest)
    outcome, order = pooled.execute()
    want, want_order = phases(1).execute()
    assert pooled.finished.index(1) < pooled.finished.index(0)
    # As over gRPC: on_result sees each result once, as it finishes (client 1 before client 0), not in id order.
    assert order.index(1) < order.index(0) and sorted(order) == want_order == list(range(NUM_CLIENTS))
    assert [r.client_id for r in outcome.results] == list(range(NUM_CLIENTS))
    assert _updates(outcome) == _updates(want)
    assert outcome.missing == want.missing == [] and outcome.rejected == want.rejected == 0


def test_with_a_quorum_results_are_handled_in_client_id_order_whatever_finishes_first(
    phases: Callable[..., _Phase],
) -> None:
    def hold_the_lowest(phase: _Phase, cid: int) -> None:
        if cid == 0:
            assert phase.done[1].wait(30), "client 1 never ran alongside client 0"

    pooled = phases(2, hold_the_lowest)
    outcome, order = pooled.execute(quorum=NUM_CLIENTS)
    want, want_order = phases(1).execute(quorum=NUM_CLIENTS)
    assert pooled.finished.index(1) < pooled.finished.index(0)
    assert order == want_order == list(range(NUM_CLIENTS))
    assert _updates(outcome) == _updates(want)


def test_a_quorum_counts_the_lowest_ids_and_starts_no_more_than_the_serial_loop(
    phases: Callable[..., _Phase],
) -> None:
    def refuse_1(result: ClientResult) -> None:  # a missing payload: the quorum of 4 then needs client 4
        if result.client_id == 1:
            del result.payloads[UPDATE]

    got = []
    for workers in (1, 2):
        phase = phases(workers, alter=refuse_1)
        outcome, order = phase.execute(quorum=4)
        got.append((outcome, order, sorted(phase.started)))
    (serial, serial_order, serial_ran), (pooled, pooled_order, pooled_ran) = got
    assert serial_order == pooled_order == [0, 2, 3, 4]
    assert _updates(pooled) == _updates(serial)
    assert pooled.rejected == serial.rejected == 1
    assert pooled.missing == serial.missing == [7, 6, 5, 1]  # in the tasks' order
    assert pooled_ran == serial_ran == [0, 1, 2, 3, 4]


def test_a_stop_ends_the_phase_at_the_next_client(phases: Callable[..., _Phase]) -> None:
    got = []
    for workers in (1, 2):
        outcome, order = phases(workers).execute(quorum=NUM_CLIENTS, stop_after=2)
        got.append(([r.client_id for r in outcome.results], order))
    assert got[0] == got[1] == ([0, 1, 2], [0, 1, 2])


def test_no_task_starts_after_a_stop(phases: Callable[..., _Phase]) -> None:
    def after_2_wait_for_the_stop(phase: _Phase, cid: int) -> None:  # so nothing past client 3 can start before it
        if cid > 2:
            phase.transport.stop.wait(30)

    for workers in (1, 2):
        phase = phases(workers, after_2_wait_for_the_stop)
        outcome, order = phase.execute(stop_after=2)
        # Those running when the stop came may end (the engine drops the phase); none starts after it.
        assert set(order) <= set(phase.finished) and 2 in order
        assert len(phase.started) <= 3 + (workers - 1)
        assert {r.client_id for r in outcome.results} <= set(phase.finished)


def test_a_failing_task_raises_and_no_task_of_its_phase_runs_on(phases: Callable[..., _Phase]) -> None:
    def fail_3(phase: _Phase, cid: int) -> None:
        if cid == 3:
            raise RuntimeError("client 3 broke")

    for workers in (1, 2):
        phase = phases(workers, fail_3)
        order: list[int] = []
        with pytest.raises(RuntimeError, match="client 3 broke"):
            phase.transport.execute(phase.tasks, 60.0, on_result=lambda r, order=order: order.append(r.client_id))
        assert {0, 1, 2} <= set(order) and 3 not in order
        if workers == 1:
            assert order == [0, 1, 2]  # the serial loop stops at the failing client
        finished = list(phase.finished)
        # The phase's other tasks have ended (none runs on after `execute` raised) and the next phase works.
        outcome, _ = phase.execute(quorum=2)
        assert [r.client_id for r in outcome.results] == [0, 1]
        assert phase.finished[: len(finished)] == finished


@pytest.mark.parametrize("pool", ["threads", "processes"])
def test_a_failing_task_fails_the_run_as_before(monkeypatch: pytest.MonkeyPatch, pool: str) -> None:
    run = inprocess.ClientRuntime.run

    def fail_in_round_2(runtime: Any, task: federation_pb2.Task) -> ClientResult:
        if task.round == 2 and task.client_id == 5:
            raise ValueError("client 5 cannot train")
        return run(runtime, task)

    monkeypatch.setattr(inprocess.ClientRuntime, "run", fail_in_round_2)
    config = _config(selection={"clients_per_round": NUM_CLIENTS})
    (serial, serial_events), (pooled, pooled_events) = _run(config, 1), _run(config, 2, pool)
    assert serial.state == pooled.state == control_pb2.RUN_STATE_FAILED
    assert serial.message == pooled.message == "client 5 cannot train"  # a worker process's ValueError, raised again
    assert serial.rounds_completed == pooled.rounds_completed == 1
    assert torch.equal(serial.final_params, pooled.final_params)
    assert _rounds(serial_events) == _rounds(pooled_events)


@pytest.mark.parametrize("pool", ["threads", "processes"])
def test_a_stopped_run_leaves_no_threads(pool: str) -> None:
    config = _config(rounds=5)
    stop = threading.Event()
    events: list[control_pb2.RunEvent] = []

    def on_event(event: control_pb2.RunEvent) -> None:
        events.append(event)
        if event.HasField("round") and event.round.round == 2:
            stop.set()

    transport = InProcessTransport(workers=2, pool=pool)
    engine = RoundEngine("s", config, transport, LocalSelector("random"), LocalPrivacy(), on_event, stop)
    summary = engine.run()
    assert summary.state == control_pb2.RUN_STATE_STOPPED and summary.rounds_completed == 2
    assert not _pool_threads() and not _worker_processes() and transport.runtimes == transport.processes == []


# --- how many workers ----------------------------------------------------------------------------------------------


def test_worker_count(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(inprocess, "usable_cores", lambda: 8)
    assert worker_count("auto", 1, 100, cpu) == 8
    assert worker_count("auto", 2, 100, cpu) == 4  # the cores over each worker's torch threads
    assert worker_count("auto", 16, 100, cpu) == 1
    assert worker_count("auto", 1, 3, cpu) == 3  # never more workers than clients
    assert worker_count(5, 1, 100, cpu) == 5 and worker_count(5, 1, 2, cpu) == 2
    assert worker_count("auto", 1, 100, gpu) == worker_count(4, 1, 100, gpu) == 1  # one device: one worker


def test_inprocess_workers_is_validated_at_load() -> None:
    assert _config().runtime.inprocess_workers == "auto"
    assert _config(runtime={"inprocess_workers": 3}).runtime.inprocess_workers == 3
    for bad in (0, -1):
        with pytest.raises(ConfigError, match=r"runtime\.inprocess_workers: must be >= 1"):
            _config(runtime={"inprocess_workers": bad})
    for bad in ("many", 1.5):
        with pytest.raises(ConfigError, match=r"runtime\.inprocess_workers: expected an integer or 'auto', got "):
            _config(runtime={"inprocess_workers": bad})


@pytest.mark.parametrize(
    ("jobs", "workers", "flag"),
    [
        (1, "auto", None),
        (2, "auto", "runtime.inprocess_workers=2"),
        (2, 3, None),
        (8, "auto", "runtime.inprocess_workers=1"),
    ],
)
def test_compare_jobs_share_the_cores(
    jobs: int, workers: int | str, flag: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fairfl compare --jobs N` runs N in-process runs at once: each "auto" run gets the cores divided by N."""
    base = tmp_path / "base.yaml"
    base.write_text(_config(runtime={"inprocess_workers": workers}).to_yaml())
    spec = ComparisonSpec("c", base, {}, [0], [RunSpec("FedAvg", {}, [0])], jobs=jobs)
    commands: list[list[str]] = []

    def start(cmd: list[str], log: Any, env: Any) -> None:
        commands.append(cmd)  # and start nothing: the pair counts as cancelled

    children = RunningChildren()
    monkeypatch.setattr(children, "start", start)
    monkeypatch.setattr(runner, "usable_cores", lambda: 4)
    assert runner._run_one(spec, spec.runs[0], 0, tmp_path / "out", "inprocess", children, jobs) is None
    (cmd,) = commands
    sets = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--set"]
    checkpoints = tmp_path / "out" / "fedavg" / "seed0" / "checkpoint"  # every in-process pair checkpoints (resume)
    assert sets == [*([flag] if flag else []), f'runtime.checkpoint_dir="{checkpoints}"']


# --- worker processes -------------------------------------------------------------------------------------------------


def test_the_pool_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    kind = inprocess.pool_kind
    assert kind("auto", 2, cpu, 1) == kind("processes", 2, cpu, 1) == "processes"
    assert kind("auto", 1, cpu, 1) == kind("processes", 1, cpu, 1) == "threads"  # one worker: the calling thread
    assert kind("auto", 1, gpu, 1) == kind("threads", 4, cpu, 1) == "threads"
    # Several torch threads: a child forked after OpenMP ran threads can hang in its first parallel kernel.
    assert kind("auto", 2, cpu, 2) == "threads"
    with pytest.raises(ConfigError, match=r"runtime\.inprocess_pool: .*runtime\.threads_per_agent 2"):
        kind("processes", 2, cpu, 2)
    with pytest.raises(ConfigError, match=r"runtime\.inprocess_pool: .*device cuda"):
        kind("processes", 2, gpu, 1)
    # A CUDA machine after a backward pass in this process: a forked child's backward would raise.
    monkeypatch.setattr(inprocess, "autograd_survives_fork", lambda: False)
    assert kind("auto", 2, cpu, 1) == "threads"
    assert kind("auto", 1, cpu, 1) == "threads"
    with pytest.raises(ConfigError, match=r"runtime\.inprocess_pool: .*ran a backward pass with an accelerator"):
        kind("processes", 2, cpu, 1)
    monkeypatch.setattr(inprocess, "fork_available", lambda: False)  # macOS and Windows: no safe fork
    assert kind("auto", 4, cpu, 1) == "threads"
    with pytest.raises(ConfigError, match=r"runtime\.inprocess_pool: processes cannot be used here: the OS cannot"):
        kind("processes", 4, cpu, 1)


def test_a_forked_child_runs_autograd_after_a_backward_here_without_an_accelerator() -> None:
    """The probe itself, for real: this process has run a backward, and a child forked now runs one too (no
    accelerator: autograd started no device threads). tests/integration/test_gpu.py checks the CUDA case."""
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is visible: tests/integration/test_gpu.py checks this case")
    x = torch.ones(3, requires_grad=True)
    (x * x).sum().backward()
    assert worker_processes._forked_child_runs_autograd()
    assert worker_processes.autograd_survives_fork()


def test_inprocess_pool_is_validated_at_load() -> None:
    assert _config().runtime.inprocess_pool == "auto"
    assert _config(runtime={"inprocess_pool": "threads"}).runtime.inprocess_pool == "threads"
    with pytest.raises(ConfigError, match=r"runtime\.inprocess_pool"):
        _config(runtime={"inprocess_pool": "fibers"})


class _Unbuildable(Exception):
    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code {code}: {detail}")


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (KeyError("client 5"), "'client 5'"),  # rebuilt from its arguments: the same str() as the serial path's
        (_Unbuildable(7, "no"), "code 7: no"),  # cannot be rebuilt from its arguments: a RuntimeError, same message
    ],
)
def test_a_worker_process_exception_reaches_the_run(
    monkeypatch: pytest.MonkeyPatch, error: Exception, message: str
) -> None:
    run = inprocess.ClientRuntime.run

    def fail(runtime: Any, task: federation_pb2.Task) -> ClientResult:
        if task.client_id == 5:
            raise error
        return run(runtime, task)

    monkeypatch.setattr(inprocess.ClientRuntime, "run", fail)  # before the fork: the workers inherit it
    config = _config(selection={"clients_per_round": NUM_CLIENTS})
    (serial, _), (pooled, _) = _run(config, 1), _run(config, 2, "processes")
    assert serial.state == pooled.state == control_pb2.RUN_STATE_FAILED
    assert serial.message == pooled.message == message


def test_a_worker_process_that_dies_fails_the_run_with_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    run = inprocess.ClientRuntime.run

    def die_in_round_2(runtime: Any, task: federation_pb2.Task) -> ClientResult:
        if task.round == 2 and task.client_id == 3:
            os._exit(9)  # as the OOM killer or a segfault would end it: no reply, the pipe closes
        return run(runtime, task)

    monkeypatch.setattr(inprocess.ClientRuntime, "run", die_in_round_2)
    summary, _ = _run(_config(selection={"clients_per_round": NUM_CLIENTS}), 2, "processes")
    assert summary.state == control_pb2.RUN_STATE_FAILED and summary.rounds_completed == 1
    assert re.fullmatch(
        r"in-process worker \d \(pid \d+\) ended while running client 3's task \(exit code 9\); anything it printed "
        r"went to this run's stderr\. runtime\.inprocess_pool: threads runs the clients in this process instead",
        summary.message,
    ), summary.message


def test_worker_processes_end_when_the_run_process_is_killed(tmp_path: Path) -> None:
    """A run killed outright (no stop, no cleanup) leaves no worker behind: each sees its pipe close and exits."""
    config = tmp_path / "run.yaml"
    config.write_text(_config(rounds=100000, runtime={"inprocess_workers": 2}).to_yaml())
    cmd = [sys.executable, "-m", "fairfl.compose", "run", str(config), "--transport", "inprocess"]
    run = subprocess.Popen([*cmd, "--output", str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        children: list[int] = []
        deadline = time.monotonic() + 60
        while len(children) < 2 and time.monotonic() < deadline and run.poll() is None:
            time.sleep(0.2)
            children = [int(c) for c in Path(f"/proc/{run.pid}/task/{run.pid}/children").read_text().split()]
        assert len(children) == 2, run.stdout.read().decode() if run.poll() is not None else "no workers started"
    finally:
        run.kill()
        run.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and _state(pid) != "Z" for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_a_model_bigger_than_a_stream_chunk_trains_the_same_in_worker_processes() -> None:
    """Each payload crosses the pipe whole: an update beyond gRPC's 2 MiB chunk (here 4.3 MB) is not refused."""
    config = _config(rounds=2, model={"name": "mlp", "params": {"hidden": [1024, 1024]}})
    (serial, _), (pooled, pooled_events) = _run(config, 1), _run(config, 2, "processes")
    assert serial.state == pooled.state == control_pb2.RUN_STATE_COMPLETED, (serial.message, pooled.message)
    assert all(r.results_accepted == r.selected.__len__() for r in _rounds(pooled_events))
    assert torch.equal(serial.final_params, pooled.final_params)


def _process_phase(workers: int) -> tuple[InProcessTransport, list[Any]]:
    return _started_phase(workers, "processes", _config())


def _started_phase(workers: int, pool: Any, config: ExperimentConfig) -> tuple[InProcessTransport, list[Any]]:
    """A started transport and one TRAIN phase's tasks over every client, in client-id order."""
    layout, params = initial_model(config)
    transport = InProcessTransport(workers=workers, pool=pool)
    transport.start_run("phase", config, layout)
    transport.wait_for_clients(NUM_CLIENTS, 1.0, threading.Event())
    model = transport.publish(params)
    train = federation_pb2.LocalTrainingConfig(local_steps=3, batch_size=10, lr=0.05, skip_losses=True)
    tasks = [
        federation_pb2.Task(
            task_id=f"t{cid}",
            run_id="phase",
            round=1,
            phase=federation_pb2.PHASE_TRAIN,
            client_id=cid,
            model=model,
            seed=task_seed(config.seed, 1, cid),
            train=train,
        )
        for cid in range(NUM_CLIENTS)
    ]
    return transport, tasks


def test_tasks_go_to_the_least_loaded_worker_process(monkeypatch: pytest.MonkeyPatch) -> None:
    transport, tasks = _process_phase(2)
    ran_on: list[int] = []
    run = WorkerProcess.run
    # The first two tasks wait until both are dispatched: a task that finished before the other was dispatched would
    # leave its process idle again, and then either process is a right choice.
    both_dispatched = threading.Barrier(2, timeout=30.0)
    first_phase = True

    def recording(self: WorkerProcess, task: federation_pb2.Task) -> ClientResult:
        ran_on.append(self.index)
        if first_phase:
            both_dispatched.wait()
        return run(self, task)

    monkeypatch.setattr(WorkerProcess, "run", recording)  # the parent's side: which process each task went to
    try:
        outcome = transport.execute(tasks[:2], 60.0)  # two tasks, two processes: one each, never both on one
        assert sorted(ran_on) == [0, 1] and [r.client_id for r in outcome.results] == [0, 1]
        first_phase = False
        ran_on.clear()
        outcome = transport.execute(tasks, 60.0)
        assert sorted(set(ran_on)) == [0, 1] and len(outcome.results) == NUM_CLIENTS
    finally:
        transport.end_run("phase")
    assert not _worker_processes()


def test_a_stop_reaches_the_tasks_waiting_in_worker_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Client 0 holds its worker until the stop; the task queued behind it in that worker must not start."""
    run = inprocess.ClientRuntime.run

    def slow_0(runtime: Any, task: federation_pb2.Task) -> ClientResult:
        if task.client_id == 0:
            time.sleep(1.0)
        return run(runtime, task)

    monkeypatch.setattr(inprocess.ClientRuntime, "run", slow_0)  # before the fork
    transport, tasks = _process_phase(1 + 1)
    stop = threading.Event()
    transport.stop = stop
    threading.Timer(0.3, stop.set).start()
    try:
        outcome = transport.execute(tasks, 60.0, on_result=lambda r: None)
    finally:
        transport.end_run("phase")
    answered = [r.client_id for r in outcome.results]
    # Worker 1 may finish a few short tasks before the stop; worker 0's queued task and everything after are skipped.
    assert 0 in answered and len(answered) < NUM_CLIENTS, answered


def test_worker_processes_hold_what_the_blob_store_holds() -> None:
    """Each worker mirrors the parent's BlobStore (bounded as it is): a blob published again after being evicted is
    sent again, and tasks train from whichever blob they name."""
    transport, tasks = _process_phase(2)
    try:
        _, first = initial_model(_config())
        refs = [transport.publish(first + i) for i in range(12)]  # the store keeps the newest 8
        again = transport.publish(first)  # evicted long ago: published again, it must reach the workers again
        assert again.sha256 == refs[0].sha256
        for ref in (again, refs[-1]):
            for task in tasks:
                task.model.CopyFrom(ref)
            outcome = transport.execute(tasks, 60.0)
            assert len(outcome.results) == NUM_CLIENTS and outcome.rejected == 0
        for process in transport.processes:
            assert process.known == {sha256 for sha256, _ in transport.blobs.newest()}
    finally:
        transport.end_run("phase")
