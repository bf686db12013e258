"""`fairfl` command line: run experiments locally (services as processes, or in one process) and serve components."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from fairfl.compose.compare import add_compare_parser
from fairfl.compose.interrupt import EXIT_INTERRUPTED, Interrupted, Interrupts
from fairfl.compose.monitor import MonitorError
from fairfl.compose.results import RunRecorder
from fairfl.config import ConfigError, ExperimentConfig, load_experiment
from fairfl.rpc_security import TransportSecurity, add_transport_arguments

if TYPE_CHECKING:
    from aggregator_service.checkpoint import Loaded


def _overrides(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        out[key] = yaml.safe_load(value)
    return out


class RunNotStarted(Exception):
    """The aggregator or the in-process engine refused to start the run; the message says why."""


def run_inprocess(
    config: ExperimentConfig,
    recorder: RunRecorder,
    run_id: str,
    out_dir: Path | None = None,
    interrupts: Interrupts | None = None,
    resume: Loaded | None = None,
) -> None:
    """Run in this process; with `out_dir`, the final model goes to out_dir/model.safetensors. With `interrupts`,
    its first signal sets the engine's stop event (the round in progress is abandoned). With runtime.checkpoint_dir,
    every round is checkpointed and an interrupted run's checkpoint stays resumable; `resume` (fairfl.compose.resume)
    continues such a run, its earlier rounds passed to `recorder` first."""
    from aggregator_service.engine import RoundEngine
    from fairfl.compose.inprocess import InProcessTransport
    from fairfl.compose.local_privacy import LocalPrivacy
    from fairfl.compose.local_selection import LocalClusterer, LocalSelector

    try:
        engine = RoundEngine(
            run_id,
            config,
            InProcessTransport(device=config.runtime.device, threads=config.runtime.threads_per_agent),
            LocalSelector(config.selection.method),
            LocalPrivacy(),
            recorder,
            clusterer=LocalClusterer(),
        )
    except ConfigError as err:  # what the engine checks before round 1 (e.g. the model's head), as over gRPC
        raise RunNotStarted(str(err)) from None
    with contextlib.ExitStack() as held:
        if config.runtime.checkpoint_dir:  # the aggregator's checkpoints; a signal's stop or a failure stays resumable
            _checkpoint(engine, recorder, run_id, resume, held)
        if interrupts is not None:
            interrupts.running(engine.stop.set)
        engine.run()
        if interrupts is not None:
            interrupts.run_ended()
    if out_dir is not None:
        from fairfl.compose.model_cmd import MODEL_FILE_NAME, save_final_model

        save_final_model(out_dir / MODEL_FILE_NAME, config, run_id, recorder.rounds, engine=engine)


def _checkpoint(
    engine: Any, recorder: RunRecorder, run_id: str, resume: Loaded | None, held: contextlib.ExitStack
) -> None:
    """Checkpoint the in-process engine's run under runtime.checkpoint_dir (held by this process while it runs),
    starting from `resume`'s checkpoint when given."""
    from aggregator_service.checkpoint import INPROCESS, CheckpointError, RunCheckpointer, run_directory
    from fairfl.compose.resume import run_lock

    directory = run_directory(engine.config.runtime.checkpoint_dir, run_id)
    try:
        held.enter_context(run_lock(directory))
        engine.checkpointer = RunCheckpointer(directory, run_id, engine.config, origin=INPROCESS)
        if resume is None:
            engine.checkpointer.start_fresh(engine)
            return
        engine.checkpointer.restore(engine, resume)
    except CheckpointError as err:
        raise RunNotStarted(str(err)) from None
    except (KeyError, ValueError, TypeError, RuntimeError) as err:  # state this code cannot load (changed since)
        raise RunNotStarted(
            f"cannot resume run {run_id!r} from {directory}/: {type(err).__name__}: {err} (the code changed since it "
            "was written?); delete that directory to start the run over"
        ) from None
    recorder.rounds.extend(resume.rounds)


