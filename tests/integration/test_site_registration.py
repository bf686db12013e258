"""Sites registering for a run whose data is at the sites, with real processes over mutual TLS: an aggregator, a
clustering and a privacy service, two agents serving their own files (`--data`: .npz and CSV), and scripted sites
speaking raw fairfl.v1 RegisterRequests.

A site whose data does not fit the run (feature count, class count, no data at all) is refused with
FAILED_PRECONDITION naming the site (agent and certificate) and the field, and counted; one that registered before
the run started is dropped when it starts and refused when it comes back. The run goes on with the fitting sites and
completes. The services never open a site file: an audit hook in each service process (a sitecustomize on their
PYTHONPATH only) records every open under the sites' directory, and records nothing but its own probe.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from fairfl.compose.launcher import Child, LocalCluster
from fairfl.config import ExperimentConfig, experiment_from_dict
from fairfl.rpc_channel import open_channel
from fairfl.tls import ROLE_AGENT
from fairfl.v1 import control_pb2, control_pb2_grpc, federation_pb2, federation_pb2_grpc
from tests.federation_support import REPO, call, metric

pytestmark = pytest.mark.integration

RUN_ID = "sites"
FEATURES = [f"f{i}" for i in range(8)]
CLASSES = 3
REGISTER_TIMEOUT_S = 10.0  # the run waits this long for the refused site's clients, then goes on without them

AUDIT_HOOK = '''"""Audit hook of test_site_registration.py: records every open under a watched directory."""
import os
import sys

_WATCH = os.environ.get("FAIRFL_TEST_WATCH_DIR", "")
_LOG = os.environ.get("FAIRFL_TEST_AUDIT_LOG", "")


def _record(line):
    with open(_LOG, "a") as out:
        out.write(line + "\\n")


def _hook(event, args):
    if event != "open" or not args or isinstance(args[0], int):
        return
    try:
        path = os.path.abspath(os.fsdecode(args[0]))
    except (TypeError, ValueError):
        return
    if path == _WATCH or path.startswith(_WATCH + os.sep):
        _record(f"open {os.getpid()} {path}")


if _WATCH and _LOG:
    _WATCH = os.path.abspath(_WATCH)
    _record(f"installed {os.getpid()}")
    sys.addaudithook(_hook)
    with open(os.path.join(_WATCH, ".probe")) as probe:  # the hook's own check that it sees opens
        probe.read()
'''


def _config(num_clients: int) -> ExperimentConfig:
    return experiment_from_dict(
        {
            "name": "sites",
            "seed": 3,
            "rounds": 3,
            "data": {
                "dataset": "site",
                "num_clients": num_clients,
                "params": {"input_shape": [len(FEATURES)], "num_classes": CLASSES, "feature_names": FEATURES},
            },
            "model": {"name": "mlp", "params": {"hidden": [16]}},
            "training": {"local_steps": 5, "batch_size": 16, "lr": 0.1},
            "selection": {"clients_per_round": 4},
            "evaluation": {"every": 1},
            "runtime": {"agents": 2, "round_timeout_s": 60, "register_timeout_s": REGISTER_TIMEOUT_S},
        }
    )


def _blobs(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Three separable Gaussian blobs in len(FEATURES) dimensions."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, n).astype(np.int64)
    centres = np.eye(CLASSES, len(FEATURES), dtype=np.float32) * 3.0
    return (centres[y] + rng.standard_normal((n, len(FEATURES))).astype(np.float32)), y


def _write_sites(root: Path) -> tuple[Path, Path]:
    """site-a: one .npz per client; site-b: one CSV per client with named feature columns and a label column."""
    npz, csv = root / "site-a", root / "site-b"
    npz.mkdir(parents=True)
    csv.mkdir(parents=True)
    for k in range(2):
        x, y = _blobs(k, 120)
        np.savez(npz / f"client{k}.npz", x=x, y=y)
        x, y = _blobs(10 + k, 100)
        rows = [",".join([*FEATURES, "label"])]
        rows += [",".join([*(f"{v:.6f}" for v in x[i]), str(int(y[i]))]) for i in range(len(y))]
        (csv / f"client{k}.csv").write_text("\n".join(rows) + "\n")
    (root / ".probe").write_text("probe\n")
    return npz, csv


def _request(
    name: str, clients: list[int], shape: list[int] | None, classes: int = CLASSES
) -> federation_pb2.RegisterRequest:
    request = federation_pb2.RegisterRequest(agent_name=name, client_ids=clients, device="cpu", version="test")
    if shape is not None:
        request.data_signature.CopyFrom(federation_pb2.DataSignature(input_shape=shape, num_classes=classes))
        request.client_data.extend(federation_pb2.ClientData(client_id=c, num_train=50, num_test=10) for c in clients)
    return request


def _site_agent(cluster: LocalCluster, aggregator: Child, name: str, clients: tuple[int, int], data: Path) -> Child:
    lo, hi = clients
    return cluster.spawn(
        name,
        "client_agent",
        [
            *("--aggregator", aggregator.address, "--clients", f"{lo}-{hi}", "--data", str(data), "--name", name),
            *("--device", "cpu", "--threads", "1"),
        ],
        announce=False,  # started side by side; the run waits for their registrations
        role=ROLE_AGENT,
        clients=[clients],
    )


def test_misfit_sites_are_refused_and_the_run_goes_on_with_the_others(tmp_path: Path) -> None:
    sites = tmp_path / "sites"
    npz, csv = _write_sites(sites)
    hook_dir, audit = tmp_path / "hook", tmp_path / "audit.log"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(AUDIT_HOOK)
    config = _config(num_clients=6)  # clients 4-5 belong to the site that is refused
    with LocalCluster(tmp_path / "logs") as cluster:
        with pytest.MonkeyPatch.context() as mp:  # the services' environment only: the agents read their data
            mp.setenv("PYTHONPATH", os.pathsep.join([str(hook_dir), str(REPO)]))
            mp.setenv("FAIRFL_TEST_WATCH_DIR", str(sites))
            mp.setenv("FAIRFL_TEST_AUDIT_LOG", str(audit))
            mp.chdir(REPO)
            aggregator, clustering, privacy = cluster.start_services(tmp_path)
        _site_agent(cluster, aggregator, "site-a", (0, 1), npz)
        _site_agent(cluster, aggregator, "site-b", (2, 3), csv)
        late = cluster.issue("site-c", ROLE_AGENT, [(4, 5)])
        with open_channel(aggregator.address, late) as late_channel:
            late_site = federation_pb2_grpc.FederationStub(late_channel)
            # Before the run: nothing to check against, so a site with too many classes gets in...
            code, _, early = call(late_site.Register, _request("early-bad", [4, 5], [8], classes=5))
            assert code == grpc.StatusCode.OK
            with cluster.open_channel(aggregator.address) as channel:
                control = control_pb2_grpc.RunControlStub(channel)
                control.StartRun(
                    control_pb2.StartRunRequest(experiment_yaml=config.to_yaml(), run_id=RUN_ID), timeout=30
                )
                # ...and is dropped when the run starts: it must register again, and is refused then.
                deadline = time.monotonic() + 20
                while late_site.Heartbeat(federation_pb2.HeartbeatRequest(agent_id=early.agent_id), timeout=10).known:
                    assert time.monotonic() < deadline, "the misfit registered before the run was not dropped"
                    time.sleep(0.1)
                code, details, _ = call(late_site.Register, _request("early-bad", [4, 5], [8], classes=5))
                assert code == grpc.StatusCode.FAILED_PRECONDITION
                assert details == (
                    f"site 'early-bad' (certificate 'site-c') refused for run {RUN_ID}: data_signature.num_classes "
                    "is 5, the run expects at most 3 (labels 0..2)"
                )
                code, details, _ = call(late_site.Register, _request("wrong-features", [4, 5], [6]))
                assert code == grpc.StatusCode.FAILED_PRECONDITION
                assert details == (
                    f"site 'wrong-features' (certificate 'site-c') refused for run {RUN_ID}: "
                    "data_signature.input_shape is [6], the run expects [8] (8 features)"
                )
                code, details, _ = call(late_site.Register, _request("no-data", [4, 5], None))
                assert code == grpc.StatusCode.FAILED_PRECONDITION
                assert details.startswith(f"site 'no-data' (certificate 'site-c') refused for run {RUN_ID}: ")
                assert "start the agent with `--data SPEC`" in details
                events = list(control.WatchRun(control_pb2.WatchRunRequest(run_id=RUN_ID), timeout=300))
        refused = {
            reason: metric(aggregator, "fairfl_requests_refused_total", service="fairfl.v1.Federation", reason=reason)
            for reason in ("data_signature", "no_data_signature")
        }

    final = [e.status for e in events if e.HasField("status")][-1]
    assert final.state == control_pb2.RUN_STATE_COMPLETED, final.message
    rounds = [e.round for e in events if e.HasField("round")]
    assert [r.round for r in rounds] == [1, 2, 3]
    assert all(set(r.selected) <= {0, 1, 2, 3} for r in rounds)
    last = rounds[-1]
    assert sorted(c.client_id for c in last.clients) == [0, 1, 2, 3]
    assert last.fairness.missing_clients == 2  # the refused site's clients 4-5
    assert last.fairness.mean > 60.0  # the fitting sites trained the model on their own data
    assert refused == {"data_signature": 2.0, "no_data_signature": 1.0}

    log = aggregator.log_path.read_text()
    assert "site 'site-a' (certificate 'site-a'): 2 clients, 192 train samples" in log  # 120 rows, 20% test each
    assert "site 'site-b' (certificate 'site-b'): 2 clients, 160 train samples" in log
    assert "site 'early-bad' (certificate 'site-c') refused for run sites: data_signature.num_classes is 5" in log
    assert "its registration is dropped" in log
    assert (
        "within 10s; going on without clients 4-5; refused sites: 'early-bad' (certificate 'site-c') (data_signature)"
        in log
    )
    assert f"run {RUN_ID} round 3/3: " in log and "accuracy mean " in log

    # The services opened no site file: each hook installed itself and saw only its own probe.
    lines = audit.read_text().splitlines()
    services = {aggregator.process.pid, clustering.process.pid, privacy.process.pid}
    assert {int(line.split()[1]) for line in lines if line.startswith("installed ")} == services
    opened = [line for line in lines if line.startswith("open ")]
    assert {(int(line.split()[1]), line.split(maxsplit=2)[2]) for line in opened} == {
        (pid, str(sites / ".probe")) for pid in services
    }
