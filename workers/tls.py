"""Mutual TLS for gRPC between the control plane and agents (and agent to agent, for link
measurement), under one cluster CA. Plaintext is allowed only to and on loopback; the node
token stays as a second factor on every call.

Files come from LLAMAFLEET_TLS_CA, LLAMAFLEET_TLS_CERT and LLAMAFLEET_TLS_KEY (PEM paths).
`python -m workers pki ...` makes a CA and certificates; `make run` makes a local one in
var/pki. Each certificate is good for both ends (serverAuth and clientAuth), so one file set
serves an agent's server and its calls to other agents.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import grpc


class PlaintextRefused(grpc.RpcError):
    """gRPC without TLS to or on a non-loopback address. Raised where a call would be made, as
    an RpcError with code UNAVAILABLE, so callers treat it as an agent they cannot reach."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self.message

    def trailing_metadata(self):
        return ()


@dataclass(frozen=True)
class TLSFiles:
    ca: str
    cert: str
    key: str

    @classmethod
    def from_env(cls, env=os.environ) -> TLSFiles | None:
        paths = [env.get(f"LLAMAFLEET_TLS_{n}", "") for n in ("CA", "CERT", "KEY")]
        if not any(paths):
            return None
        if not all(paths):
            raise RuntimeError(
                "set all of LLAMAFLEET_TLS_CA, LLAMAFLEET_TLS_CERT, LLAMAFLEET_TLS_KEY"
            )
        return cls(*paths)

    def read(self) -> tuple[bytes, bytes, bytes]:
        return Path(self.ca).read_bytes(), Path(self.cert).read_bytes(), Path(self.key).read_bytes()


def is_loopback(address: str) -> bool:
    """Whether host:port names this machine only (localhost or a loopback IP)."""
    host = address.rpartition(":")[0].strip("[]") if ":" in address else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _refuse(address: str, what: str) -> PlaintextRefused:
    return PlaintextRefused(
        f"plaintext gRPC {what} {address} is refused: it is not a loopback address. Give the "
        "cluster's TLS files (LLAMAFLEET_TLS_CA, LLAMAFLEET_TLS_CERT, LLAMAFLEET_TLS_KEY; "
        "`python -m workers pki --help` makes them)"
    )


def server_credentials(files: TLSFiles) -> grpc.ServerCredentials:
    ca, cert, key = files.read()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=True
    )


def add_port(server, address: str, files: TLSFiles | None) -> int:
    """Bind a gRPC server: mutual TLS with files, plaintext only on loopback."""
    if files is not None:
        return server.add_secure_port(address, server_credentials(files))
    if not is_loopback(address):
        raise _refuse(address, "on")
    return server.add_insecure_port(address)


def channel(address: str, files: TLSFiles | None, *, aio: bool = False, options=()):
    """A channel to an agent: mutual TLS with files, plaintext only to loopback. A refused
    plaintext channel raises PlaintextRefused (grpc.aio.AioRpcError for aio), before any byte,
    and so before the node token, leaves this machine."""
    mod = grpc.aio if aio else grpc
    if files is None:
        if not is_loopback(address):
            refused = _refuse(address, "to")
            if aio:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.aio.Metadata(),
                    grpc.aio.Metadata(),
                    details=refused.message,
                )
            raise refused
        return mod.insecure_channel(address, options=list(options))
    ca, cert, key = files.read()
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )
    return mod.secure_channel(address, creds, options=list(options))


# ---- a small PKI ---------------------------------------------------------------------------


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_ca(directory: Path, name: str = "LlamaFleet cluster CA", days: int = 3650) -> None:
    """ca.pem and ca-key.pem (0600) in directory, unless they exist."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    if (directory / "ca.pem").exists():
        return
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    _write(
        directory / "ca-key.pem",
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        private=True,
    )
    _write(directory / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))


def issue(directory: Path, name: str, hosts: list[str], days: int = 825) -> TLSFiles:
    """<name>.pem and <name>-key.pem signed by the CA in directory, for the given host names
    and addresses (subjectAltName), good as server and as client."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((directory / "ca-key.pem").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for h in dict.fromkeys(hosts):
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            alt.append(x509.DNSName(h))
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write(
        directory / f"{name}-key.pem",
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        private=True,
    )
    _write(directory / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM))
    return TLSFiles(
        str(directory / "ca.pem"),
        str(directory / f"{name}.pem"),
        str(directory / f"{name}-key.pem"),
    )
