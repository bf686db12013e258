"""Worker processes for the in-process transport: client tasks trained beside each other without sharing a GIL.

Worker threads in one process (the `threads` pool) hand the GIL back and forth around every torch call of every step;
on a small model that costs a large share of the cores' time, and more the more cores there are. A forked worker
process trains with nothing to wait for. Each worker is forked once per run from the transport's process (Linux
only: fork is what makes it cheap and faithful), so it shares the run's data copy-on-write (no reload) and sees every
model, strategy or procedure the parent registered, and hosts one ClientRuntime on one torch thread. The parent drives
it over a socketpair (Channel: length-prefixed messages, no pickle):

- parent → worker: the blobs (global model, fair gradient) the parent's BlobStore holds and the worker lacks, as raw
  float32 bytes, then the task as its serialised Task with the list of blobs to keep (the worker mirrors the store,
  so its memory is bounded as the parent's is);
- worker → parent: the result as the wire encodes it (ResultHeader, then each payload's raw bytes in the run's
  transport.update_dtype), decoded by the aggregator's own ResultAssembler, so the parent folds exactly what an
  aggregator would have received from an agent (bit for bit, the same checks); or the task's exception (its type,
  arguments and traceback), raised again in the parent as the same type where that can be imported; or "skipped"
  for a task queued in the worker when the phase ended (a stop, another task's failure: `halt`).

Two tasks may wait in a worker at once (the transport sends the next before folding the last result, so the worker
never idles for the fold); replies come back in the order the tasks were sent. Any failure of the pipe itself marks
the worker broken: it is killed, and every task waiting on it fails with one message. A worker ignores Ctrl-C and
the parent's SIGTERM handling (the parent's run stops it), dies with the parent (PR_SET_PDEATHSIG), and exits when
its pipe closes.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.synchronize import Event

import torch

from aggregator_service.blobs import BlobStore
from aggregator_service.engine import RunRefused
from client_agent.trainer import BlobResolver, ClientRuntime
from fairfl.codec import CodecError
from fairfl.params import ParamLayout
from fairfl.protocol import ClientResult, ResultAssembler, result_header_and_payload
from fairfl.v1 import federation_pb2, tensor_pb2

# Message kinds, the first byte of each message that starts an exchange.
_BLOB, _TASK = b"B", b"T"  # parent → worker
_RESULT, _REFUSED, _ERROR, _SKIPPED = b"R", b"J", b"E", b"S"  # worker → parent

_PR_SET_PDEATHSIG = 1
SOCKET_BUFFER_BYTES = 4 * 1024 * 1024  # a whole update fits: the worker writes it without waiting for the parent


class Channel:
    """Length-prefixed messages over one end of a socketpair: sent with sendmsg (no concatenation) and received into
    a buffer of the exact size with recv_into. (multiprocessing's Connection reads a large message in pieces and
    copies it three times: ~0.6 ms of CPU per 800 KB update in the parent, against ~0.1 ms here.)"""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):  # best effort: the OS caps it (net.core.wmem_max, rmem_max)
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)

    @classmethod
    def pair(cls) -> tuple[Channel, Channel]:
        a, b = socket.socketpair()
        return cls(a), cls(b)

    def send(self, *parts: bytes | bytearray | memoryview) -> None:
        """One message: the parts' concatenation."""
        views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
        pending = [memoryview(sum(v.nbytes for v in views).to_bytes(8, "little")), *views]
        while pending:
            sent = self.sock.sendmsg(pending)
            while pending and sent >= pending[0].nbytes:
                sent -= pending.pop(0).nbytes
            if sent:
                pending[0] = pending[0][sent:]

    def recv(self) -> bytearray:
        """The next message (EOFError when the other end has closed)."""
        return self._exactly(int.from_bytes(self._exactly(8), "little"))

    def _exactly(self, size: int) -> bytearray:
        buffer = bytearray(size)
        view, got = memoryview(buffer), 0
        while got < size:
            count = self.sock.recv_into(view[got:], size - got)
            if count == 0:
                raise EOFError("the other end closed the channel")
            got += count
        return buffer

    def close(self) -> None:
        self.sock.close()


def fork_available() -> bool:
    """Worker processes are forked, which only Linux does safely by default (macOS' CPython spawns instead)."""
    return sys.platform.startswith("linux")


_autograd_fork_broken = False  # once a forked child cannot run autograd, no later one can
PROBE_TIMEOUT_S = 10.0


def autograd_survives_fork() -> bool:
    """Whether a process forked now can run a backward pass. With an accelerator visible (a CUDA machine), PyTorch's
    autograd engine starts device threads at this process's first backward, and from then on a forked child's
    backward raises "Unable to handle autograd's threading in combination with fork-based multiprocessing", even on
    the CPU. Without one the engine starts no threads and a fork is always fine; with one, a child is forked to try."""
    global _autograd_fork_broken
    if _autograd_fork_broken:
        return False
    if not torch.accelerator.is_available():
        return True
    _autograd_fork_broken = not _forked_child_runs_autograd()
    return not _autograd_fork_broken


