"""Worker processes for the in-process transport: client tasks trained beside each other without sharing a GIL.

Worker threads in one process (the `threads` pool) hand the GIL back and forth around every torch call of every step,
which on a small model costs a quarter of the cores' time; a forked worker process trains with nothing to wait for.
Each worker is forked once per run from the transport's process, so it shares the run's data copy-on-write (no
reload) and sees every model, strategy or procedure the parent registered, and hosts one ClientRuntime on its own
torch thread(s). The parent keeps one thread per worker (the pool's orchestration is the transport's, unchanged):

- parent → worker over a pipe: each blob (global model, fair gradient) once per worker as raw float32 bytes, then each
  task as its serialised Task;
- worker → parent: the result as the wire encodes it (ResultHeader, then each payload's raw bytes in the run's
  transport.update_dtype), decoded by the aggregator's own ResultAssembler, so the parent folds exactly what an
  aggregator would have received from an agent (bit for bit, the same checks); or an error (its type, arguments and
  traceback) that the parent raises again as the same exception type where it can be imported.

No pickle crosses the pipe. A worker ignores Ctrl-C (the parent's run stops it) and exits when its pipe closes, so it
never outlives the run's process, even one that was killed.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import signal
import threading
import traceback
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from aggregator_service.blobs import BlobStore
from client_agent.trainer import BlobResolver, ClientRuntime
from fairfl.codec import CodecError
from fairfl.params import ParamLayout
from fairfl.protocol import ClientResult, ResultAssembler, result_header_and_payload
from fairfl.v1 import federation_pb2, tensor_pb2

# Message kinds, the first byte of each message that starts an exchange.
_BLOB, _TASK = b"B", b"T"  # parent → worker
_RESULT, _REFUSED, _ERROR = b"R", b"J", b"E"  # worker → parent

KEPT_BLOBS = 8  # a worker keeps the newest blobs it was sent, as the parent's BlobStore keeps its newest


def fork_available() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


class WorkerRefused(Exception):
    """A result the wire would not carry (a float16 overflow when encoding, or a malformed one when decoding): the
    transport counts it as rejected, as an aggregator would."""


class WorkerProcess:
    """One forked worker. `run` may be called by several threads at once: the tasks queue in the worker in the order
    they were sent and their results come back in that order, each to its caller, so the transport can keep a
    second task waiting in the worker while it folds the first one's result (the worker never idles for it)."""

    def __init__(
        self,
        index: int,
        make_runtime: Callable[[BlobResolver], ClientRuntime],
        wire_layout: ParamLayout,
        blobs: BlobStore,
        threads: int,
        others: list[Connection],
    ) -> None:
        """`others`: the parent's ends of the workers forked before this one, which this one must not keep open."""
        self.index = index
        self.layout = wire_layout
        self.blobs = blobs
        self.known: set[str] = set()  # blobs this worker has been sent
        self._sending = threading.Lock()
        self._turns = threading.Condition()  # replies are read in the order the tasks were sent
        self._sent = self._read = 0
        context = multiprocessing.get_context("fork")
        self.conn, child_end = context.Pipe(duplex=True)
        self.process = context.Process(
            target=_serve,
            args=(child_end, [*others, self.conn], make_runtime, wire_layout, threads),
            name=f"fairfl-inprocess-worker-{index}",
            daemon=True,
        )
        self.process.start()
        child_end.close()

    def run(self, task: federation_pb2.Task) -> ClientResult:
        """The task's result as received over the wire; raises WorkerRefused, or the task's own exception."""
        try:
            with self._sending:
                self._send_new_blobs()
                self.conn.send_bytes(_TASK + task.SerializeToString())
                turn, self._sent = self._sent, self._sent + 1
            with self._turns:
                self._turns.wait_for(lambda: self._read == turn)
                try:
                    kind, body, parts = self._reply()
                finally:
                    self._read += 1
                    self._turns.notify_all()
            if kind == _RESULT:
                return _decode(federation_pb2.ResultHeader.FromString(body), parts, self.layout)
        except (EOFError, OSError) as err:
            self.process.join(2.0)  # reaped, for its exit code (negative: the signal that ended it)
            raise RuntimeError(
                f"in-process worker {self.index} (pid {self.process.pid}) ended while running client "
                f"{task.client_id}'s task (exit code {self.process.exitcode}); anything it printed went to this "
                "run's stderr"
            ) from err
        if kind == _REFUSED:
            raise WorkerRefused(body.decode())
        raise _remote_exception(json.loads(body))

    def _reply(self) -> tuple[bytes, bytes, list[bytes]]:
        """The next reply's kind, body and, for a result, its payloads (all read here: the pipe stays in step)."""
        reply = self.conn.recv_bytes()
        kind, body = reply[:1], reply[1:]
        if kind != _RESULT:
            return kind, body, []
        count = len(federation_pb2.ResultHeader.FromString(body).payloads)
        return kind, body, [self.conn.recv_bytes() for _ in range(count)]

    def _send_new_blobs(self) -> None:
        for sha256, flat in self.blobs.newest(KEPT_BLOBS):
            if sha256 in self.known:
                continue
            header = json.dumps({"sha256": sha256, "numel": flat.numel()}).encode()
            self.conn.send_bytes(_BLOB + header)
            self.conn.send_bytes(memoryview(flat.numpy()).cast("B"))
            self.known.add(sha256)
        if len(self.known) > 4 * KEPT_BLOBS:  # forget what the worker has dropped too (it re-sends if asked again)
            self.known = {sha256 for sha256, _ in self.blobs.newest(KEPT_BLOBS)} & self.known

    def close(self, timeout: float = 10.0) -> None:
        """Closing the pipe ends the worker (it is between tasks: the transport waits for running ones first)."""
        self.conn.close()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _decode(header: federation_pb2.ResultHeader, parts: list[bytes], layout: ParamLayout) -> ClientResult:
    try:
        assembler = ResultAssembler(header, layout, sha256_optional=True)
        for part in parts:
            assembler.add(part)
        return assembler.finish()
    except CodecError as err:
        raise WorkerRefused(str(err)) from err


