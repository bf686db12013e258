"""Client agent: dials out to the aggregator, hosts many logical clients, and trains them on its device.

The loop is register → long-poll tasks → fetch the model by sha256 (cached) → run the local procedure → send the
result back (client_agent.uploads). Any connection failure leads to a re-registration with exponential backoff, so an
agent survives aggregator restarts and network blips without losing its clients.

With `--data SPEC` (env FAIRFL_DATA) the agent serves its clients from data only it holds (fairfl.data.site): it
opens the site at start, reports the data's signature and each client's sample counts in every registration, and
serves runs whose dataset is at the sites (`data.dataset: site`) from it; the aggregator never learns a path. A
registration the aggregator refuses (FAILED_PRECONDITION: the site's data does not fit the run) is said once and
tried again every REFUSED_RETRY_S.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator

import grpc
import numpy as np
import torch

from client_agent.dp_sgd import DpPolicy, PolicyRefusal
from client_agent.faults import DropPlan
from client_agent.trainer import ClientRuntime, LocalData, resolve_device
from client_agent.uploads import BUSY_RETRY_PAUSES_S, ResultUploader
from fairfl import __version__, codec, fetch, framing, telemetry, tls
from fairfl.announce import announcement
from fairfl.config import ConfigError, ExperimentConfig, experiment_from_yaml
from fairfl.data import DataSignature, FederatedData, load_run_data, resolve_dataset, run_signature
from fairfl.data.site import SiteData, SiteDataError, open_site
from fairfl.logs import add_log_format_argument, configure_logging
from fairfl.privacy import RANDOMNESS, RANDOMNESS_ENV, check_randomness
from fairfl.protocol import ClientResult
from fairfl.rpc import INLINE_BLOB_BYTES, SHORT_DEADLINE, TRANSFER_DEADLINE
from fairfl.rpc_channel import open_channel
from fairfl.rpc_refusals import refused_as_busy
from fairfl.rpc_security import TransportSecurity, add_transport_arguments, transport_from_args
from fairfl.v1 import federation_pb2, federation_pb2_grpc, tensor_pb2

log = logging.getLogger(__name__)

FEDERATION = federation_pb2.DESCRIPTOR.services_by_name["Federation"].full_name
MODEL_CACHE_SIZE = 4
MAX_TASKS_PER_POLL = 64
STOP_CHECK_S = 0.2  # how often a waiting long poll looks whether the agent was told to stop
STOP_GRACE_S = 10.0  # how long a stopping agent waits for its last result to be answered
FETCH_STREAMS = fetch.FETCH_STREAMS  # concurrent FetchBlob range streams for one large model
REFUSED_RETRY_S = 30.0  # a refused registration (the site's data does not fit the run) is tried again this often
DATA_ENV = "FAIRFL_DATA"


def parse_client_ids(text: str) -> list[int]:
    """'0-49' or '0-9,20,30-39' → sorted unique ids: the range syntax of agent certificates (fairfl.tls); raises
    ValueError."""
    if not text.strip():
        raise ValueError("no client ids given")
    ranges = tls.parse_ranges(text)
    return np.unique(np.concatenate([np.arange(lo, hi + 1) for lo, hi in ranges])).tolist()


class Agent:
    def __init__(
        self,
        aggregator: str,
        client_ids: list[int],
        device: str = "auto",
        name: str = "",
        dp_policy: DpPolicy | None = None,
        dp_randomness: str = "secure",
        security: TransportSecurity | None = None,
        faults: DropPlan | None = None,
        shared: bool = False,
        site: SiteData | None = None,
    ) -> None:
        self.client_ids = client_ids
        self.site = site  # the data this agent holds (--data), or None: simulations only
        self.shared = shared  # co-hosts its clients with other agents (simulations: runtime.placement replicated)
        self.faults = faults  # tests only: clients that drop out of each round
        # The DP releases of the newest round with their tasks: a task sent again (the aggregator restarted and
        # re-runs the round it had authorised) gets the same release back instead of fresh noise
        # (docs/reliability.md). Only that round can come again, so older releases (whole updates) are dropped.
        self.released: dict[int, tuple[bytes, ClientResult]] = {}
        self.released_round = 0
        self.dp_policy = dp_policy or DpPolicy()  # the weakest DP this agent's owner accepts
        self.dp_randomness = check_randomness(dp_randomness)
        self.device = resolve_device(device)
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.channel = open_channel(aggregator, security)  # mTLS as this agent's certificate, unless --insecure
        self.tls = security is not None
        self.stub = federation_pb2_grpc.FederationStub(self.channel)
        # FetchBlob's data chunks are read as views of the received messages, same wire format (fairfl.framing).
        self._fetch_blob = self.channel.unary_stream(
            f"/{FEDERATION}/FetchBlob",
            request_serializer=tensor_pb2.BlobRef.SerializeToString,
            response_deserializer=framing.chunk_parser(tensor_pb2.Chunk),
        )
        self.uploads = ResultUploader(self.channel, self.stub, tls=self.tls)
        self.agent_id = ""
        self.runtimes: dict[str, ClientRuntime] = {}
        # Runs this agent cannot take part in (a plug-in it cannot import, data that does not fit): said once.
        self.unusable: dict[str, str] = {}
        self.models: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.stop = threading.Event()
        telemetry.AGENT_CLIENTS.set(len(client_ids))

    # -- connection ---------------------------------------------------------------------------------------------

    def register_request(self) -> federation_pb2.RegisterRequest:
        """This agent's registration: its clients and, for a site, its data's signature and sample counts."""
        request = federation_pb2.RegisterRequest(
            agent_name=self.name,
            client_ids=self.client_ids,
            device=str(self.device),
            version=__version__,
            shared=self.shared,
        )
        if self.site is not None:
            request.data_signature.CopyFrom(signature_message(self.site.signature))
            for cid in self.client_ids:
                split = self.site.clients[cid]
                request.client_data.add(client_id=cid, num_train=len(split.train), num_test=len(split.test))
        return request

    def _register(self) -> None:
        backoff = 0.1
        refused = ""  # the aggregator's last refusal, said once
        while not self.stop.is_set():
            try:
                reply = self.stub.Register(self.register_request(), timeout=SHORT_DEADLINE, wait_for_ready=True)
                self.agent_id = reply.agent_id
                telemetry.AGENT_REGISTRATIONS.inc()
                self.heartbeat_interval = reply.heartbeat_interval_seconds or 5.0
                self.poll_wait = reply.poll_wait_seconds or 10.0
                log.info("registered as %s with %d clients on %s", self.agent_id[:8], len(self.client_ids), self.device)
                return
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.FAILED_PRECONDITION:  # the site's data does not fit the run
                    if err.details() != refused:
                        refused = err.details() or ""
                        log.error(
                            "registration refused (FAILED_PRECONDITION): %s (trying again every %.0fs)",
                            refused,
                            REFUSED_RETRY_S,
                        )
                    self.stop.wait(REFUSED_RETRY_S)
                    continue
                # Jittered: agents cut off by one aggregator restart must not all come back in lockstep.
                pause = backoff * random.uniform(0.5, 1.0)
                log.warning("register failed (%s); retrying in %.1fs", err.code().name, pause)
                self.stop.wait(pause)
                backoff = min(backoff * 2, 10.0)

    def _heartbeats(self) -> None:
        # Until the first registration tells the interval, look often: the aggregator may expect one soon.
        while not self.stop.wait(getattr(self, "heartbeat_interval", 0.2)):
            if not self.agent_id:
                continue
            sent_for = self.agent_id
            try:
                reply = self.stub.Heartbeat(federation_pb2.HeartbeatRequest(agent_id=sent_for), timeout=SHORT_DEADLINE)
                if not reply.known and self.agent_id == sent_for:  # a late answer must not undo a newer registration
                    self.agent_id = ""  # the poll loop re-registers
            except grpc.RpcError:
                pass  # the poll loop handles reconnection

    def run(self) -> None:
        threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True).start()
        while not self.stop.is_set():
            if not self.agent_id:
                self._register()
                continue
            self.uploads.finish()  # a batch's results are answered before asking for more work
            polled = time.monotonic()
            try:
                reply = self._poll()
            except grpc.FutureCancelledError:  # stopping: the long poll was given up
                break
            except grpc.RpcError as err:
                if refused_as_busy(err):  # over this certificate's share of calls: still registered, ask again soon
                    log.info("poll refused as busy (%s); polling again shortly", err.details())
                    self.stop.wait(random.uniform(0.2, 1.0))
                    continue
                # The aggregator restarted or is unreachable: register again (its clients resume with this agent).
                log.warning("poll failed (%s: %s); re-registering", err.code().name, err.details())
                self.agent_id = ""
                self.stop.wait(random.uniform(0.1, 0.5))
                continue
            if not reply.tasks and time.monotonic() - polled < self.poll_wait / 2:
                self.stop.wait(random.uniform(0.2, 1.0))  # answered at once: the aggregator has no worker to spare
            if reply.blobs and reply.tasks:
                self._take_inline(reply.tasks[0].run_id, reply.blobs)
            for task in reply.tasks:
                if self.stop.is_set():
                    break
                self._handle(task)
            self.uploads.flush_batch()
        self.uploads.finish(timeout=STOP_GRACE_S)  # stopping: inside a pod's termination grace period
        self.uploads.close()

    def _poll(self) -> federation_pb2.PollReply:
        """One long poll, given up (cancelled) as soon as the agent is told to stop rather than at its end."""
        call = self.stub.PollTasks.future(
            federation_pb2.PollRequest(
                agent_id=self.agent_id,
                max_tasks=MAX_TASKS_PER_POLL,
                wait_seconds=self.poll_wait,
                inline_blob_bytes=INLINE_BLOB_BYTES,
                cached_sha256=list(self.models),
            ),
            timeout=self.poll_wait + SHORT_DEADLINE,
        )
        answered = threading.Event()
        call.add_done_callback(lambda _call: answered.set())
        while not answered.wait(STOP_CHECK_S):
            if self.stop.is_set():
                call.cancel()
                break
        return call.result()

    # -- tasks --------------------------------------------------------------------------------------------------

    def _runtime(self, run_id: str) -> ClientRuntime:
        runtime = self.runtimes.get(run_id)
        if run_id in self.unusable:
            raise RunUnusable(self.unusable[run_id])
        if runtime is None:
            spec = self.stub.GetRunSpec(federation_pb2.RunSpecRequest(run_id=run_id), timeout=SHORT_DEADLINE)
            try:
                config = experiment_from_yaml(spec.experiment_yaml)
                if getattr(resolve_dataset(config.data.dataset), "at_sites", False):
                    data: LocalData | FederatedData = self._site_data(config)
                    num_clients = config.data.num_clients
                elif self.site is not None:  # a site's agent trains on its own data only, never on a run's dataset
                    raise ConfigError(
                        f"data.dataset {config.data.dataset!r}: this agent serves its site's own data (--data) and "
                        "takes part only in runs whose data is at the sites (data.dataset: site)"
                    )
                else:
                    data = load_run_data(config)
                    num_clients = data.num_clients
                hosted = [c for c in self.client_ids if c < num_clients]
                runtime = ClientRuntime(
                    config, data, hosted, self.device, self._fetch_model, self.dp_policy, self.dp_randomness
                )
            except ConfigError as err:  # e.g. the run names a plug-in this agent's environment cannot import
                self.unusable = {run_id: str(err)}
                log.error("run %s cannot run on this agent: %s", run_id, err)
                raise RunUnusable(str(err)) from None
            self.runtimes = {run_id: runtime}  # one run at a time: drop older runs' data
            self.models.clear()
            self.released.clear()
            self.released_round = 0
            log.info("prepared run %s: %d local clients", run_id, len(hosted))
        return runtime

    def _site_data(self, config: ExperimentConfig) -> LocalData:
        """A run whose data is at the sites: this agent's own clients, for the model of the run's declared signature
        (ConfigError when this agent holds no site data or its data cannot feed that model)."""
        if self.site is None:
            raise ConfigError(
                f"data.dataset {config.data.dataset!r}: the run's data is at the sites and this agent holds none; "
                f"start it with --data SPEC (env {DATA_ENV})"
            )
        expected, held = run_signature(config), self.site.signature
        if held.input_shape != expected.input_shape:
            raise ConfigError(
                f"data.params.input_shape: the run expects {list(expected.input_shape)}, this site's data (--data) "
                f"has {list(held.input_shape)}"
            )
        if held.num_classes > expected.num_classes:
            raise ConfigError(
                f"data.params.num_classes: the run expects at most {expected.num_classes} classes, this site's data "
                f"(--data) has {held.num_classes}"
            )
        return LocalData(expected, self.site.clients)

    def _take_inline(self, run_id: str, blobs: Iterable[federation_pb2.InlineBlob]) -> None:
        """Cache the models a poll reply carried, checked as a fetch checks them; one that fails is left to
        FetchBlob (the task fetches it and fails there if it is really bad)."""
        try:
            runtime = self._runtime(run_id)
        except RunUnusable:  # said once already
            return
        except (grpc.RpcError, ValueError) as err:  # the task itself reports this
            log.warning("run %s not prepared for inline models: %s", run_id, err)
            return
        for blob in blobs:
            sha256, total = blob.header.sha256, blob.header.total_bytes
            if sha256 in self.models:
                continue
            self._make_room()
            try:
                if self.tls:  # one message over mutual TLS: its bytes are authenticated already (docs/security.md)
                    self.models[sha256] = _inline_model(blob, runtime)
                else:
                    parts = [tensor_pb2.Chunk(header=blob.header), tensor_pb2.Chunk(data=blob.data)]
                    self.models[sha256] = self._receive_model(lambda _o, _l, p=parts: iter(p), total, sha256, runtime)
            except codec.CodecError as err:
                log.warning("inline model %s… refused (%s); fetching it instead", sha256[:12], err)
                continue
            telemetry.AGENT_MODEL_FETCHES.labels("inline").inc()

    def _receive_model(
        self, open_range: fetch.RangeOpener, total_bytes: int, sha256: str, runtime: ClientRuntime
    ) -> torch.Tensor:
        """A model's payload (a large one as byte ranges on concurrent streams, hashed as it lands), checked against
        its sha256 and the run's layout (fetch.fetch_ranges)."""
        _, buffer = fetch.fetch_ranges(
            open_range,
            total_bytes,
            sha256,
            lambda header: runtime.layout.check_specs(list(header.tensors)),
            max_bytes=runtime.layout.nbytes,
            streams=FETCH_STREAMS,
        )
        telemetry.AGENT_RECEIVED_BYTES.inc(len(buffer))
        return torch.frombuffer(buffer, dtype=torch.float32) if len(buffer) else torch.empty(0)

    def _make_room(self) -> None:
        """Evict the least recently used models past the cache size, before a receive: their buffers can be reused."""
        while len(self.models) >= MODEL_CACHE_SIZE:
            self.models.popitem(last=False)

    def _fetch_model(self, ref: tensor_pb2.BlobRef) -> torch.Tensor:
        cached = self.models.get(ref.sha256)
        if cached is not None:
            self.models.move_to_end(ref.sha256)
            telemetry.AGENT_MODEL_FETCHES.labels("hit").inc()
            return cached
        telemetry.AGENT_MODEL_FETCHES.labels("miss").inc()

        def open_range(offset: int, length: int) -> Iterator[tensor_pb2.Chunk]:
            request = tensor_pb2.BlobRef(sha256=ref.sha256, total_bytes=ref.total_bytes, offset=offset, length=length)
            return self._fetch_blob(request, timeout=TRANSFER_DEADLINE)  # the call itself: a failed fetch cancels it

        self._make_room()
        runtime = next(iter(self.runtimes.values()))
        for pause in (*BUSY_RETRY_PAUSES_S, None):
            try:
                flat = self._receive_model(open_range, ref.total_bytes, ref.sha256, runtime)
                break
            except grpc.RpcError as err:  # a fetch refused as busy read nothing: fetch again after a pause
                if pause is None or not refused_as_busy(err):
                    raise
                log.info("model fetch refused as busy (%s); fetching again in %.2fs", err.details(), pause)
                time.sleep(pause)
        self.models[ref.sha256] = flat
        return flat

    def _result(self, runtime: ClientRuntime, task: federation_pb2.Task) -> ClientResult:
        if not (task.WhichOneof("config") == "train" and task.train.HasField("dp")):
            return runtime.run(task)
        if self.shared and self.dp_randomness != "task":
            # The same-release guarantee below holds per agent: a re-sent task may reach another co-host, which would
            # draw fresh noise: a second release the ledger never counted.
            raise PolicyRefusal(
                "this agent co-hosts its clients (--shared-clients) and draws DP noise from the OS: a task re-sent "
                "after an aggregator restart could reach another host and release fresh noise; host DP clients on one "
                "agent each (runtime.placement: partitioned) or use --dp-randomness task for simulations"
            )
        same = federation_pb2.Task()
        same.CopyFrom(task)
        same.ClearField("deadline_unix")  # a re-sent task differs only in its deadline
        key = same.SerializeToString(deterministic=True)
        if task.round > self.released_round:
            self.released.clear()
            self.released_round = task.round
        released = self.released.get(task.client_id)
        if released is not None and released[0] == key:
            log.info("task %s was answered before: sending the same DP release again", task.task_id)
            return released[1]
        result = runtime.run(task)
        self.released[task.client_id] = (key, result)
        return result

    def _handle(self, task: federation_pb2.Task) -> None:
        phase = _PHASES.get(task.phase, "other")
        started = time.perf_counter()
        try:
            runtime = self._runtime(task.run_id)
            if self.faults is not None and task.client_id in self.faults.dropped(sorted(runtime.clients), task.round):
                log.info("fault injection: client %d drops out of round %d", task.client_id, task.round)
                return
            result = self._result(runtime, task)
        except PolicyRefusal as err:  # nothing is computed or sent; the round closes without this client
            log.error("task %s refused by this agent's privacy policy: %s", task.task_id, err)
            telemetry.AGENT_TASKS.labels(phase, "failed").inc()
            return
        except RunUnusable:  # said once, when the run was prepared; its tasks close at their deadline
            telemetry.AGENT_TASKS.labels(phase, "failed").inc()
            return
        except ConfigError as err:  # e.g. a local procedure this agent cannot import: one line, no traceback
            log.error("task %s cannot run here: %s", task.task_id, err)
            telemetry.AGENT_TASKS.labels(phase, "failed").inc()
            return
        except Exception:  # a failing task must not kill the agent; the round closes at its deadline
            log.exception("task %s failed", task.task_id)
            telemetry.AGENT_TASKS.labels(phase, "failed").inc()
            return
        telemetry.AGENT_TASK_DURATION.labels(phase).observe(time.perf_counter() - started)
        result.agent_id = self.agent_id
        self.uploads.send(task.task_id, phase, result, runtime)