def follow_run(control: Any, run_id: str, on_event: Callable[[Any], None], reconnect_s: float = 300.0) -> None:
    """Pass a run's events to `on_event` until it ends, watching again when the aggregator restarts (it resumes the
    run from its checkpoint and replays its rounds: each round is passed on once)."""
    import grpc

    from fairfl.v1 import control_pb2

    seen: set[int] = set()
    lost_at: float | None = None
    while True:
        try:
            for event in control.WatchRun(control_pb2.WatchRunRequest(run_id=run_id), wait_for_ready=True):
                lost_at = None
                if event.HasField("round"):
                    if event.round.round in seen:
                        continue
                    seen.add(event.round.round)
                on_event(event)
            return
        except grpc.RpcError as err:
            # NOT_FOUND: a restarted aggregator that has not resumed the run (yet)
            retryable = err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
            if not retryable or (lost_at is not None and time.monotonic() - lost_at > reconnect_s):
                raise
            if lost_at is None:
                lost_at = time.monotonic()
                print(f"lost the aggregator ({err.code().name}); watching again", file=sys.stderr, flush=True)
            time.sleep(1.0)


def run_grpc(
    config: ExperimentConfig,
    recorder: RunRecorder,
    run_id: str,
    out_dir: Path,
    aggregator: str,
    monitor: bool = False,
    after_run: Callable[[], None] | None = None,
    tls: bool = True,
    security: TransportSecurity | None = None,
    interrupts: Interrupts | None = None,
) -> None:
    """Run over gRPC; with `monitor`, a local Prometheus scrapes every process, and `after_run` is called while the
    services (and Prometheus) are still up. The processes this starts talk mutual TLS (an ephemeral CA in
    out_dir/tls) unless `tls` is False; a running `aggregator` is reached with `security` (None: plaintext).
    With `interrupts`, its first signal sends StopRun (the run ends as STOPPED and is followed to its end), and a
    forced stop kills every process this started."""
    import grpc

    from fairfl.compose.launcher import LocalCluster
    from fairfl.compose.monitor import Prometheus, describe
    from fairfl.rpc_channel import open_channel
    from fairfl.v1 import control_pb2, control_pb2_grpc

    cluster = LocalCluster(out_dir / "logs", tls=tls and not aggregator, tls_dir=out_dir / "tls")
    prometheus: Prometheus | None = None
    if interrupts is not None:
        interrupts.on_force(lambda: _killed("process", cluster.kill_all()))
    with cluster:
        if not aggregator:
            agg, _, _ = cluster.start_services(out_dir, ["--checkpoint-dir", str(out_dir / "checkpoints")])
            aggregator = agg.address
            cluster.start_agents(
                aggregator,
                config.data.num_clients,
                config.runtime.agents,
                config.runtime.device,
                config.runtime.threads_per_agent,
                placement=config.agent_placement(),
            )
        try:
            if monitor:
                targets = cluster.metrics_targets()
                prometheus = Prometheus.start(out_dir / "monitor", targets, port=MONITOR_PORT, scrape_interval="2s")
                if interrupts is not None:
                    from fairfl.compose.interrupt import kill_processes

                    started = prometheus
                    interrupts.on_force(lambda: _killed("Prometheus", kill_processes([started.process])))
                print(describe(prometheus, targets), flush=True)
            with open_channel(aggregator, cluster.security if cluster.children else security) as channel:
                control = control_pb2_grpc.RunControlStub(channel)
                if interrupts is not None:
                    interrupts.running(lambda: _stop_run(control, run_id, f"interrupted ({interrupts.signal_name})"))
                try:
                    control.StartRun(
                        control_pb2.StartRunRequest(experiment_yaml=config.to_yaml(), run_id=run_id), timeout=30
                    )
                except grpc.RpcError as err:  # refused before round 1 (e.g. a model without the signature asked for)
                    if err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                        raise RunNotStarted(err.details()) from None
                    raise
                try:
                    # A remote aggregator may restart and resume the run; a local one is not restarted by anyone.
                    follow_run(control, run_id, recorder, reconnect_s=0.0 if cluster.children else 300.0)
                    if interrupts is not None:
                        interrupts.run_ended()
                    from fairfl.compose.model_cmd import MODEL_FILE_NAME, save_final_model

                    save_final_model(out_dir / MODEL_FILE_NAME, config, run_id, recorder.rounds, control=control)
                except KeyboardInterrupt:
                    control.StopRun(control_pb2.StopRunRequest(run_id=run_id, reason="interrupted"), timeout=10)
                    raise
            if after_run is not None:
                after_run()
        finally:
            if prometheus is not None:
                prometheus.stop()


