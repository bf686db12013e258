"""`fairfl runs list|status|watch|stop`: operate the runs of a running aggregator over RunControl.

Each command dials the aggregator (`--aggregator`, env FAIRFL_AGGREGATOR_ADDRESS) with the operator's mTLS identity,
as `fairfl run --aggregator` does (`--tls-dir` holding the `operator` identity `fairfl certs` writes, or `--insecure`).
Exit codes: 0 done (for watch: the run completed), 1 the aggregator cannot be reached or the run did not complete,
2 bad input (an unknown run, an identity the aggregator refuses, missing TLS material), 130 interrupted.
Every failure is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TextIO

import grpc
from google.protobuf.json_format import MessageToDict

from fairfl.rpc_channel import open_channel
from fairfl.rpc_security import TransportSecurity, add_transport_arguments, security_from_args
from fairfl.v1 import control_pb2, control_pb2_grpc

ADDRESS_ENV = "FAIRFL_AGGREGATOR_ADDRESS"
DEFAULT_ADDRESS = "127.0.0.1:50051"
CALL_TIMEOUT_S = 10.0  # one unary call, connecting included: an unreachable aggregator is reported after this
STOP_WAIT_S = 30.0  # how long `runs stop` waits for the run to end
RECONNECT_S = 60.0  # how long `runs watch` keeps trying when the aggregator goes away mid-run
POLL_S = 0.2
TERMINAL = {control_pb2.RUN_STATE_COMPLETED, control_pb2.RUN_STATE_STOPPED, control_pb2.RUN_STATE_FAILED}
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class OperateError(Exception):
    """One line for stderr and the exit code it ends with."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def state_name(state: int) -> str:
    """RUN_STATE_RUNNING -> RUNNING."""
    return control_pb2.RunState.Name(state).removeprefix("RUN_STATE_")


def _when(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix)) if unix else "-"


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _as_dict(message: Any) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


@dataclass
class Target:
    """The aggregator a command talks to and the identity it shows."""

    address: str
    security: TransportSecurity | None

    def rpc_error(self, err: grpc.RpcError, run_id: str = "") -> OperateError:
        """The one line (and exit code) a failed call ends the command with."""
        code = err.code()
        details = (err.details() or "").strip().splitlines()
        detail = details[0] if details else code.name
        if code == grpc.StatusCode.NOT_FOUND and run_id:
            return OperateError(f"no run {run_id!r} on {self.address}", EXIT_USAGE)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            hint = "is it running, and does --tls-dir hold this deployment's certificates?"
            if self.security is None:
                hint = "is it running, and does it serve plaintext (--insecure)?"
            return OperateError(f"cannot reach the aggregator at {self.address} ({hint}): {detail}", EXIT_FAILED)
        if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
            return OperateError(
                f"the aggregator at {self.address} refused this identity: {detail}; use the operator identity "
                "(`fairfl certs OUT` writes OUT/operator)",
                EXIT_USAGE,
            )
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return OperateError(f"the aggregator at {self.address} refused the request: {detail}", EXIT_USAGE)
        return OperateError(f"the aggregator at {self.address} answered {code.name}: {detail}", EXIT_FAILED)

    @contextmanager
    def control(self) -> Iterator[control_pb2_grpc.RunControlStub]:
        with open_channel(self.address, self.security) as channel:
            yield control_pb2_grpc.RunControlStub(channel)


def _target(args: argparse.Namespace) -> Target:
    try:
        security = security_from_args(args)
    except ValueError as err:
        raise OperateError(str(err), EXIT_USAGE) from None
    return Target(args.aggregator, security)


def _get(target: Target, control: control_pb2_grpc.RunControlStub, run_id: str) -> control_pb2.RunStatus:
    try:
        status: control_pb2.RunStatus = control.GetRun(control_pb2.GetRunRequest(run_id=run_id), timeout=CALL_TIMEOUT_S)
        return status
    except grpc.RpcError as err:
        raise target.rpc_error(err, run_id) from None


# --- list ------------------------------------------------------------------------------------------------------------


