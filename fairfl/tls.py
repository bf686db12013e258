"""Certificates for FairFL's mutual TLS: one CA per deployment, and the identities it signs.

An identity is an X.509 certificate signed by the deployment's CA:

- subject CN = the identity's name (`aggregator`, `agent-0`, ...), subject OU = its role: `service` (the aggregator,
  clustering and privacy services, and operators who drive runs) or `agent` (client agents);
- services carry DNS/IP SANs (loopback and the Kubernetes Service names) and may act as TLS servers and clients;
  agents only as TLS clients (extended key usage clientAuth);
- an agent certificate may name the logical clients it may host in a URI SAN `urn:fairfl:clients:0-49,60` (absent:
  any client), so a client's identity is bound to the certificate of the agent that hosts it.

Servers verify every peer against the CA (fairfl.rpc), read the role and clients from the peer certificate
(`identity_of`), and refuse what that identity may not do. `fairfl certs` writes a CA and one directory per identity,
each holding `ca.crt`, `tls.crt` and `tls.key`: the layout of a Kubernetes Secret made with `--from-file`.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import ipaddress
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

ROLE_SERVICE = "service"
ROLE_AGENT = "agent"
ROLES = (ROLE_SERVICE, ROLE_AGENT)
CLIENTS_URI = "urn:fairfl:clients:"
CA_CERT = "ca.crt"
CERT = "tls.crt"
KEY = "tls.key"
CA_KEY = "ca.key"
DEFAULT_DAYS = 365
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# The services as deploy/k8s names them, and the identities `fairfl certs` writes for a deployment.
SERVICES = ("aggregator", "clustering", "privacy")
STATEFUL = {"aggregator", "privacy"}  # StatefulSets: their pods also get per-pod DNS names


class TlsError(ValueError):
    """Certificate material is missing, unreadable or not a FairFL identity."""


# -- identities as servers see them ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """Who a peer certificate says the caller is."""

    name: str
    role: str
    fingerprint: str  # sha256 of the certificate (DER), hex
    clients: tuple[tuple[int, int], ...] | None  # inclusive ranges of logical client ids; None = any client

    def describe(self) -> str:
        return f"{self.role} certificate {self.name!r} (sha256 {self.fingerprint[:12]})"

    def unauthorized(self, client_ids: Sequence[int]) -> list[int]:
        """The ids among `client_ids` this identity may not host (sorted, at most 10)."""
        if self.clients is None:
            return []
        ids = np.asarray(client_ids, dtype=np.int64)
        allowed = np.zeros(ids.shape, dtype=bool)
        for lo, hi in self.clients:
            allowed |= (ids >= lo) & (ids <= hi)
        return sorted(int(i) for i in np.unique(ids[~allowed])[:10])


def format_ranges(ranges: Iterable[tuple[int, int]]) -> str:
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ranges)


def parse_ranges(text: str) -> tuple[tuple[int, int], ...]:
    """'0-49,60' → ((0, 49), (60, 60)); raises TlsError on anything else."""
    out = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise TlsError(f"bad client range {part!r}: use forms like 0-49 or 3,7,9")
        start, end = int(lo), int(hi) if sep else int(lo)
        if end < start:
            raise TlsError(f"bad client range {part!r}: start > end")
        out.append((start, end))
    return tuple(sorted(out))


@functools.lru_cache(maxsize=4096)
def identity_of(cert_pem: bytes) -> Identity:
    """The identity a (CA-verified) peer certificate carries; cached, since every RPC of a connection asks."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as err:
        raise TlsError(f"unreadable peer certificate: {err}") from err
    cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ou = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    clients: tuple[tuple[int, int], ...] | None = None
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.UniformResourceIdentifier
        )
    except x509.ExtensionNotFound:
        uris = []
    for uri in uris:
        if uri.startswith(CLIENTS_URI):
            clients = parse_ranges(uri[len(CLIENTS_URI) :])
    return Identity(
        name=str(cn[0].value) if cn else "",
        role=str(ou[0].value) if ou else "",
        fingerprint=hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest(),
        clients=clients,
    )