def _stop_run(control: Any, run_id: str, reason: str) -> None:
    """StopRun; a run the aggregator does not know yet (StartRun still on its way) is asked again for a few seconds."""
    import grpc

    from fairfl.v1 import control_pb2

    for attempt in range(10):
        try:
            control.StopRun(control_pb2.StopRunRequest(run_id=run_id, reason=reason), timeout=10)
            return
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND or attempt == 9:
                raise RuntimeError(f"StopRun: {err.code().name}: {err.details()}") from None
            time.sleep(0.5)


def _killed(what: str, count: int) -> str | None:
    return f"killed {count} {what}{'es' if what == 'process' and count != 1 else ''}" if count else None


MONITOR_PORT = 9090  # Prometheus's usual port when free, so bookmarks keep working; any free port otherwise


def _hold(seconds: float | None, wake: threading.Event | None = None) -> None:
    """Keep services and Prometheus up after the run, for looking at the final state; a signal (`wake`) ends it."""
    if seconds == 0:
        return
    print(
        "monitoring: the run is over; services and Prometheus stay up "
        + ("until Ctrl-C" if seconds is None else f"for {seconds:g}s (Ctrl-C ends it sooner)"),
        flush=True,
    )
    try:
        if wake is not None:
            wake.wait(seconds)
            return
        if seconds is None:
            while True:
                time.sleep(3600)
        time.sleep(seconds)
    except KeyboardInterrupt:
        pass


def check_run_data(config: ExperimentConfig, remote: bool, keep: bool) -> None:
    """Split the run's data here once before anything starts, so that a split the data cannot hold (data.num_clients
    beyond the samples, a test_per_client the test set cannot give, ...) ends as a config error naming the field
    (fairfl.data.federated.DataConfigError) instead of failing in the engine or in every agent. Only central datasets
    are split here: a DataProvider builds its clients itself, and site data stays at the sites. `remote`: the agents
    of a running deployment load the data; it is checked only when it is here already (nothing is downloaded).
    `keep`: keep the loaded arrays cached (the in-process run loads them next)."""
    import dataclasses

    from fairfl.data.datasets import DatasetNotFoundError, clear_cache
    from fairfl.data.plugin import Dataset
    from fairfl.data.run import load_run_data, run_dataset

    plugin, _ = run_dataset(config.data)
    if not isinstance(plugin, Dataset) or getattr(plugin, "at_sites", False):
        return
    if remote and config.data.download:
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, download=False))
    try:
        load_run_data(config)
    except DatasetNotFoundError as err:
        if remote:
            return
        raise ConfigError(f"data.dataset: {err}") from None
    except ConfigError:
        raise
    except ValueError as err:  # unreadable files: the loader names them
        raise ConfigError(f"data.dataset: {config.data.dataset}: {err}") from None
    finally:
        if not keep:
            clear_cache()  # the agents hold the data; this process only checked it


