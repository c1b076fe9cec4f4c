"""A kernel's own certificate authority: the egress proxy signs the secret hosts' leaves with it.

Made in the kernel's unconfined companion (a kernel with secrets only), after the fork that
separates the two, so its private key is in no memory the kernel ever had and on no file
system at all: the key and each leaf are handed to OpenSSL through memfds, which only this
process holds, and closed at once. The kernel gets the certificate alone (`certificate_pem`),
to trust next to the system store. A CA lives as long as its kernel (the kernel alone trusts
it), and the proxy signs a leaf only for a name it intercepts.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LIFETIME = datetime.timedelta(days=30)  # longer than any kernel; clocks may be off a day
MAX_LEAVES = 64  # server contexts kept per kernel (one per intercepted name)


class KernelCA:
    """One kernel's CA: its certificate for the kernel, server contexts for the proxy."""

    def __init__(self, kernel: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                             f"sandbox-kernel egress CA {kernel[:32]}")])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.issuer = name
        self.certificate = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + LIFETIME)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                         False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()),
                           critical=False)
            .sign(self.key, hashes.SHA256()))
        self.contexts: dict[str, ssl.SSLContext] = {}

    def certificate_pem(self) -> bytes:
        """The certificate the kernel trusts (never the key)."""
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a leaf for host (a name or an address), cached."""
        context = self.contexts.get(host)
        if context is None:
            if len(self.contexts) >= MAX_LEAVES:
                self.contexts.pop(next(iter(self.contexts)))
            context = self.contexts[host] = self._context(host)
        return context

    def _context(self, host: str) -> ssl.SSLContext:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        try:
            alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            alt = x509.DNSName(host)
        leaf = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self.issuer).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + LIFETIME)
            .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256()))
        chain = leaf.public_bytes(serialization.Encoding.PEM) + self.certificate_pem()
        key_pem = key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.set_alpn_protocols(["http/1.1"])  # the proxy speaks HTTP/1.1 to the kernel
        with _memory_file(chain) as chain_path, _memory_file(key_pem) as key_path:
            context.load_cert_chain(chain_path, key_path)
        return context


class _memory_file:
    """A path to bytes that live in a memfd of this process only (no file system holds them)."""

    def __init__(self, data: bytes) -> None:
        self.fd = os.memfd_create("sandbox-kernel-ca", os.MFD_CLOEXEC)
        os.write(self.fd, data)

    def __enter__(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)
