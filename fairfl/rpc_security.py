"""Transport security of a FairFL process: its mTLS material (or an explicit --insecure), the command-line options that
choose it, the process-wide security its channels dial with, and the verified identity of an RPC's caller.

A process gets its mTLS material from a directory (`--tls-dir`, env FAIRFL_TLS_DIR: ca.crt, tls.crt, tls.key, as
`fairfl certs` writes them) or runs plaintext only when told to (`--insecure`, env FAIRFL_INSECURE=1). A TLS server
requires and verifies a client certificate from the same CA in the handshake, so a caller without one, or with one
from another CA, never reaches a handler (grpcio reports that to the caller as UNAVAILABLE).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from fairfl import tls

TLS_DIR_ENV = "FAIRFL_TLS_DIR"
INSECURE_ENV = "FAIRFL_INSECURE"
HEALTH_BIND_ENV = "FAIRFL_HEALTH_BIND"


@dataclass(frozen=True)
class TransportSecurity:
    """One process's mTLS material: the deployment CA and this process's certificate and key (PEM)."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    source: str = ""  # where it was read from, for messages

    @classmethod
    def from_dir(cls, directory: str | Path) -> TransportSecurity:
        """Read ca.crt, tls.crt and tls.key from `directory`; ValueError naming what is missing."""
        path = Path(directory)
        files = {name: path / name for name in (tls.CA_CERT, tls.CERT, tls.KEY)}
        missing = [str(f) for f in files.values() if not f.is_file()]
        if missing:
            raise ValueError(
                f"TLS directory {path} lacks {', '.join(missing)}; create certificates with `fairfl certs` "
                "(or run plaintext with --insecure)"
            )
        security = cls(*(files[n].read_bytes() for n in (tls.CA_CERT, tls.CERT, tls.KEY)), source=str(path))
        try:
            security.identity  # noqa: B018 - fail at start-up, not at the first call, on a certificate that is no identity
        except tls.TlsError as err:
            raise ValueError(f"{files[tls.CERT]}: {err}") from err
        return security

    @classmethod
    def from_issued(cls, issued: tls.Issued) -> TransportSecurity:
        return cls(issued.ca_pem, issued.cert_pem, issued.key_pem, source=issued.name)

    @property
    def identity(self) -> tls.Identity:
        return tls.identity_of(self.cert_pem)

    def server_credentials(self) -> grpc.ServerCredentials:
        # require_client_auth: the handshake itself refuses callers without a certificate from this CA.
        return grpc.ssl_server_credentials(
            [(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca_pem, self.key_pem, self.cert_pem)


def add_transport_arguments(parser: argparse.ArgumentParser, server: bool = True) -> None:
    """The shared options that choose mTLS or plaintext (and, for servers, the plaintext health port)."""
    parser.add_argument(
        "--tls-dir",
        default=os.environ.get(TLS_DIR_ENV, ""),
        help=f"directory with ca.crt, tls.crt and tls.key (from `fairfl certs`): mutual TLS on every connection "
        f"(env {TLS_DIR_ENV})",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=os.environ.get(INSECURE_ENV, "").lower() in ("1", "true", "yes"),
        help=f"plaintext gRPC without authentication: only on a trusted network (env {INSECURE_ENV}=1)",
    )
    if server:
        parser.add_argument(
            "--health-bind",
            default=os.environ.get(HEALTH_BIND_ENV, ""),
            help="also serve grpc.health.v1 alone, in plaintext, on this host:port, for probes that cannot do mTLS "
            f"(Kubernetes' native gRPC probes; env {HEALTH_BIND_ENV})",
        )


def security_from_args(args: argparse.Namespace) -> TransportSecurity | None:
    """The process's security as its options say: TLS material, or None for an explicit --insecure.

    Raises ValueError when neither or both are given: plaintext is never a silent default.
    """
    if args.tls_dir and args.insecure:
        raise ValueError("choose either --tls-dir (mutual TLS) or --insecure (plaintext), not both")
    if args.insecure:
        return None
    if not args.tls_dir:
        raise ValueError(
            f"no TLS material: pass --tls-dir DIR (env {TLS_DIR_ENV}; create it with `fairfl certs`), or --insecure "
            f"(env {INSECURE_ENV}=1) to run plaintext on a trusted network"
        )
    return TransportSecurity.from_dir(args.tls_dir)


def transport_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TransportSecurity | None:
    """security_from_args for an entry point: a usage error (exit 2) with the reason instead of a traceback; the
    result becomes the process's channel security (use_security)."""
    try:
        security = security_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    use_security(security)
    return security


_process_security: TransportSecurity | None = None


def use_security(security: TransportSecurity | None) -> None:
    """Make `security` this process's identity for every channel it opens (service and agent entry points call this
    once, after security_from_args), so peers added anywhere in a service dial with the same mTLS material."""
    global _process_security
    _process_security = security


def process_security() -> TransportSecurity | None:
    """The security set by use_security (None: plaintext, or not set)."""
    return _process_security


def caller(context: grpc.ServicerContext) -> tls.Identity | None:
    """The verified identity of the caller of an RPC on a TLS server; None on a plaintext server."""
    pem = context.auth_context().get("x509_pem_cert")
    return tls.identity_of(pem[0]) if pem else None


def principal(context: grpc.ServicerContext) -> str:
    """A stable key for the caller: its certificate fingerprint, or "" on a plaintext server (everyone alike)."""
    identity = caller(context)
    return identity.fingerprint if identity is not None else ""
