"""deploy/docker/Dockerfile builds what the manifests run: parsed (no Docker engine needed) and compared with the
project (packages, console script, dataset path) and with the rendered manifests (user, entrypoint, ports, writable
paths, image names). The cross-checks with the manifests need kubectl and skip without it."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

from fairfl.data.datasets import DEBIAN_FASHION_MNIST_DIR
from tests.k8s_support import (
    DOCKERFILE,
    OVERLAYS,
    REPO,
    Dockerfile,
    Stage,
    by_component,
    env_of,
    parse_dockerfile,
    render_overlay,
    workloads,
)

RUNTIMES = ("runtime", "runtime-cuda")
BUILD_TOOLS = ("gcc", "g++", "build-essential", "make", "python3-dev", "python3-pip", "pip install", "git")
VENV = "/opt/fairfl/venv"


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse_dockerfile()


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _user(stage: Stage) -> tuple[int, int]:
    user, _, group = stage.last("USER").partition(":")
    assert user.isdigit() and group.isdigit(), "numeric USER, so runAsNonRoot can verify it"
    return int(user), int(group)


def test_targets_cpu_by_default_and_cuda_by_name(dockerfile: Dockerfile) -> None:
    assert dockerfile.stages[-1].name == "runtime", "the default target (last stage) is the CPU image"
    assert dockerfile.root_image("runtime").startswith("python:3.11")  # the version the project is tested on
    assert dockerfile.root_image("runtime-cuda").startswith("nvidia/cuda:") and "runtime" in dockerfile.root_image(
        "runtime-cuda"
    )
    assert "--target runtime-cuda" in DOCKERFILE.read_text()


def test_runtime_images_agree_with_each_other(dockerfile: Dockerfile) -> None:
    cpu, cuda = (dockerfile.stage(n) for n in RUNTIMES)
    for op in ("USER", "WORKDIR", "EXPOSE", "ENTRYPOINT", "CMD"):
        assert cpu.last(op) == cuda.last(op), op
    assert cpu.env() == cuda.env()


def test_runtime_has_no_build_tools(dockerfile: Dockerfile) -> None:
    for name in RUNTIMES:
        stage = dockerfile.stage(name)
        for run in stage.all("RUN"):
            assert not any(tool in run for tool in BUILD_TOOLS), (name, run)
        venv_sources = [flags.get("from") for flags, sources, _ in stage.copies() if VENV in sources]
        (builder,) = venv_sources
        # The virtualenv's interpreter links into its base image: builder and runtime share the base.
        assert dockerfile.root_image(builder) == dockerfile.root_image(name)
        assert re.search(rf"build-venv\.sh {VENV}\b", " ".join(dockerfile.stage(builder).all("RUN")))
    script = (REPO / "deploy" / "docker" / "build-venv.sh").read_text()
    assert "pip uninstall --yes pip" in script, "no installer left in the runtime virtualenv"
    assert "--constraint requirements.txt ." in script, "pinned versions, runtime dependencies only"


def test_every_project_package_is_copied_and_not_ignored(dockerfile: Dockerfile) -> None:
    include = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()}
    wanted = {p for p in packages if any(fnmatch.fnmatch(p, pattern) for pattern in include)}
    copied = {src for _, sources, _ in dockerfile.stage("source").copies() for src in sources}
    assert wanted <= copied, f"packages missing from the image: {wanted - copied}"
    for src in copied:
        assert (REPO / src).exists(), src
    ignore = (REPO / "deploy" / "docker" / "Dockerfile.dockerignore").read_text().split()
    for src in copied:  # each source is re-included after the leading `**`
        assert f"!{src}" in ignore or f"!{src}/**" in ignore, src
    readme = _pyproject()["project"]["readme"]
    assert readme in copied, "setuptools reads the readme while building"


def test_entrypoint_is_the_project_cli(dockerfile: Dockerfile) -> None:
    stage = dockerfile.stage("runtime")
    (script,) = _pyproject()["project"]["scripts"]
    assert stage.exec_form("ENTRYPOINT") == [script] == ["fairfl"]
    assert stage.env()["PATH"].split(":")[0] == f"{VENV}/bin", "the console script is on PATH"


def test_dataset_lands_where_the_code_looks(dockerfile: Dockerfile) -> None:
    path = str(DEBIAN_FASHION_MNIST_DIR)
    assert any("dataset-fashion-mnist" in run for run in dockerfile.stage("dataset").all("RUN"))
    for name in RUNTIMES:
        assert ({"from": "dataset"}, [path], path) in dockerfile.stage(name).copies(), name


# ---------------------------------------------------------------------------------------- against the manifests


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> list[dict]:
    return render_overlay(request.param)


def test_manifests_run_as_the_image_user(dockerfile: Dockerfile, overlay: list[dict]) -> None:
    uid, gid = _user(dockerfile.stage("runtime"))
    assert uid != 0
    for w in workloads(overlay):
        sc = w.pod_spec["securityContext"]
        assert (sc["runAsUser"], sc["runAsGroup"], sc["fsGroup"]) == (uid, gid, gid), w.name
    runs = " ".join(dockerfile.stage("runtime").all("RUN"))
    assert f"--uid {uid}" in runs and f"--gid {gid}" in runs


def test_manifests_run_the_entrypoint(dockerfile: Dockerfile, overlay: list[dict]) -> None:
    for w in workloads(overlay):
        for c in w.containers:
            assert c["command"] == dockerfile.stage("runtime").exec_form("ENTRYPOINT"), w.name


def test_exposed_ports_are_the_container_ports(dockerfile: Dockerfile, overlay: list[dict]) -> None:
    exposed = {int(p.split("/")[0]) for p in dockerfile.stage("runtime").last("EXPOSE").split()}
    used = {p["containerPort"] for w in workloads(overlay) for c in w.containers for p in c.get("ports", [])}
    assert used == exposed


def test_writable_paths_exist_in_the_image(dockerfile: Dockerfile, overlay: list[dict]) -> None:
    stage = dockerfile.stage("runtime")
    runs = " ".join(stage.all("RUN"))
    created = set(re.findall(r"install -d -o \d+ -g \d+ ((?:/\S+ ?)+)", runs)[0].split())
    home, workdir = stage.env()["HOME"], stage.last("WORKDIR")
    assert f"--home-dir {home}" in runs and workdir == home
    for w in workloads(overlay):
        for c in w.containers:
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert home in mounts and "/tmp" in mounts, w.name
            assert "workingDir" not in c or c["workingDir"] == workdir
            for path in mounts - {home, "/tmp"}:  # volumes live under directories the image owns
                assert any(path == d or path.startswith(d + "/") for d in created), (w.name, path)
            for key, value in env_of(c).items():
                if value.startswith("/"):  # a mounted directory itself (FAIRFL_TLS_DIR) or a path inside one
                    inside = any(value == m or value.startswith(m.rstrip("/") + "/") for m in mounts)
                    assert inside, (w.name, key, value)


def test_manifest_images_are_this_version(overlay: list[dict]) -> None:
    version = _pyproject()["project"]["version"]
    comp = by_component(overlay)
    for name, w in comp.items():
        image = w.container["image"]
        expected = "fairfl-cuda" if image.startswith("fairfl-cuda") else "fairfl"
        assert image == f"{expected}:{version}", (name, image)
        assert expected == "fairfl" or name == "agent", "only agents use the CUDA image"
    docs = (REPO / "docs" / "deploy.md").read_text()
    assert f"-t fairfl:{version}" in docs and f"--target runtime-cuda -t fairfl-cuda:{version}" in docs


def test_dockerfile_parser_handles_continuations(tmp_path: Path) -> None:
    path = tmp_path / "Dockerfile"
    path.write_text('ARG A=x:1\nFROM ${A} AS one\nRUN a \\\n    # note\n    && b\nENV K=v \\\n    L="w z"\n')
    parsed = parse_dockerfile(path)
    (stage,) = parsed.stages
    assert parsed.root_image("one") == "x:1"
    assert stage.all("RUN") == ["a && b"]
    assert stage.env() == {"K": "v", "L": "w z"}
