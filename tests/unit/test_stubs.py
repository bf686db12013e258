"""The committed gRPC stubs in fairfl/v1 are exactly what grpc_tools.protoc generates from protos/fairfl/v1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_DIR = REPO / "protos" / "fairfl" / "v1"
STUB_DIR = REPO / "fairfl" / "v1"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
FIX = "run `make protos` and commit the regenerated files in fairfl/v1"


def _protos() -> list[Path]:
    protos = sorted(PROTO_DIR.glob("*.proto"))
    assert protos, f"no .proto files under {PROTO_DIR}"
    return protos


def _generate(out: Path) -> Path:
    """Run the same protoc command as `make protos`, writing into `out`; return the generated fairfl/v1 folder."""
    command = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-Iprotos",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--pyi_out={out}",
        *(str(p.relative_to(REPO)) for p in _protos()),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"grpc_tools.protoc failed ({done.returncode}):\n{done.stderr}"
    return out / "fairfl" / "v1"


def _proto_stem(stub_name: str) -> str:
    return next(stub_name.removesuffix(s) for s in SUFFIXES if stub_name.endswith(s))


def _stub_names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file() and p.name.endswith(SUFFIXES)}


def test_committed_stubs_match_the_protos(tmp_path: Path) -> None:
    generated = _generate(tmp_path)
    expected = {f"{p.stem}{suffix}" for p in _protos() for suffix in SUFFIXES}
    assert _stub_names(generated) == expected  # protoc's own output is what we think it is

    missing = sorted(expected - _stub_names(STUB_DIR))
    assert not missing, f"stubs missing from fairfl/v1: {', '.join(missing)}; {FIX}"

    stale = sorted(
        name for name in sorted(expected) if (generated / name).read_bytes() != (STUB_DIR / name).read_bytes()
    )
    assert not stale, f"committed stubs differ from the protos: {', '.join(stale)}; {FIX}"


def test_no_committed_stub_lacks_a_proto() -> None:
    protos = {p.stem for p in _protos()}
    orphans = sorted(name for name in _stub_names(STUB_DIR) if _proto_stem(name) not in protos)
    assert not orphans, (
        f"stubs in fairfl/v1 without a proto in protos/fairfl/v1: {', '.join(orphans)}; "
        "delete them or restore their protos, then run `make protos`"
    )


def test_stubs_import_and_match_their_descriptors() -> None:
    import importlib

    for proto in _protos():
        module = importlib.import_module(f"fairfl.v1.{proto.stem}_pb2")
        assert module.DESCRIPTOR.name == f"fairfl/v1/{proto.name}"
        assert module.DESCRIPTOR.package == "fairfl.v1"
        importlib.import_module(f"fairfl.v1.{proto.stem}_pb2_grpc")
