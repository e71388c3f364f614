"""
The cluster's certificates, made with C{cryptography}: one CA, a serving
certificate for the API server and one for the kubelet, a client
certificate for each identity (the authorizers read the subject: C{CN} is
the user, C{O} the groups), and the service account signing key.  Short
lived (a day): nothing outlives the session.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import attrs
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key_pem(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM,
                             serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@attrs.frozen
class Pair:
    cert: Path
    key: Path


@attrs.define
class Pki:
    directory: Path
    ca: Pair = attrs.field(init=False)
    _ca_key: ec.EllipticCurvePrivateKey = attrs.field(init=False)
    _ca_cert: x509.Certificate = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hostpid-cluster-ca")])
        now = datetime.datetime.now(datetime.UTC)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(
                    digital_signature=True, key_cert_sign=True, crl_sign=True,
                    content_commitment=False, key_encipherment=False,
                    data_encipherment=False, key_agreement=False, encipher_only=False,
                    decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        self._ca_key, self._ca_cert = key, cert
        self.ca = self._write("ca", cert, key)

    def _write(self, name: str, cert: x509.Certificate,
               key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> Pair:
        pair = Pair(self.directory / f"{name}.crt", self.directory / f"{name}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pair.key.touch(mode=0o600)
        pair.key.write_bytes(_key_pem(key))
        return pair

    def issue(self, name: str, common_name: str, organizations: tuple[str, ...] = (),
              dns: tuple[str, ...] = (), ips: tuple[str, ...] = (),
              server: bool = False, client: bool = False) -> Pair:
        key = ec.generate_private_key(ec.SECP256R1())
        attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        now = datetime.datetime.now(datetime.UTC)
        usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
            [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
        builder = (x509.CertificateBuilder().subject_name(x509.Name(attributes))
                   .issuer_name(self._ca_cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                  critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
        alternative: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        alternative += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        if alternative:
            builder = builder.add_extension(x509.SubjectAlternativeName(alternative),
                                            critical=False)
        return self._write(name, builder.sign(self._ca_key, hashes.SHA256()), key)

    def service_account_key(self) -> Pair:
        """The service account token signing key (RSA, as every issuer accepts)."""
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        pair = Pair(self.directory / "sa.pub", self.directory / "sa.key")
        pair.key.touch(mode=0o600)
        pair.key.write_bytes(_key_pem(key))
        pair.cert.write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        return pair