# -- the worker's side -------------------------------------------------------------------------------------------------


def _serve(
    conn: Connection,
    inherited: list[Connection],
    make_runtime: Callable[[BlobResolver], ClientRuntime],
    layout: ParamLayout,
    threads: int,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    for other in inherited:  # else a pipe would stay open after its owner ended and its worker would never see EOF
        other.close()
    torch.set_num_threads(threads)
    blobs: OrderedDict[str, torch.Tensor] = OrderedDict()

    def resolve(ref: tensor_pb2.BlobRef) -> torch.Tensor:
        flat = blobs.get(ref.sha256)
        if flat is None:
            raise KeyError(f"blob {ref.sha256} not found")
        return flat

    runtime = make_runtime(resolve)
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)  # the run ended (or its process did): nothing to flush, no atexit work of the parent's
        kind, body = message[:1], message[1:]
        if kind == _BLOB:
            meta = json.loads(body)
            data = bytearray(4 * meta["numel"])
            conn.recv_bytes_into(data)
            blobs[meta["sha256"]] = torch.frombuffer(data, dtype=torch.float32, count=meta["numel"])
            while len(blobs) > KEPT_BLOBS:
                blobs.popitem(last=False)
        elif kind == _TASK:
            _answer(conn, runtime, federation_pb2.Task.FromString(body), layout)


def _answer(conn: Connection, runtime: ClientRuntime, task: federation_pb2.Task, layout: ParamLayout) -> None:
    try:
        result = runtime.run(task)
    except Exception as err:  # the task's failure is the run's to report, as on the serial path
        conn.send_bytes(_ERROR + json.dumps(_describe(err)).encode())
        return
    try:
        header, buffers = result_header_and_payload(result, layout)
    except CodecError as err:
        conn.send_bytes(_REFUSED + str(err).encode())
        return
    conn.send_bytes(_RESULT + header.SerializeToString())
    for buffer in buffers:
        conn.send_bytes(buffer)


def _describe(err: Exception) -> dict[str, object]:
    args = list(err.args) if all(isinstance(a, str | int | float | bool) for a in err.args) else [str(err)]
    return {
        "module": type(err).__module__,
        "qualname": type(err).__qualname__,
        "args": args,
        "message": str(err),
        "traceback": "".join(traceback.format_exception(err)),
    }


def _remote_exception(info: dict[str, object]) -> Exception:
    """The worker's exception as its own type where that can be imported and built from its arguments, else a
    RuntimeError with its message; the worker's traceback is attached as a note."""
    error: Exception | None = None
    try:
        found: object = importlib.import_module(str(info["module"]))
        for name in str(info["qualname"]).split("."):
            found = getattr(found, name)
        if isinstance(found, type) and issubclass(found, Exception):
            error = found(*info["args"])  # type: ignore[misc]
    except Exception:
        error = None
    if error is None or str(error) != info["message"]:
        error = RuntimeError(f"{info['qualname']}: {info['message']}")
    error.add_note(f"in an in-process worker process:\n{info['traceback']}")
    return error
