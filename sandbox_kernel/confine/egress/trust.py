"""Kernel side of the kernel's CA: its certificate, trusted next to the system store.

Before user code runs, a kernel with secrets asks its companion for the CA's certificate (the
companion made the CA, and keeps its key: ca.py), writes one bundle of the system store and
that certificate into its scratch, and points every client's setting at the bundle: OpenSSL's
(Python's ssl, urllib, aiohttp, httpx), requests', pip's, curl's and Node's.
"""

from __future__ import annotations

import os
import ssl

TRUST_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT")
BUNDLE = "egress-ca-bundle.pem"


def system_store() -> bytes:
    """The certificates this host trusts: OpenSSL's default file, else certifi's."""
    paths = ssl.get_default_verify_paths()
    for path in (paths.cafile, paths.openssl_cafile):
        if path and os.path.isfile(path):
            with open(path, "rb") as file:
                return file.read()
    try:
        import certifi
    except ImportError:
        return b""
    with open(certifi.where(), "rb") as file:
        return file.read()


def trust_variables(certificate_pem: bytes, directory: str) -> dict[str, str]:
    """Write the bundle (system store + the kernel's CA) into directory; the variables to set."""
    if not certificate_pem.startswith(b"-----BEGIN CERTIFICATE-----"):
        raise ValueError("the companion sent no CA certificate")
    path = os.path.join(directory, BUNDLE)
    store = system_store()
    with open(path, "wb") as file:
        file.write(store + (b"" if store.endswith(b"\n") or not store else b"\n")
                   + certificate_pem)
    os.chmod(path, 0o444)
    return {**dict.fromkeys(TRUST_VARIABLES, path), "NODE_EXTRA_CA_CERTS": path}