def cmd_list(args: argparse.Namespace, out: TextIO) -> int:
    target = _target(args)
    with target.control() as control:
        try:
            reply = control.ListRuns(control_pb2.ListRunsRequest(), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            raise target.rpc_error(err) from None
    runs = sorted(reply.runs, key=lambda s: s.started_unix, reverse=True)  # newest first, whatever the server sent
    if args.json:
        out.write(json.dumps([_as_dict(s) for s in runs], indent=2) + "\n")
        return EXIT_OK
    if not runs:
        out.write(f"no runs on {target.address}\n")
        return EXIT_OK
    out.write(format_table(runs) + "\n")
    return EXIT_OK


def format_table(runs: list[control_pb2.RunStatus]) -> str:
    header = ("RUN ID", "NAME", "STRATEGY", "STATE", "ROUND", "CLIENTS", "STARTED")
    rows = [header] + [
        (
            s.run_id,
            s.name or "-",
            s.strategy or "-",
            state_name(s.state),
            f"{s.round}/{s.total_rounds}",
            str(s.registered_clients),
            _when(s.started_unix),
        )
        for s in runs
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


# --- status ----------------------------------------------------------------------------------------------------------


def latest_evaluation(
    control: control_pb2_grpc.RunControlStub, status: control_pb2.RunStatus, timeout: float = 5.0
) -> control_pb2.RoundEvent | None:
    """The newest evaluated round of the run, from WatchRun's replay of its past events: read until the round GetRun
    reported (or the run's end), never following the run further."""
    if status.round == 0 and status.state not in TERMINAL:
        return None
    latest: control_pb2.RoundEvent | None = None
    call = control.WatchRun(control_pb2.WatchRunRequest(run_id=status.run_id), timeout=timeout)
    try:
        for event in call:
            if event.HasField("round"):
                if event.round.evaluated:
                    latest = event.round
                if event.round.round >= status.round and status.state not in TERMINAL:
                    break
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # a replay cut short still gives what it had
            raise
    finally:
        call.cancel()
    return latest


def fairness_line(event: control_pb2.RoundEvent) -> str:
    f = event.fairness
    return (
        f"after round {event.round}: mean {f.mean:.2f}%  variance {f.variance:.2f}  worst 5% {f.worst_5:.2f}%  "
        f"best 5% {f.best_5:.2f}%  Jain {f.jain_index:.4f}  ({f.evaluated_clients} clients)"
    )


def cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    target = _target(args)
    with target.control() as control:
        status = _get(target, control, args.run)
        try:
            latest = latest_evaluation(control, status)
        except grpc.RpcError as err:
            raise target.rpc_error(err, args.run) from None
    if args.json:
        record = _as_dict(status)
        record["latest_fairness"] = {"round": latest.round, **_as_dict(latest.fairness)} if latest is not None else None
        out.write(json.dumps(record, indent=2) + "\n")
        return EXIT_OK
    now = time.time()
    if status.ended_unix:
        took = f" (ran {_duration(status.ended_unix - status.started_unix)})" if status.started_unix else ""
    else:
        took = f" (running {_duration(now - status.started_unix)})" if status.started_unix else ""
    rows = [
        ("run", status.run_id),
        ("name", status.name or "-"),
        ("strategy", status.strategy or "-"),
        ("state", state_name(status.state)),
        ("round", f"{status.round}/{status.total_rounds}"),
        ("clients", str(status.registered_clients)),
        ("started", _when(status.started_unix) + ("" if status.ended_unix else took)),
        ("ended", _when(status.ended_unix) + (took if status.ended_unix else "")),
        ("message", status.message or "-"),
        ("fairness", fairness_line(latest) if latest is not None else "no evaluated round yet"),
        ("model", f"sha256 {status.model_sha256}" if status.model_sha256 else "none yet"),
    ]
    width = max(len(k) for k, _ in rows)
    out.write("\n".join(f"{k:<{width}}  {v}" for k, v in rows) + "\n")
    return EXIT_OK


# --- watch -----------------------------------------------------------------------------------------------------------


def round_line(event: control_pb2.RoundEvent, total: int) -> str:
    """One line per round: what was selected and accepted, the train loss and time; fairness when evaluated."""
    text = (
        f"round {event.round}/{total}  selected {len(event.selected)}  accepted {event.results_accepted}"
        f"  rejected {event.results_rejected}  late {event.results_late}  loss {event.mean_train_loss:.4f}"
        f"  {event.duration_seconds:.2f}s"
    )
    if event.evaluated:
        f = event.fairness
        text += f"  | acc {f.mean:.2f}  var {f.variance:.2f}  worst5% {f.worst_5:.2f}  best5% {f.best_5:.2f}"
    if event.epsilon_spent:
        text += f"  eps {event.epsilon_spent:.3f}"
    return text


def status_line(status: control_pb2.RunStatus) -> str:
    line = f"[{state_name(status.state).lower()}] run {status.run_id}"
    if status.state in TERMINAL:
        line += f" ended after round {status.round}/{status.total_rounds}"
    return line + (f": {status.message}" if status.message else "")


def follow(
    target: Target,
    control: control_pb2_grpc.RunControlStub,
    run_id: str,
    on_event: Callable[[control_pb2.RunEvent], None],
    reconnect_s: float = RECONNECT_S,
    err: TextIO | None = None,
) -> None:
    """Pass the run's events to `on_event` until the run ends; when the aggregator goes away (a restart resumes the
    run and replays its rounds), watch again for up to `reconnect_s`, passing each round on once."""
    seen: set[int] = set()
    lost_at: float | None = None
    while True:
        # No wait_for_ready: while the aggregator is down each attempt fails fast, so reconnect_s bounds the wait.
        call = control.WatchRun(control_pb2.WatchRunRequest(run_id=run_id))
        try:
            for event in call:
                lost_at = None
                if event.HasField("round"):
                    if event.round.round in seen:
                        continue
                    seen.add(event.round.round)
                on_event(event)
            return
        except grpc.RpcError as error:
            retryable = error.code() == grpc.StatusCode.UNAVAILABLE or (
                error.code() == grpc.StatusCode.NOT_FOUND and lost_at is not None  # restarted, not resumed yet
            )
            if not retryable or (lost_at is not None and time.monotonic() - lost_at > reconnect_s):
                raise target.rpc_error(error, run_id) from None
            if lost_at is None:
                lost_at = time.monotonic()
                print(
                    f"lost the aggregator at {target.address} ({error.code().name}); watching again for up to "
                    f"{reconnect_s:g}s",
                    file=err or sys.stderr,
                    flush=True,
                )
            time.sleep(1.0)
        finally:
            call.cancel()


def cmd_watch(args: argparse.Namespace, out: TextIO) -> int:
    target = _target(args)
    with target.control() as control:
        status = _get(target, control, args.run)  # an unknown run or an unreachable aggregator fails here, fast
        final = status
        total = status.total_rounds

        def on_event(event: control_pb2.RunEvent) -> None:
            nonlocal final, total
            if event.HasField("status"):
                final = event.status
                total = event.status.total_rounds or total
            if args.json:
                out.write(json.dumps(MessageToDict(event, preserving_proto_field_name=True)) + "\n")
            elif event.HasField("status"):
                out.write(status_line(event.status) + "\n")
            else:
                out.write(round_line(event.round, total) + "\n")
            out.flush()

        follow(target, control, args.run, on_event, reconnect_s=args.reconnect)
    return EXIT_OK if final.state == control_pb2.RUN_STATE_COMPLETED else EXIT_FAILED


# --- stop ------------------------------------------------------------------------------------------------------------


def cmd_stop(args: argparse.Namespace, out: TextIO) -> int:
    target = _target(args)
    with target.control() as control:
        before = _get(target, control, args.run)
        if before.state in TERMINAL:
            out.write(f"run {args.run} had already ended: {status_line(before)}\n")
            return EXIT_OK
        try:
            control.StopRun(control_pb2.StopRunRequest(run_id=args.run, reason=args.reason), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            raise target.rpc_error(err, args.run) from None
        deadline = time.monotonic() + args.wait
        status = _get(target, control, args.run)
        while status.state not in TERMINAL and time.monotonic() < deadline:
            time.sleep(POLL_S)
            status = _get(target, control, args.run)
    if args.json:
        out.write(json.dumps({k: v for k, v in _as_dict(status).items() if k != "experiment_yaml"}) + "\n")
    if status.state not in TERMINAL:
        raise OperateError(
            f"run {args.run} was asked to stop but is still {state_name(status.state)} after {args.wait:g}s "
            f"(round {status.round}/{status.total_rounds}); it stops at its next phase boundary: check again with "
            f"`fairfl runs status {args.run}`",
            EXIT_FAILED,
        )
    if not args.json:
        out.write(status_line(status) + "\n")
    return EXIT_OK


# --- the parser ------------------------------------------------------------------------------------------------------


def _run_command(command: Callable[[argparse.Namespace, TextIO], int]) -> Callable[[argparse.Namespace], int]:
    """The command with its failures as one line on stderr and an exit code: no traceback, Ctrl-C exits 130."""

    def run(args: argparse.Namespace) -> int:
        try:
            return command(args, sys.stdout)
        except OperateError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            return err.code
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr, flush=True)
            return EXIT_INTERRUPTED
        except BrokenPipeError:  # e.g. `fairfl runs watch RUN | head`: the reader went away
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush does not fail again
            return EXIT_OK

    return run


def add_runs_parser(sub: Any) -> None:
    """`fairfl runs ...` on the `fairfl` command's subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--aggregator",
        default=os.environ.get(ADDRESS_ENV, DEFAULT_ADDRESS),
        metavar="ADDR",
        help=f"the aggregator's host:port (env {ADDRESS_ENV}; default {DEFAULT_ADDRESS})",
    )
    add_transport_arguments(common, server=False)
    runs = sub.add_parser(
        "runs",
        help="list, inspect, watch and stop the runs of a running aggregator",
        description="Operate the runs of a running aggregator over RunControl, with the operator's mTLS identity "
        "(--tls-dir: the `operator` directory `fairfl certs` writes). Exit codes: 0 ok, 1 unreachable or (watch) "
        "the run did not complete, 2 bad input or unknown run, 130 interrupted.",
    )
    commands = runs.add_subparsers(dest="runs_command", required=True, metavar="COMMAND")
    listing = commands.add_parser("list", parents=[common], help="every run the aggregator knows, newest first")
    listing.add_argument("--json", action="store_true", help="a JSON list of the runs' statuses")
    listing.set_defaults(func=_run_command(cmd_list))
    status = commands.add_parser(
        "status", parents=[common], help="a run's state, round, message, latest fairness and model"
    )
    status.add_argument("run", metavar="RUN", help="run id (see `fairfl runs list`)")
    status.add_argument("--json", action="store_true", help="one JSON object")
    status.set_defaults(func=_run_command(cmd_status))
    watch = commands.add_parser(
        "watch",
        parents=[common],
        help="follow a run: its past rounds, then one line per round as it happens; exit 0 when it completes",
    )
    watch.add_argument("run", metavar="RUN", help="run id (see `fairfl runs list`)")
    watch.add_argument("--json", action="store_true", help="one JSON object per event (RunEvent)")
    watch.add_argument(
        "--reconnect",
        type=float,
        default=RECONNECT_S,
        metavar="SECONDS",
        help="keep watching this long when the aggregator goes away (default %(default)g)",
    )
    watch.set_defaults(func=_run_command(cmd_watch))
    stop = commands.add_parser(
        "stop", parents=[common], help="stop a run and wait until it has ended; prints its final state"
    )
    stop.add_argument("run", metavar="RUN", help="run id (see `fairfl runs list`)")
    stop.add_argument("--reason", default="", help="why, for the run's final message and the aggregator's log")
    stop.add_argument(
        "--wait",
        type=float,
        default=STOP_WAIT_S,
        metavar="SECONDS",
        help="how long to wait for the run to end (default %(default)g)",
    )
    stop.add_argument("--json", action="store_true", help="the final status as one JSON object")
    stop.set_defaults(func=_run_command(cmd_stop))
