"""In-process transport: the same engine, strategies and client code without a network (oracle and fast path).

A round's clients train on a pool of workers (runtime.inprocess_workers), each with its own ClientRuntime: its own
model, optimiser state and device cache, over one copy of the run's data. The workers are forked processes
(runtime.inprocess_pool: processes, what `auto` picks on a CPU with more than one worker where fork exists:
fairfl.compose.worker_processes), which share the data copy-on-write and never wait for each other's GIL, or threads
in this process (`threads`), which share the data outright but hand the GIL back and forth around every torch call.
Either way one thread here drives each worker. A phase without a quorum runs free, as over gRPC: every task is queued
at once and each worker's accepted result goes to `on_result` (the engine's streaming fold, order-independent and
thread-safe) as soon as it is done, so no worker waits for a slower one; the phase's results are listed in client-id
order, and a task's exception is raised once the phase's tasks have ended (the lowest failing client id's). With a
quorum, results are handled in client-id order on the calling thread, so the quorum counts the lowest client ids'
results, as the serial loop does. A stop ends the phase: no task starts after it. Each task reads only its own seeded
generators, so the final model is bit-identical for any worker count and either pool (and to the gRPC path).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, Literal

import torch

from aggregator_service.blobs import BlobStore
from aggregator_service.engine import ClientTransport, PhaseOutcome, ResultSink
from client_agent.trainer import ClientRuntime, LocalData, resolve_device
from fairfl.codec import CodecError
from fairfl.compose.worker_processes import (
    WorkerProcess,
    WorkerRefused,
    WorkerSkipped,
    autograd_survives_fork,
    fork_available,
)
from fairfl.config import ConfigError, ExperimentConfig
from fairfl.cores import usable_cores
from fairfl.data import load_run_data
from fairfl.params import ParamLayout
from fairfl.protocol import ClientResult, as_received, check_against_task, check_result
from fairfl.v1 import federation_pb2, tensor_pb2

Workers = int | Literal["auto"]
Pool = Literal["auto", "threads", "processes"]
TASKS_PER_PROCESS = 2  # tasks a worker process may hold at once: one running, one waiting (see start_run)
STOP_POLL_S = 0.02  # how soon a stop reaches the tasks waiting in worker processes

# A task's outcome as a worker hands it back: the result (None when the wire refused it), and whether it was accepted;
# None for a task a worker process skipped because its phase had ended.
_Done = tuple[ClientResult | None, bool]


def pool_kind(requested: Pool, workers: int, device: torch.device, threads: int) -> Literal["threads", "processes"]:
    """`requested`, or for "auto" processes where they help and are safe: more than one worker, on the CPU, one torch
    thread each (a process forked after OpenMP ran on several threads can hang in its first parallel kernel), on
    Linux (fork), and no autograd threads in this process that a forked child's backward would trip on (a CUDA
    machine after a backward here: autograd_survives_fork). One worker runs tasks on the calling thread either way."""
    if requested == "processes":
        problem = _processes_problem(device, threads)
        if problem:
            raise ConfigError(f"runtime.inprocess_pool: processes cannot be used here: {problem}; use threads or auto")
    if workers <= 1:
        return "threads"
    if requested != "auto":
        return requested
    return "threads" if _processes_problem(device, threads) else "processes"


def _processes_problem(device: torch.device, threads: int) -> str:
    """Why worker processes cannot train this run here, or "" when they can (the fork probe last: it costs a fork)."""
    if not fork_available():
        return "the OS cannot fork safely (Linux only)"
    if device.type != "cpu":
        return f"device {device.type} (worker processes train on the CPU)"
    if threads != 1:
        return f"runtime.threads_per_agent {threads} (worker processes train on one torch thread each)"
    if not autograd_survives_fork():
        return (
            "this process ran a backward pass with an accelerator visible, and PyTorch's autograd fails in processes "
            "forked after that (start the run from a fresh process to use them)"
        )
    return ""


def worker_count(requested: Workers, threads: int, num_clients: int, device: torch.device) -> int:
    """The pool size: `requested`, or for "auto" the usable cores over `threads` torch threads per worker; never more
    than the clients (a worker would idle) and one on an accelerator (one device, one stream of work)."""
    if device.type != "cpu":
        return 1
    wanted = max(1, usable_cores() // threads) if requested == "auto" else requested
    return max(1, min(wanted, num_clients))


class InProcessTransport(ClientTransport):
    def __init__(
        self, device: str = "cpu", threads: int = 1, workers: Workers | None = None, pool: Pool | None = None
    ) -> None:
        """`workers`: the pool size (see worker_count), `pool`: threads or processes (see pool_kind); None: the run
        config's runtime.inprocess_workers and runtime.inprocess_pool."""
        # Small models train fastest on one thread; several threads per process oversubscribe a few cores.
        # Process-wide: every worker's kernels use `threads` torch threads.
        torch.set_num_threads(threads)
        self.device = device
        self.threads = threads
        self.workers = workers
        self.pool = pool
        self.blobs = BlobStore()
        # One per worker thread; runtimes[0] also answers clients and layout (with worker processes it is the only one
        # here, and trains nothing).
        self.runtimes: list[ClientRuntime] = []
        self.processes: list[WorkerProcess] = []
        self.worker_slots = 0  # tasks that can run or wait in the workers at once
        self.started_workers = 0
        self._dispatch = threading.Lock()  # guards the processes' outstanding counts
        self._halt: Any = None  # multiprocessing Event: set, worker processes skip the tasks waiting in them
        self._idle: queue.SimpleQueue[ClientRuntime] = queue.SimpleQueue()  # worker threads' runtimes no task is using
        self._pool: ThreadPoolExecutor | None = None  # None: one worker, tasks run on the calling thread
        self.layout: ParamLayout | None = None
        self.stop = threading.Event()  # the run's stop event (from wait_for_clients): a phase ends at the next client

    @property
    def runtime(self) -> ClientRuntime | None:
        return self.runtimes[0] if self.runtimes else None

    def start_run(self, run_id: str, config: ExperimentConfig, layout: ParamLayout) -> None:
        self._shutdown()  # a transport reused for another run starts from a fresh pool
        federated = load_run_data(config)
        device = resolve_device(self.device)
        self.layout = layout
        wire_layout = layout.with_payload_dtype(config.transport.update_dtype)
        self.payload_dtype = wire_layout.payload_dtype
        clients = list(range(federated.num_clients))
        requested = config.runtime.inprocess_workers if self.workers is None else self.workers
        count = worker_count(requested, self.threads, len(clients), device)
        kind = pool_kind(config.runtime.inprocess_pool if self.pool is None else self.pool, count, device, self.threads)
        # Built once and shared: on the CPU every runtime's tensors are views of these arrays (no copy per worker; a
        # worker process shares them copy-on-write).
        data = LocalData.of_simulation(federated, clients)

        def make_runtime(resolve: Callable[[tensor_pb2.BlobRef], torch.Tensor]) -> ClientRuntime:
            return ClientRuntime(config, data, clients, device, resolve)

        self.runtimes = [make_runtime(self._resolve)]
        if self.runtimes[0].layout != layout:
            raise RuntimeError("client model layout differs from the server's")
        if kind == "processes":
            self._halt = multiprocessing.get_context("fork").Event()
            for index in range(count):
                others = [p.conn for p in self.processes]
                self.processes.append(WorkerProcess(index, make_runtime, wire_layout, self.blobs, self._halt, others))
            # Two pool threads per process: a second task waits in a worker while the first one's result is folded
            # here, so the worker never idles for it (tasks go to the least-loaded process: _run_on_process).
            self.worker_slots = TASKS_PER_PROCESS * count
            self.started_workers = count
        else:
            self.runtimes += [make_runtime(self._resolve) for _ in range(count - 1)]
            for runtime in self.runtimes:
                self._idle.put(runtime)
            self.worker_slots = self.started_workers = count
        if count > 1:
            self._pool = ThreadPoolExecutor(max_workers=self.worker_slots, thread_name_prefix=f"inprocess-{run_id}")

    def _resolve(self, ref: tensor_pb2.BlobRef) -> torch.Tensor:
        entry = self.blobs.get(ref.sha256)  # BlobStore is locked: workers resolve concurrently
        if entry is None:
            raise KeyError(f"blob {ref.sha256} not found")
        return entry[1]

    def wait_for_clients(self, num_clients: int, timeout: float, stop: threading.Event) -> None:
        assert self.runtime is not None
        self.stop = stop
        if len(self.runtime.clients) < num_clients:
            raise RuntimeError(f"{len(self.runtime.clients)} clients hosted, {num_clients} needed")

    def available_clients(self) -> list[int]:
        return sorted(self.runtime.clients) if self.runtime else []

    def publish(self, flat: torch.Tensor) -> tensor_pb2.BlobRef:
        assert self.layout is not None
        return self.blobs.put(self.layout, flat)

    def _run(self, task: federation_pb2.Task) -> _Done | None:
        """One task on a worker, with the wire's checks; None when a worker process skipped it (its phase ended)."""
        if self.processes:
            try:
                result = self._run_on_process(task)  # decoded from the wire's bytes and checked already
            except WorkerRefused:
                return None, False
            except WorkerSkipped:
                return None
        else:
            runtime = self._idle.get()  # one per pool thread, so one is always free
            try:
                result = runtime.run(task)
            finally:
                self._idle.put(runtime)
        try:
            if not self.processes:
                as_received(result, self.payload_dtype)  # transport.update_dtype: what the wire would deliver
                check_result(result)
            check_against_task(result, task)
        except CodecError:
            return result, False
        return result, True

    def _run_on_process(self, task: federation_pb2.Task) -> ClientResult:
        """On the least-loaded worker process: with two pool threads per process, a process gets a second task only
        once every process has one."""
        with self._dispatch:
            process = min(self.processes, key=lambda p: (p.outstanding, p.index))
            process.outstanding += 1
        try:
            return process.run(task)
        finally:
            with self._dispatch:
                process.outstanding -= 1

    def _submit(self, task: federation_pb2.Task) -> Future[_Done | None]:
        if self._pool is not None:
            return self._pool.submit(self._run, task)
        done: Future[_Done | None] = Future()  # one worker: run it here, now (the serial path, on the calling thread)
        try:
            done.set_result(self._run(task))
        except Exception as err:
            done.set_exception(err)
        return done

    def execute(
        self,
        tasks: list[federation_pb2.Task],
        timeout: float,
        quorum: int | None = None,
        on_result: ResultSink | None = None,
    ) -> PhaseOutcome:
        assert self.runtime is not None
        with self._stop_mirrored():
            if self._pool is not None and quorum is None:
                return self._execute_free(tasks, on_result)
            return self._execute_in_order(tasks, quorum, on_result)

    @contextlib.contextmanager
    def _stop_mirrored(self) -> Iterator[None]:
        """With worker processes, a phase's stop also reaches the tasks waiting inside them (they skip): a watcher
        copies the run's stop into the processes' `halt` within STOP_POLL_S."""
        if self._halt is None:
            yield
            return
        self._halt.clear()
        ended = threading.Event()

        def mirror() -> None:
            while not ended.wait(STOP_POLL_S):
                if self.stop.is_set():
                    self._halt.set()
                    return

        watcher = threading.Thread(target=mirror, name="inprocess-stop-mirror", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            ended.set()
            watcher.join()

    def _end_phase(self, started: Iterable[Future[Any]]) -> None:
        """The phase is over (done, stopped or failed): tasks still waiting in worker processes are skipped, those
        queued here cancelled, and the running ones waited for."""
        if self._halt is not None:
            self._halt.set()
        _abandon(started)

    def _execute_free(self, tasks: list[federation_pb2.Task], on_result: ResultSink | None) -> PhaseOutcome:
        """Every task queued at once; each worker hands its accepted result to `on_result` itself."""

        def run(task: federation_pb2.Task) -> _Done | None:
            if self.stop.is_set():  # the engine abandons the phase (RunStopped) once it returns
                return None
            done = self._run(task)
            if done is not None and done[1] and on_result is not None:
                on_result(done[0])
            return done

        assert self._pool is not None
        started = [self._pool.submit(run, task) for task in sorted(tasks, key=lambda t: t.client_id)]
        wait(started, return_when=FIRST_EXCEPTION)
        self._end_phase(started)  # after a failure: the queued tasks are cancelled or skipped, the running ones end
        done = [future.result() for future in started if not future.cancelled()]  # raises the lowest id's exception
        results = [result for result, accepted in filter(None, done) if accepted and result is not None]
        rejected = sum(not accepted for _, accepted in filter(None, done))
        answered = {r.client_id for r in results}
        return PhaseOutcome(results, [t.client_id for t in tasks if t.client_id not in answered], rejected=rejected)

    def _execute_in_order(
        self, tasks: list[federation_pb2.Task], quorum: int | None, on_result: ResultSink | None
    ) -> PhaseOutcome:
        """Results handled in client-id order on this thread: the serial loop, and any phase with a quorum."""
        pending = deque(sorted(tasks, key=lambda t: t.client_id))
        # Started tasks in client-id order. Up to two per worker: a worker never idles while the lowest one (whose
        # result must be handled first) is still running, and at most that many finished results wait for it. One
        # worker: one at a time, each handled before the next starts (exactly the serial loop).
        started: deque[Future[_Done | None]] = deque()
        window = 1 if self._pool is None else self.worker_slots + self.started_workers
        results: list[ClientResult] = []
        rejected = 0
        try:
            while True:
                # Start no more than could still count: with a quorum, only the lowest client ids' accepted results do
                # (in-process, "first k" are the lowest client ids), so never more than the quorum still open.
                room = window if quorum is None else min(window, quorum - len(results))
                while pending and len(started) < room and not self.stop.is_set():
                    started.append(self._submit(pending.popleft()))
                if not started or self.stop.is_set():  # the engine abandons the phase (RunStopped) once it returns
                    break
                done = started.popleft().result()  # a task's exception is raised here, in order
                if done is None:  # skipped by a worker process: the phase is ending
                    continue
                result, accepted = done
                if not accepted or result is None:
                    rejected += 1
                    continue
                if on_result is not None:
                    on_result(result)
                results.append(result)
        finally:
            self._end_phase(started)
        answered = {r.client_id for r in results}
        return PhaseOutcome(results, [t.client_id for t in tasks if t.client_id not in answered], rejected=rejected)

    def end_run(self, run_id: str) -> None:
        self._shutdown()
        self.blobs.clear()

    def _shutdown(self) -> None:
        """Stop the pool (its threads end once their task does), end the worker processes, drop the runtimes."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        for process in self.processes:
            process.close()
        self.processes = []
        self._halt = None
        self.runtimes = []
        self._idle = queue.SimpleQueue()


def _abandon(started: Iterable[Future[Any]]) -> None:
    """Tasks of a phase that ended early (stop, an exception): cancel those not yet running and wait for the rest,
    so no task of this phase runs once `execute` returns or raises; their results (and exceptions) are dropped."""
    for future in started:
        future.cancel()
    wait(started)
