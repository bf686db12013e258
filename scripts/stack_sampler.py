"""A wall-clock sampling profiler for every thread of a Python process (py-spy is not installed here).

    python scripts/stack_sampler.py OUT.txt -m aggregator_service --bind ...   # run a module, sampled

Every `interval` seconds a daemon thread reads `sys._current_frames()` and counts each other thread's stack; at exit
it writes one line per distinct stack, `count frame;frame;...;frame` (outermost first: the collapsed format flame
graph tools read). cProfile sees only the thread it started in; the aggregator's work happens on gRPC worker threads
and the run thread, which this sees. Time inside C code is charged to the Python frame that called it.
`summarize` turns the file into "where the time goes" tables: by innermost frame and by any frame on the stack.
"""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType

INTERVAL_S = 0.002
FLUSH_S = 5.0  # also written this often: a process killed at shutdown (SIGKILL) keeps what it had
MAX_DEPTH = 60


def _frame_name(frame: FrameType) -> str:
    code = frame.f_code
    path = code.co_filename
    for marker in ("site-packages/", "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    else:
        path = os.path.relpath(path) if os.path.isabs(path) else path
    return f"{code.co_name} ({path}:{frame.f_lineno})"


class StackSampler:
    def __init__(self, out: Path, interval: float = INTERVAL_S) -> None:
        self.out = out
        self.interval = interval
        self.stacks: Counter[str] = Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()
        # Before non-daemon threads are joined: a gRPC server's workers may hold long polls past the launcher's
        # patience, and a killed process writes nothing. atexit stays as the fallback.
        register = getattr(threading, "_register_atexit", None)
        if callable(register):
            register(self.stop)
        atexit.register(self.stop)

    def _run(self) -> None:
        me = threading.get_ident()
        names: dict[int | None, str] = {}
        flushed = time.monotonic()
        while not self._stop.wait(self.interval):
            if time.monotonic() - flushed > FLUSH_S:
                self._write()
                flushed = time.monotonic()
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = []
                f: FrameType | None = frame
                while f is not None and len(stack) < MAX_DEPTH:
                    stack.append(_frame_name(f))
                    f = f.f_back
                if ident not in names:
                    names = {t.ident: t.name for t in threading.enumerate()}
                thread = names.get(ident, "thread").rstrip("0123456789-_ ") or "thread"
                self.stacks[f"[{thread}];" + ";".join(reversed(stack))] += 1

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=1.0)
        self._write()

    def _write(self) -> None:
        lines = [f"# samples {self.samples} interval_s {self.interval}"]
        lines += [f"{count} {stack}" for stack, count in list(self.stacks.items())]
        tmp = self.out.with_name(self.out.name + ".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.out)


# Innermost frames of a thread with nothing to do: pools and servers waiting for work, locks, sleeps, joins. A thread
# blocked in a gRPC call it made (`_blocking`) waits on its peer: counted apart, as "waiting on a call".
IDLE_FUNCTIONS = frozenset(
    {
        "_worker",
        "_serve",
        "channel_spin",
        "wait",
        "_wait_once",
        "acquire",
        "select",
        "poll",
        "sleep",
        "get",
        "join",
        "_wait_for_tstate_lock",
        "_pump_lines",
        "serve_forever",
        "_handle_request_noblock",
    }
)
CALL_FUNCTIONS = frozenset({"_blocking", "_next", "_next_response", "result"})


def summarize(path: Path, top: int = 25, match: str = "") -> str:
    """Sampled seconds by innermost frame ("self") and by any frame on the stack ("inclusive"), busy threads only:
    stacks whose innermost frame waits for work are left out, and those blocked in a gRPC call are totalled apart.
    With `match`, the inclusive table keeps only frames containing it (e.g. "fairfl/")."""
    lines = path.read_text().splitlines()
    header = lines[0].split()
    samples, interval = int(header[2]), float(header[4])
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    idle = 0
    for line in lines[1:]:
        count_text, stack = line.split(" ", 1)
        count = int(count_text)
        frames = stack.split(";")
        innermost = frames[-1].split(" (", 1)[0]
        if innermost in IDLE_FUNCTIONS:
            idle += count
            continue
        if innermost in CALL_FUNCTIONS:  # the caller: the frame below grpc's
            caller = next((f for f in reversed(frames) if "grpc/" not in f), frames[-1])
            calls[caller] += count
            continue
        own[frames[-1]] += count
        for frame in set(frames[1:]):
            if match in frame:
                inclusive[frame] += count

    def table(counter: Counter[str]) -> list[str]:
        return [f"    {c * interval:8.3f}s  {name}" for name, c in counter.most_common(top)]

    out = [f"{path.name}: {samples} samples over {samples * interval:.1f}s ({idle * interval:.1f} thread-seconds idle)"]
    out += ["  busy, by innermost frame:", *table(own)]
    out += [f"  busy, by any frame on the stack{f' matching {match!r}' if match else ''}:", *table(inclusive)]
    out += ["  blocked in a gRPC call, by caller:", *table(calls)]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "-m":
        print("usage: stack_sampler.py OUT -m MODULE [ARGS...]", file=sys.stderr)
        return 2
    out, module, rest = Path(argv[0]), argv[2], argv[3:]
    StackSampler(out).start()
    sys.argv = [module, *rest]
    sys.path[0] = os.getcwd()  # as `python -m` would have it, instead of this script's directory
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:  # the module's exit status is this process's
        return done.code if isinstance(done.code, int) else int(done.code is not None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