class RunUnusable(Exception):
    """This agent cannot take part in a run (its config names what this environment cannot load); said once."""


def signature_message(signature: DataSignature) -> federation_pb2.DataSignature:
    """A DataSignature as the registration carries it (feature names only when the data has them)."""
    return federation_pb2.DataSignature(
        input_shape=list(signature.input_shape),
        num_classes=signature.num_classes,
        feature_names=list(signature.feature_names or ()),
    )


def _inline_model(blob: federation_pb2.InlineBlob, runtime: ClientRuntime) -> torch.Tensor:
    """An inline model checked for its size, digest format and the run's layout, not hashed again (its reply came over
    mutual TLS); copied out of the reply, which it outlives, into writable memory."""
    header = blob.header
    codec.check_sha256(header.sha256)  # the cache key
    data = blob.data  # read once: each read of a bytes field is a fresh copy of the whole model
    if header.total_bytes != len(data) or header.total_bytes != runtime.layout.nbytes:
        raise codec.CodecError(
            f"inline model declares {header.total_bytes} bytes, carries {len(data)}; the run's model has "
            f"{runtime.layout.nbytes}",
            "size",
        )
    runtime.layout.check_specs(list(header.tensors))
    telemetry.AGENT_RECEIVED_BYTES.inc(len(data))
    return torch.frombuffer(bytearray(data), dtype=torch.float32)