def _flush_standard_streams() -> None:
    """Before a fork: else the child would flush our buffered output a second time."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()


def _forked_child_runs_autograd() -> bool:
    _flush_standard_streams()
    pid = os.fork()
    if pid == 0:  # the child: one backward on the CPU, then leave without running the parent's exit handlers
        code = 1
        try:
            x = torch.ones(1, requires_grad=True)
            (x * 2.0).sum().backward()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)  # a child that hangs (a lock held by another thread at the fork) cannot train either
    os.waitpid(pid, 0)
    return False


class WorkerRefused(Exception):
    """A result the wire would not carry (a float16 overflow when encoding, or a malformed one when decoding): the
    transport counts it as rejected, as an aggregator would."""


class WorkerLost(RunRefused):
    """A worker process died or its channel broke: the run fails with this one line (no traceback: it says what
    happened and what to do)."""


class WorkerSkipped(Exception):
    """A task that waited in a worker while its phase ended (`halt` was set): it never started."""


class WorkerProcess:
    """One forked worker. `run` may be called by several threads at once (see the module's docstring)."""

    def __init__(
        self,
        index: int,
        make_runtime: Callable[[BlobResolver], ClientRuntime],
        wire_layout: ParamLayout,
        blobs: BlobStore,
        halt: Event,
        others: list[Channel],
    ) -> None:
        """`halt`: set, a worker skips the tasks waiting in it; `others`: the parent's ends of the workers forked
        before this one, which this one must not keep open."""
        self.index = index
        self.layout = wire_layout
        self.blobs = blobs
        self.known: set[str] = set()  # blobs the worker holds (it keeps exactly those the last task listed)
        self.outstanding = 0  # tasks sent and not answered (the transport's to count, under its lock)
        self.broken: str = ""  # why the pipe can no longer be trusted, once it cannot
        self._sending = threading.Lock()
        self._turns = threading.Condition()  # replies are read in the order the tasks were sent
        self._sent = self._read = 0
        context = multiprocessing.get_context("fork")
        self.conn, child_end = Channel.pair()
        _flush_standard_streams()
        self.process = context.Process(
            target=_serve,
            args=(child_end, [*others, self.conn], make_runtime, wire_layout, halt, os.getpid()),
            name=f"fairfl-inprocess-worker-{index}",
            daemon=True,
        )
        self.process.start()
        child_end.close()

    def run(self, task: federation_pb2.Task) -> ClientResult:
        """The task's result as received over the wire; raises WorkerRefused, WorkerSkipped, or the task's own
        exception (WorkerLost when the worker died or its channel broke)."""
        with self._sending:
            self._check()
            try:
                self._send_task(task)
            except BaseException as err:  # a worker that died between tasks shows here first
                raise self._break(self._ended(task, err, sending=True)) from err
            turn, self._sent = self._sent, self._sent + 1
        with self._turns:
            self._turns.wait_for(lambda: self._read == turn or bool(self.broken))
            self._check()
            try:
                kind, body, header, parts = self._reply()
            except BaseException as err:
                raise self._break(self._ended(task, err)) from err
            finally:
                self._read += 1
                self._turns.notify_all()
        if kind == _RESULT:
            assert header is not None
            return _decode(header, parts, self.layout)
        if kind == _REFUSED:
            raise WorkerRefused(bytes(body).decode())
        if kind == _SKIPPED:
            raise WorkerSkipped(task.task_id)
        raise _remote_exception(json.loads(body))

    def _send_task(self, task: federation_pb2.Task) -> None:
        """The blobs the worker lacks, then the task with the blobs to keep (what the store holds now)."""
        held = self.blobs.newest(None)
        for sha256, flat in held:
            if sha256 not in self.known:
                data = memoryview(flat.detach().cpu().contiguous().numpy()).cast("B")  # before anything is sent
                self.conn.send(_BLOB, json.dumps({"sha256": sha256, "numel": flat.numel()}).encode())
                self.conn.send(data)
        self.known = {sha256 for sha256, _ in held}
        keep = json.dumps(sorted(self.known)).encode()
        self.conn.send(_TASK, len(keep).to_bytes(4, "little"), keep, task.SerializeToString())

    def _reply(self) -> tuple[bytes, bytes, federation_pb2.ResultHeader | None, list[bytearray]]:
        """The next reply's kind, body and, for a result, its header and payloads (all read here: the channel stays
        in step)."""
        reply = self.conn.recv()
        kind, body = bytes(reply[:1]), bytes(reply[1:])
        if kind != _RESULT:
            return kind, body, None, []
        header = federation_pb2.ResultHeader.FromString(body)
        return kind, body, header, [self.conn.recv() for _ in header.payloads]

    def _ended(self, task: federation_pb2.Task, err: BaseException, sending: bool = False) -> str:
        if not isinstance(err, EOFError | OSError):
            step = "sending client {}'s task" if sending else "reading client {}'s result"
            return f"{step.format(task.client_id)} was interrupted ({err!r})"
        self.process.join(5.0)  # reaped, for its exit code
        code = self.process.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            how = f"killed by {signal.Signals(-code).name}"
            if -code == signal.SIGKILL:
                how += ", perhaps out of memory"
        return (
            f"in-process worker {self.index} (pid {self.process.pid}) ended "
            f"{'before' if sending else 'while running'} client {task.client_id}'s task ({how}); anything it "
            "printed went to this run's stderr. runtime.inprocess_pool: threads runs the clients in this process "
            "instead"
        )

    def _break(self, why: str) -> WorkerLost:
        """The pipe is out of step or gone: no later reply can be trusted. The worker is killed; waiters fail."""
        with self._turns:
            if not self.broken:
                self.broken = why
                self.process.kill()
            self._turns.notify_all()
        return WorkerLost(self.broken)

    def _check(self) -> None:
        if self.broken:
            raise WorkerLost(self.broken)

    def close(self, timeout: float = 10.0) -> None:
        """Closing the pipe ends the worker (between tasks: the transport waits for running ones first)."""
        self.conn.close()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _decode(header: federation_pb2.ResultHeader, parts: list[bytearray], layout: ParamLayout) -> ClientResult:
    try:  # each payload arrives whole: the largest part is one payload, a buffer of its own (viewed, not copied)
        assembler = ResultAssembler(header, layout, sha256_optional=True, max_chunk_bytes=max(1, layout.payload_nbytes))
        for part in parts:
            assembler.add(part, owned=True)
        return assembler.finish()
    except CodecError as err:
        raise WorkerRefused(str(err)) from err


# -- the worker's side ---------------------------------------------------------------------------------------------


def _serve(
    conn: Channel,
    inherited: list[Channel],
    make_runtime: Callable[[BlobResolver], ClientRuntime],
    layout: ParamLayout,
    halt: Event,
    parent: int,
) -> None:
    _detach(parent)
    for other in inherited:  # else a pipe would stay open after its owner ended and its worker would never see EOF
        other.close()
    torch.set_num_threads(1)  # the pool is forked only for one torch thread per worker (inprocess.pool_kind)
    blobs: dict[str, torch.Tensor] = {}

    def resolve(ref: tensor_pb2.BlobRef) -> torch.Tensor:
        flat = blobs.get(ref.sha256)
        if flat is None:
            raise KeyError(f"blob {ref.sha256} not found")
        return flat

    runtime: ClientRuntime | Exception
    try:
        runtime = make_runtime(resolve)
    except Exception as err:  # every task reports it (the parent built the same runtime, so this is rare)
        runtime = err
    try:
        while True:
            message = conn.recv()
            kind, body = bytes(message[:1]), memoryview(message)[1:]
            if kind == _BLOB:
                meta = json.loads(bytes(body))
                data = conn.recv()
                if len(data) != 4 * meta["numel"]:  # the channel is out of step: nothing after this can be trusted
                    break
                blobs[meta["sha256"]] = torch.frombuffer(data, dtype=torch.float32)
            elif kind == _TASK:
                size = int.from_bytes(body[:4], "little")
                keep = set(json.loads(bytes(body[4 : 4 + size])))
                for sha256 in [s for s in blobs if s not in keep]:  # the parent's store dropped it
                    del blobs[sha256]
                task = federation_pb2.Task.FromString(bytes(body[4 + size :]))
                if halt.is_set():
                    conn.send(_SKIPPED)
                else:
                    _answer(conn, runtime, task, layout)
    except (EOFError, OSError):
        pass  # the run ended (or its process did)
    os._exit(0)  # nothing to flush, none of the parent's atexit work


def _detach(parent: int) -> None:
    """Leave signals to the parent's run, which stops the workers itself (Ctrl-C and a SIGTERM to the process group
    reach every process of it; the parent's SIGTERM handler, inherited, would run the parent's cleanups here), and
    die with it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):  # else the pipe's EOF still ends it, once between tasks
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def _answer(conn: Channel, runtime: ClientRuntime | Exception, task: federation_pb2.Task, layout: ParamLayout) -> None:
    try:
        if isinstance(runtime, Exception):
            raise runtime
        result = runtime.run(task)
        header, buffers = result_header_and_payload(result, layout)
    except CodecError as err:  # what the agent would refuse to send (a float16 overflow)
        conn.send(_REFUSED, str(err).encode())
        return
    except Exception as err:  # the task's failure is the run's to report, as on the serial path
        conn.send(_ERROR, json.dumps(_describe(err)).encode())
        return
    conn.send(_RESULT, header.SerializeToString())
    for buffer in buffers:
        conn.send(buffer)


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
    """The worker's exception as its own type where that can be imported and built from its arguments with the same
    message, else a RuntimeError with that message (the run reports the same line either way); the worker's
    traceback is attached as a note."""
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
        error = RuntimeError(info["message"])
    error.add_note(f"raised in an in-process worker process:\n{info['traceback']}")
    return error