def _write_plots(recorder: RunRecorder, out_dir: Path, title: str) -> None:
    """accuracy.png, variance.png and worst5.png (fairfl.compose.plots); a failure to draw is one warning line."""
    try:
        from fairfl.compose.plots import write_run_plots

        write_run_plots(recorder.rounds, out_dir, title)
    except Exception as err:  # plots are a convenience: the results files are written already
        print(f"warning: plots not written: {type(err).__name__}: {err}", file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    """`fairfl run`: SIGINT/SIGTERM are handled from here on (fairfl.compose.interrupt); exit 130 when one ended the
    run, or came before it started."""
    with Interrupts() as interrupts:
        try:
            return _cmd_run(args, interrupts)
        except Interrupted as err:  # before the run started: the processes started so far are stopped already
            print(f"\n{err.signal_name}: interrupted before the run started; nothing to write", file=sys.stderr)
            return EXIT_INTERRUPTED


def _cmd_run(args: argparse.Namespace, interrupts: Interrupts) -> int:
    try:
        overrides = _overrides(args.set)
        if args.rounds is not None:
            overrides["rounds"] = args.rounds
        config = load_experiment(args.config, overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        resume = _resumed_run(args, config) if args.resume else None
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    run_id = resume.run_id if resume else f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir = Path(args.output or Path(config.output_dir) / run_id)
    if args.monitor and (args.transport != "grpc" or args.aggregator):
        print(
            "error: --monitor watches the processes this command starts: use it with --transport grpc and without "
            "--aggregator",
            file=sys.stderr,
        )
        return 2
    security = None
    if args.tls_dir and not args.aggregator:
        from fairfl.rpc_security import TLS_DIR_ENV

        if args.tls_dir != os.environ.get(TLS_DIR_ENV, ""):  # given on the command line, not inherited
            print(
                "error: --tls-dir is the identity for reaching a running aggregator (--aggregator ADDR); a local run "
                "issues its own short-lived certificates",
                file=sys.stderr,
            )
            return 2
        print(f"note: {TLS_DIR_ENV} is set but this run starts its own services with their own certificates")
    if args.aggregator:  # a running deployment: its CA and an operator identity, or an explicit --insecure
        from fairfl.rpc_security import security_from_args

        try:
            security = security_from_args(args)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    if args.monitor:
        from fairfl.compose.monitor import INSTALL_HINT, prometheus_binary

        if prometheus_binary() is None:
            print(f"error: --monitor needs Prometheus: {INSTALL_HINT}", file=sys.stderr)
            return 2
    try:
        check_run_data(config, remote=bool(args.aggregator), keep=args.transport == "inprocess")
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return _run(args, config, run_id, out_dir, security, interrupts, resume)


def _resumed_run(args: argparse.Namespace, config: ExperimentConfig) -> Loaded:
    """`--resume`: the checkpoint of this experiment's interrupted in-process run; ValueError saying why none."""
    from fairfl.compose.resume import NothingToResume, find_resumable

    if args.transport != "inprocess":
        raise ValueError(
            "--resume continues an in-process run (--transport inprocess); a gRPC run resumes by itself when its "
            "aggregator restarts with the same --checkpoint-dir (docs/reliability.md)"
        )
    try:
        return find_resumable(config)
    except NothingToResume as err:
        raise ValueError(str(err)) from None


def _run(
    args: argparse.Namespace,
    config: ExperimentConfig,
    run_id: str,
    out_dir: Path,
    security: TransportSecurity | None,
    interrupts: Interrupts,
    resume: Loaded | None = None,
) -> int:
    """`fairfl run` once the inputs are checked; exit code 130 when a signal interrupted the run."""
    print(
        f"FairFL run {run_id}: {config.strategy.name} on {config.data.dataset}, {config.data.num_clients} clients, "
        f"{config.selection.clients_per_round}/round, {config.rounds} rounds, transport {args.transport}"
    )
    if resume is not None:
        print(f"resuming after round {resume.checkpoint.round} from the checkpoint in {resume.directory}/")
    recorder = RunRecorder(config)
    started = time.monotonic()
    result: dict[str, Any] = {}

    def extra() -> dict[str, Any]:
        out: dict[str, Any] = {"transport": args.transport, "wall_seconds": round(time.monotonic() - started, 3)}
        if resume is not None:  # wall_seconds: this invocation's, plus the earlier ones' round times
            out["resumed_after_round"] = resume.checkpoint.round
            out["wall_seconds"] = round(out["wall_seconds"] + sum(r.duration_seconds for r in resume.rounds), 3)
        if interrupts.interrupted:
            out["interrupted"] = {"signal": interrupts.signal_name, "forced": interrupts.forced}
            if not recorder.ended:  # forced out before the run said it ended
                out["state"] = "INTERRUPTED"
                out["message"] = f"interrupted by {interrupts.signal_name} before the run reported its end"
        return out

    def write_received() -> str | None:  # a forced stop: what was received, without waiting for anything
        if recorder.status is None and not recorder.rounds:
            return None  # the run had not started: nothing to write
        recorder.write(out_dir, extra())
        return f"{len(recorder.rounds)} completed rounds written to {out_dir}/"

    interrupts.on_force(write_received)

    def finish() -> None:
        wall = time.monotonic() - started
        summary = recorder.write(out_dir, extra())
        _write_plots(recorder, out_dir, f"{run_id}: {config.strategy.name} on {config.data.dataset}")
        print()
        print(recorder.fairness_table())
        if interrupts.interrupted:
            print(
                f"\n{interrupts.signal_name}: interrupted after {summary['rounds_completed']} completed rounds "
                f"({summary['state']}) in {wall:.1f}s; results in {out_dir}/",
                flush=True,
            )
            resumable = summary["state"] != "RUN_STATE_COMPLETED"
            if args.transport == "inprocess" and config.runtime.checkpoint_dir and resumable:
                print("the run is checkpointed: the same command with --resume continues it", flush=True)
        else:
            print(f"\n{summary['state']}: {summary['message']} in {wall:.1f}s; results in {out_dir}/", flush=True)
        result.update(summary)
        if args.monitor and not interrupts.interrupted:
            _hold(args.monitor_hold, interrupts.wake)

    try:
        if args.transport == "inprocess":
            run_inprocess(config, recorder, run_id, out_dir, interrupts, resume)
            finish()
        else:
            run_grpc(
                config,
                recorder,
                run_id,
                out_dir,
                args.aggregator,
                monitor=args.monitor,
                after_run=finish,
                tls=not args.insecure,
                security=security,
                interrupts=interrupts,
            )
    except RunNotStarted as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except MonitorError as err:  # Prometheus would not start; the services this command started are stopped
        print(f"error: --monitor: {err}", file=sys.stderr)
        return 2
    if interrupts.interrupted:
        return EXIT_INTERRUPTED
    return 0 if result.get("state") == "RUN_STATE_COMPLETED" else 1


def cmd_certs(args: argparse.Namespace) -> int:
    from fairfl import tls

    try:
        agents = []
        for spec in args.agent or ["agent"]:
            name, sep, ranges = spec.partition("=")
            if not name or "/" in name or name in (*tls.SERVICES, "operator", "ca"):
                raise tls.TlsError(f"--agent {spec!r}: the name must be a plain word other than a service's")
            agents.append((name, tls.parse_ranges(ranges) if sep else None))
        if args.days < 1:
            raise tls.TlsError(f"--days must be >= 1, got {args.days}")
        written = tls.write_deployment(
            args.out, args.namespace, args.cluster_domain, args.host, agents, args.days, args.force
        )
    except tls.TlsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"CA: {args.out / 'ca'} (keep ca.key offline: it signs new identities)")
    for name, directory in written.items():
        print(f"  {name:<12} {directory}/ (ca.crt, tls.crt, tls.key)")
    kept = sorted(p.parent.name for p in args.out.glob("*/tls.crt") if p.parent.name not in written)
    if kept:
        print(f"Kept as they were: {', '.join(kept)} (--force replaces every identity)")
    print("Kubernetes Secrets (docs/deploy.md):")
    for name, directory in written.items():
        if name != "operator":
            print(f"  kubectl -n {args.namespace} create secret generic fairfl-tls-{name} --from-file={directory}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import importlib

    module = {
        "aggregator": "aggregator_service.server",
        "clustering": "clustering_service.server",
        "privacy": "privacy_service.server",
        "agent": "client_agent.agent",
    }[args.component]
    return int(importlib.import_module(module).main(args.rest))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fairfl", description="Fair and private federated learning")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run an experiment from a YAML config")
    run.add_argument("config")
    run.add_argument(
        "--transport",
        choices=["grpc", "inprocess"],
        default="grpc",
        help="grpc: every service and agent as its own process (default); inprocess: one process",
    )
    run.add_argument("--rounds", type=int, help="override the number of rounds")
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set training.lr=0.05",
    )
    run.add_argument("--output", help="results directory (default: <output_dir>/<run id>)")
    run.add_argument(
        "--resume",
        action="store_true",
        help="with --transport inprocess: continue this experiment's interrupted, crashed or failed run from its "
        "checkpoint in runtime.checkpoint_dir (bit-identical to an uninterrupted run)",
    )
    run.add_argument("--aggregator", default="", help="use a running aggregator instead of starting services")
    run.add_argument(
        "--monitor",
        action="store_true",
        help="start a local Prometheus (Debian's prometheus) scraping every process, with FairFL's rules; "
        "print where to look",
    )
    run.add_argument(
        "--monitor-hold",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --monitor: keep services and Prometheus up this long after the run (default: until Ctrl-C)",
    )
    add_transport_arguments(run, server=False)
    run.set_defaults(func=cmd_run)
    certs = sub.add_parser(
        "certs",
        help="create a CA and mTLS certificates for the services, an operator and agents (local or Kubernetes)",
        description="Create (or extend) a FairFL CA in OUT/ca and one directory per identity (ca.crt, tls.crt, "
        "tls.key): aggregator, clustering and privacy (role service; SANs for loopback and the deploy/k8s Service "
        "names), operator (role service: for `fairfl run --aggregator`), and agents (role agent). Keep OUT/ca/ca.key "
        "offline; each identity directory is what one Kubernetes Secret holds (docs/deploy.md).",
    )
    certs.add_argument("out", type=Path, help="output directory")
    certs.add_argument(
        "--namespace", default="fairfl", help="Kubernetes namespace of the services (default %(default)s)"
    )
    certs.add_argument("--cluster-domain", default="cluster.local", help="cluster DNS domain (default %(default)s)")
    certs.add_argument(
        "--host", action="append", default=[], help="another DNS name or IP the services are reached at (repeatable)"
    )
    certs.add_argument(
        "--agent",
        action="append",
        default=[],
        metavar="NAME[=RANGES]",
        help="an agent identity, optionally limited to client ids (e.g. site-a=0-49); repeatable. Default: one "
        "identity `agent` that may host any client (what the Kubernetes agent StatefulSet shares)",
    )
    certs.add_argument("--days", type=int, default=365, help="validity of the certificates (default %(default)s)")
    certs.add_argument("--force", action="store_true", help="replace identities that already exist in OUT")
    certs.set_defaults(func=cmd_certs)
    serve = sub.add_parser("serve", help="run one component (aggregator, clustering, privacy, agent)")
    serve.add_argument("component", choices=["aggregator", "clustering", "privacy", "agent"])
    serve.add_argument("rest", nargs=argparse.REMAINDER, help="the component's own options")
    serve.set_defaults(func=cmd_serve)
    add_compare_parser(sub)
    from fairfl.compose.operate import add_runs_parser  # `fairfl runs list|status|watch|stop`

    add_runs_parser(sub)
    from fairfl.compose.model_cmd import add_model_parser  # `fairfl model export|fetch`

    add_model_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