_PHASES = {
    federation_pb2.PHASE_TRAIN: "train",
    federation_pb2.PHASE_PROBE: "probe",
    federation_pb2.PHASE_EVALUATE: "evaluate",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="client_agent", description="FairFL client agent")
    parser.add_argument("--aggregator", default=os.environ.get("FAIRFL_AGGREGATOR_ADDRESS", "127.0.0.1:50051"))
    parser.add_argument(
        "--clients", default=os.environ.get("FAIRFL_CLIENTS", ""), help="logical client ids, e.g. 0-49 or 0-9,20"
    )
    parser.add_argument(
        "--clients-per-agent",
        type=int,
        default=int(os.environ.get("FAIRFL_CLIENTS_PER_AGENT", "0")),
        help="derive the range from the pod ordinal (StatefulSet): ordinal*N .. ordinal*N+N-1",
    )
    parser.add_argument(
        "--shared-clients",
        action="store_true",
        default=os.environ.get("FAIRFL_SHARED_CLIENTS", "") == "1",
        help="co-host the client ids with other agents that say so (simulations: every agent holds the whole "
        "federated dataset; each task goes to the least-loaded host); env FAIRFL_SHARED_CLIENTS=1",
    )
    parser.add_argument(
        "--data",
        default=os.environ.get(DATA_ENV, ""),
        metavar="SPEC",
        help="serve the clients from this site's own data: a directory of per-client files, one table with "
        "client_column=..., or a data provider module:attr, then key=value options (docs/federation.md); "
        f"env {DATA_ENV}",
    )
    parser.add_argument("--device", default=os.environ.get("FAIRFL_DEVICE", "auto"))
    parser.add_argument("--threads", type=int, default=int(os.environ.get("FAIRFL_THREADS", "1")))
    parser.add_argument("--name", default=os.environ.get("FAIRFL_AGENT_NAME", ""))
    parser.add_argument("--log-level", default=os.environ.get("FAIRFL_LOG_LEVEL", "INFO"))
    add_log_format_argument(parser)
    parser.add_argument(
        "--dp-randomness",
        choices=RANDOMNESS,
        default=os.environ.get(RANDOMNESS_ENV, "secure"),
        help="DP sampling and noise from the OS (secure, default) or from the task seed (task: reproducible "
        f"simulations only; the server knows the seed); env {RANDOMNESS_ENV}",
    )
    DpPolicy.add_arguments(parser)
    DropPlan.add_arguments(parser)
    telemetry.add_metrics_arguments(parser)
    add_transport_arguments(parser, server=False)
    args = parser.parse_args(argv)
    try:
        configure_logging(args.log_level, args.log_format)
    except ValueError as err:  # FAIRFL_LOG_FORMAT names another format
        parser.error(str(err))
    security = transport_from_args(parser, args)
    if args.clients_per_agent and not args.clients:
        ordinal = int(socket.gethostname().rsplit("-", 1)[-1])
        args.clients = f"{ordinal * args.clients_per_agent}-{(ordinal + 1) * args.clients_per_agent - 1}"
    try:
        client_ids = parse_client_ids(args.clients)
        policy = DpPolicy.from_args(args)
        faults = DropPlan.from_args(args)
    except ValueError as err:
        parser.error(str(err))
    site = None
    if args.data:
        try:
            site = open_site(args.data, client_ids)
        except SiteDataError as err:
            print(f"{parser.prog}: --data: {err}", file=sys.stderr)
            return 2
        except Exception as err:  # a reader's own failure (an undecodable image, an unreadable file): one line
            print(
                f"{parser.prog}: --data {args.data}: cannot read the site's data: {type(err).__name__}: {err}",
                file=sys.stderr,
            )
            return 2
        signature = site.signature
        log.info(
            "site data: %d clients, input shape %s, %d classes",
            len(site.clients),
            list(signature.input_shape),
            signature.num_classes,
        )
    torch.set_num_threads(max(1, args.threads))
    try:
        metrics = telemetry.start_from_args(args, "agent")
    except OSError as err:
        log.error("cannot start the client agent: %s", err)
        return 1
    if metrics is not None:  # launchers read the metrics port from this line
        print(announcement(None, metrics), flush=True)
    agent = Agent(
        args.aggregator,
        client_ids,
        args.device,
        args.name,
        policy,
        args.dp_randomness,
        security,
        faults,
        shared=args.shared_clients,
        site=site,
    )

    import signal

    def _stop(signum: int, _frame: object) -> None:
        agent.stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
