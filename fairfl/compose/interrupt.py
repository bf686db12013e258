"""Ctrl-C and SIGTERM for `fairfl run` and `fairfl compare`: the first signal stops the work in order, a second one
forces.

`fairfl run`: the first SIGINT or SIGTERM asks the run to stop (StopRun, or the in-process engine's stop event). The
engine abandons the round in progress (only completed rounds are ever reported), the run ends as STOPPED, the results
files are written for the completed rounds, every child process is stopped (SIGTERM) and the command exits 130. A
second signal, or a run that has not ended STOP_WAIT_S after the first (an aggregator that no longer answers), forces:
every child process is killed, the rounds received so far are written and the command exits 130 at once. A signal
before there is a run to stop raises :class:`Interrupted` where the command is (starting its processes); after the
run has ended it only cuts short a wait (``wake``: e.g. the hold of ``--monitor``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, TextIO

EXIT_INTERRUPTED = 130  # 128 + SIGINT: what shells report for a command ended by Ctrl-C
STOP_WAIT_S = 30.0  # how long after the first signal the run may take to end before the command forces its way out
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """A signal arrived before there was a run to stop."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


class Interrupts:
    """The signal handling of one command; a context manager that installs it (in the main thread) and restores
    the previous handlers. Phases: starting (a signal raises Interrupted), running (see `running`), ended."""

    def __init__(self, stop_wait_s: float = STOP_WAIT_S, err: TextIO | None = None) -> None:
        self.stop_wait_s = stop_wait_s
        self.err = err
        self.signal_name: str | None = None  # the signal that interrupted the run; None: not interrupted
        self.signals = 0
        self.forced = False
        self.ended = threading.Event()  # the run has ended (run_ended)
        self.wake = threading.Event()  # set by every signal: cuts short a wait the user ends with Ctrl-C
        self._phase = "starting"
        self._stop: Callable[[], None] | None = None
        self._cleanups: list[Callable[[], str | None]] = []
        self._previous: dict[int, Any] = {}
        self._forcing = threading.Lock()

    # -- installation -----------------------------------------------------------------------------------------------

    def install(self) -> bool:
        """Handle SIGINT and SIGTERM here; False (nothing installed) outside the main thread, where Python cannot."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> Interrupts:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()

    # -- what the command tells it ----------------------------------------------------------------------------------

    def running(self, stop: Callable[[], None]) -> None:
        """The run is on: the first signal calls `stop` (on a helper thread; it may block, e.g. on an RPC)."""
        self._stop = stop
        self._phase = "running"

    def run_ended(self) -> None:
        self._phase = "ended"
        self.ended.set()

    def on_force(self, cleanup: Callable[[], str | None]) -> Callable[[], str | None]:
        """Call `cleanup` when forcing (the latest registered first); what it returns is added to the one line the
        forced exit prints."""
        self._cleanups.append(cleanup)
        return cleanup

    def discard(self, cleanup: Callable[[], str | None]) -> None:
        if cleanup in self._cleanups:
            self._cleanups.remove(cleanup)

    @property
    def interrupted(self) -> bool:
        """A signal interrupted the run (not one that only ended a wait after it)."""
        return self.signal_name is not None

    # -- the handler ------------------------------------------------------------------------------------------------

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self.signals += 1
        self.wake.set()
        if self.signals > 1:
            self.force(f"{name} again")
            return
        if self._phase == "starting":
            self.signal_name = name
            raise Interrupted(name)
        if self._phase == "ended":  # the run is over: results are being written, or services are held for a look
            return
        self.signal_name = name
        again = "Ctrl-C" if signum == signal.SIGINT else "another signal"
        self._say(
            f"{name}: stopping the run: the round in progress is abandoned, the completed rounds are written "
            f"({again} forces)"
        )
        threading.Thread(target=self._stop_and_wait, name="fairfl-interrupt", daemon=True).start()

    def _stop_and_wait(self) -> None:
        try:
            if self._stop is not None:
                self._stop()
        except Exception as err:  # the run may have ended meanwhile; the wait below decides
            self._say(f"could not ask the run to stop: {type(err).__name__}: {err}")
        if not self.ended.wait(self.stop_wait_s):
            self.force(f"the run did not end within {self.stop_wait_s:g}s of {self.signal_name}")

    def force(self, why: str) -> None:
        """Run the cleanups (kill children, write what was received), print one line and exit 130 now."""
        if not self._forcing.acquire(blocking=False):
            return  # another thread is forcing already; it exits the process
        self.forced = True
        if self.signal_name is None:
            self.signal_name = why.split()[0]
        notes = []
        for cleanup in reversed(self._cleanups):
            try:
                note = cleanup()
            except BaseException as err:  # forcing goes on whatever a cleanup does
                note = f"{type(err).__name__}: {err}"
            if note:
                notes.append(note)
        self._say("; ".join([f"{why}: forced exit", *notes]))
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
        os._exit(EXIT_INTERRUPTED)

    def _say(self, line: str) -> None:
        out = self.err or sys.stderr
        try:
            out.write("\n" + line + "\n")
            out.flush()
        except (OSError, ValueError):
            pass


def kill_processes(processes: list[Any]) -> int:
    """SIGKILL every still-running `subprocess.Popen` in `processes` and reap it; the number killed."""
    killed = 0
    for process in processes:
        if process is not None and process.poll() is None:
            try:
                process.kill()
                killed += 1
            except OSError:
                pass
    for process in processes:
        if process is not None:
            with contextlib.suppress(Exception):  # one that survives SIGKILL is the kernel's business
                process.wait(timeout=5.0)
    return killed