# -- issuing ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Issued:
    """One identity's PEM material, with the CA certificate that verifies its peers."""

    name: str
    role: str
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    def write(self, directory: Path) -> Path:
        """Write ca.crt, tls.crt and tls.key (0600) into `directory`."""
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CA_CERT).write_bytes(self.ca_pem)
        (directory / CERT).write_bytes(self.cert_pem)
        _write_private(directory / KEY, self.key_pem)
        return directory


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())  # P-256: fast handshakes, supported by every gRPC TLS stack


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class CertificateAuthority:
    """A deployment's CA: signs service and agent identities."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.cert = cert
        self.key = key

    @classmethod
    def create(cls, name: str = "FairFL CA", days: int = DEFAULT_DAYS) -> CertificateAuthority:
        key = _new_key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate small clock skew between hosts
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @classmethod
    def load(cls, directory: Path) -> CertificateAuthority:
        try:
            cert = x509.load_pem_x509_certificate((directory / CA_CERT).read_bytes())
            key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), password=None)
        except (OSError, ValueError) as err:
            raise TlsError(f"cannot load the CA from {directory}: {err}") from err
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise TlsError(f"{directory / CA_KEY}: expected an EC private key")
        return cls(cert, key)

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CA_CERT).write_bytes(self.pem)
        _write_private(directory / CA_KEY, _key_pem(self.key))

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self,
        name: str,
        role: str,
        hosts: Sequence[str] = (),
        clients: Sequence[tuple[int, int]] | None = None,
        days: int = DEFAULT_DAYS,
    ) -> Issued:
        """A certificate for `name` with `role`; `hosts` (DNS names or IPs) make it usable by a server."""
        if role not in ROLES:
            raise TlsError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        if clients is not None and role != ROLE_AGENT:
            raise TlsError("only agent certificates name the clients they may host")
        key = _new_key()
        sans: list[x509.GeneralName] = []
        for host in dict.fromkeys(hosts):
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        if clients is not None:
            sans.append(x509.UniformResourceIdentifier(CLIENTS_URI + format_ranges(clients)))
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if hosts else [])
        now = _now()
        builder = (
            x509.CertificateBuilder()
            .subject_name(
                x509.Name(
                    [
                        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "FairFL"),
                        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                        x509.NameAttribute(NameOID.COMMON_NAME, name),
                    ]
                )
            )
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(min(now + datetime.timedelta(days=days), self.cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return Issued(name, role, self.pem, cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


# -- the identities of a deployment ------------------------------------------------------------------------------------


def k8s_hosts(component: str, namespace: str = "fairfl", cluster_domain: str = "cluster.local") -> list[str]:
    """DNS names deploy/k8s gives a service: `fairfl-<c>` in every qualified form, and its StatefulSet pod's name."""
    service = f"fairfl-{component}"
    names = [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.{cluster_domain}",
    ]
    if component in STATEFUL:  # the headless Service's pod record: fairfl-aggregator-0.fairfl-aggregator...
        names += [f"{service}-0.{service}.{namespace}.svc", f"{service}-0.{service}.{namespace}.svc.{cluster_domain}"]
    return names


def write_deployment(
    out: Path,
    namespace: str = "fairfl",
    cluster_domain: str = "cluster.local",
    extra_hosts: Sequence[str] = (),
    agents: Sequence[tuple[str, tuple[tuple[int, int], ...] | None]] = (("agent", None),),
    days: int = DEFAULT_DAYS,
    force: bool = False,
) -> dict[str, Path]:
    """A CA (created, or reused from out/ca) and one directory per identity: the services, `operator` (a service
    identity for people and scripts that drive runs) and the given agents. Identities already in `out` are kept, so a
    new agent can be added to a deployment; naming an existing agent again needs `force`, which replaces every
    identity (renewal). Returns identity name -> directory of those written."""
    ca_dir = out / "ca"
    if (ca_dir / CA_CERT).exists():
        ca = CertificateAuthority.load(ca_dir)
    else:
        ca = CertificateAuthority.create(days=max(days, DEFAULT_DAYS))
        ca.save(ca_dir)
    plan: list[tuple[str, str, list[str], tuple[tuple[int, int], ...] | None]] = [
        (c, ROLE_SERVICE, [*LOOPBACK_HOSTS, *k8s_hosts(c, namespace, cluster_domain), *extra_hosts], None)
        for c in SERVICES
    ]
    plan.append(("operator", ROLE_SERVICE, [], None))
    plan += [(name, ROLE_AGENT, [], clients) for name, clients in agents]
    existing = {name for name, *_ in plan if (out / name / CERT).exists()}
    asked_again = [name for name, _ in agents if name in existing]
    if asked_again and not force:
        raise TlsError(
            f"{out} already holds certificates for {', '.join(asked_again)}; pass --force to replace them (a new "
            "agent's name adds it beside the existing identities)"
        )
    written = {}
    for name, role, hosts, clients in plan:
        if name in existing and not force:  # the services and operator of the deployment already there: kept
            continue
        written[name] = ca.issue(name, role, hosts, clients, days).write(out / name)
    return written


class LocalCertificates:
    """An ephemeral CA for one local run: its key stays in memory, identities are written under `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.ca = CertificateAuthority.create(name="FairFL ephemeral CA", days=30)

    def issue(self, name: str, role: str, clients: Sequence[tuple[int, int]] | None = None) -> Path:
        hosts = LOOPBACK_HOSTS if role == ROLE_SERVICE else ()
        return self.ca.issue(name, role, hosts, clients, days=30).write(self.directory / name)
