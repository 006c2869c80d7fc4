"""Certificates and SuperNode keys for a Flower federation (TLS and SuperNode authentication).

``python -m fedgalore.flower.certs DIR --host NAME ... --node SITE ...`` writes, into ``DIR``:

* with ``--host`` (on the SuperLink's machine): a self-signed CA (``ca.crt``, ``ca.key``) and the
  SuperLink's certificate and key (``server.pem``, ``server.key``) signed by it, valid for every
  ``--host`` given *and* ``127.0.0.1`` / ``localhost`` — the SuperLink's own SuperExec talks to
  it on 127.0.0.1, so those must be in the certificate even when the nodes use a public name;
* with ``--node SITE`` (on that site's machine): the SuperNode's authentication key pair,
  ``SITE.key`` (EC P-384, OpenSSH private key: ``flower-supernode --auth-supernode-private-key``)
  and ``SITE.pub`` (OpenSSH public key: ``flwr supernode register SITE.pub ...``).

Existing files are never overwritten (one line says which and what to do). For a test or a
consortium without a CA of its own; in production use your organisation's CA. The SuperNodes
need only ``ca.crt``; ``ca.key`` and ``server.key`` stay on the SuperLink's machine, and each
``SITE.key`` on its site's. See examples/flower/README.md.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import ipaddress
import os
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["make_certificates", "make_node_key", "main"]

#: names the SuperLink's certificate is always valid for (its SuperExec connects on 127.0.0.1)
LOCAL_HOSTS = ("127.0.0.1", "localhost")


class CertError(ValueError):
    """A certificate or key could not be written; the message is one line saying why."""


def _free(paths: Sequence[Path]) -> None:
    taken = [str(p) for p in paths if p.exists()]
    if taken:
        raise CertError(f"{', '.join(taken)} already exist(s); remove them or write into another folder")


def _write(path: Path, data: bytes, private: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _san(hosts: Sequence[str]):
    from cryptography import x509

    names, seen = [], set()
    for h in [*hosts, *LOCAL_HOSTS]:
        if h in seen:
            continue
        seen.add(h)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def make_certificates(out: str | Path, hosts: Sequence[str] = (), days: int = 365) -> dict[str, Path]:
    """Write a CA and a SuperLink certificate valid for ``hosts`` (plus 127.0.0.1 and localhost)
    into ``out``: ``{"ca": ca.crt, "ca_key": ca.key, "cert": server.pem, "key": server.key}``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(out)
    paths = {"ca": out / "ca.crt", "ca_key": out / "ca.key", "cert": out / "server.pem", "key": out / "server.key"}
    _free(list(paths.values()))
    now = _dt.datetime.now(_dt.timezone.utc) - _dt.timedelta(minutes=5)
    until = now + _dt.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedgalore federation CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(until)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))

    key = ec.generate_private_key(ec.SECP384R1())
    cn = (list(hosts) or [LOCAL_HOSTS[0]])[0]
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(until)
            .add_extension(_san(hosts), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))

    pem = serialization.Encoding.PEM
    plain = serialization.NoEncryption()
    _write(paths["ca"], ca.public_bytes(pem), private=False)
    _write(paths["ca_key"], ca_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, plain), private=True)
    _write(paths["cert"], cert.public_bytes(pem), private=False)
    _write(paths["key"], key.private_bytes(pem, serialization.PrivateFormat.PKCS8, plain), private=True)
    return paths


def make_node_key(out: str | Path, name: str) -> tuple[Path, Path]:
    """Write SuperNode ``name``'s authentication key pair into ``out``: ``(NAME.key, NAME.pub)``,
    an EC P-384 key in OpenSSH format (what flower-supernode and ``flwr supernode register`` read)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    if not name or "/" in name or name.startswith("."):
        raise CertError(f"--node {name!r}: give a plain name (it names the files NAME.key and NAME.pub)")
    out = Path(out)
    priv, pub = out / f"{name}.key", out / f"{name}.pub"
    _free([priv, pub])
    key = ec.generate_private_key(ec.SECP384R1())
    _write(priv, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                   serialization.NoEncryption()), private=True)
    _write(pub, key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + b"\n",
           private=False)
    return priv, pub


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedgalore.flower.certs DIR [--host NAME ...] [--node SITE ...]`` (module doc)."""
    p = argparse.ArgumentParser(prog="python -m fedgalore.flower.certs",
                                description="Write a CA + SuperLink certificate (--host) and SuperNode key pairs (--node).")
    p.add_argument("dir", help="folder to write into (created if missing)")
    p.add_argument("--host", action="append", default=[],
                   help="a name or IP the SuperNodes reach the SuperLink by (repeat; 127.0.0.1 and localhost are always added)")
    p.add_argument("--node", action="append", default=[], help="a SuperNode's name: writes NAME.key and NAME.pub (repeat)")
    p.add_argument("--days", type=int, default=365, help="validity of the certificates in days (default 365)")
    p.add_argument("--local", action="store_true", help="write the CA and a certificate for 127.0.0.1/localhost only")
    args = p.parse_args(argv)
    if not (args.host or args.local or args.node):
        p.error("nothing to write: give --host NAME (or --local) for the certificates and/or --node SITE for node keys")
    try:
        if args.host or args.local:
            paths = make_certificates(args.dir, args.host, args.days)
            print(f"wrote {paths['ca']}, {paths['cert']}, {paths['key']} (valid for "
                  f"{', '.join(dict.fromkeys([*args.host, *LOCAL_HOSTS]))}) and {paths['ca_key']} (keep it private)")
        for name in args.node:
            priv, pub = make_node_key(args.dir, name)
            print(f"wrote {priv} (stays on the node) and {pub} (register it: flwr supernode register {pub} <superlink>)")
    except CertError as exc:
        print(f"fedgalore: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
