"""Tiny wheels and sdists built by the tests, and a package index serving them on 127.0.0.1."""

from __future__ import annotations

import base64
import hashlib
import http.server
import io
import os
import tarfile
import threading
import zipfile
from pathlib import Path


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_wheel(directory: Path, name: str, version: str, modules: dict[str, str | bytes],
               requires: tuple[str, ...] = (), stored_bytes: int = 0) -> Path:
    """A pure-Python wheel of `name` holding modules {path in the wheel: source}.

    stored_bytes adds a data file of that many random (incompressible) bytes.
    """
    dist = f"{name.replace('-', '_')}-{version}"
    files: dict[str, bytes] = {path: text.encode() if isinstance(text, str) else text
                               for path, text in modules.items()}
    if stored_bytes:
        files[f"{name.replace('-', '_')}_blob.bin"] = os.urandom(stored_bytes)
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    metadata += [f"Requires-Dist: {requirement}" for requirement in requires]
    files[f"{dist}.dist-info/METADATA"] = ("\n".join(metadata) + "\n").encode()
    files[f"{dist}.dist-info/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: sandbox-kernel-tests\n"
                                        b"Root-Is-Purelib: true\nTag: py3-none-any\n")
    record = [_record_line(path, data) for path, data in files.items()]
    files[f"{dist}.dist-info/RECORD"] = ("\n".join([*record, f"{dist}.dist-info/RECORD,,"])
                                         + "\n").encode()
    path = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for member, data in files.items():
            wheel.writestr(member, data)
    return path


def make_sdist(directory: Path, name: str, version: str) -> Path:
    """A source distribution whose setup.py would run code when built."""
    dist = f"{name}-{version}"
    path = directory / f"{dist}.tar.gz"
    setup = b"from setuptools import setup\nsetup(name=%r, version=%r)\n" % (
        name.encode(), version.encode())
    pkg_info = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    with tarfile.open(path, "w:gz") as archive:
        for member, data in (("setup.py", setup), ("PKG-INFO", pkg_info)):
            info = tarfile.TarInfo(f"{dist}/{member}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def write_simple_index(files: Path, root: Path) -> None:
    """A PEP 503 simple index under root/simple for every distribution file in files."""
    projects: dict[str, list[str]] = {}
    for path in sorted(files.iterdir()):
        if path.suffix == ".whl":
            project = path.name.split("-")[0]
        elif path.name.endswith(".tar.gz"):
            project = path.name[: -len(".tar.gz")].rsplit("-", 1)[0]
        else:
            continue
        projects.setdefault(_normalized(project), []).append(path.name)
    simple = root / "simple"
    simple.mkdir(parents=True, exist_ok=True)
    for project, names in projects.items():
        (simple / project).mkdir(exist_ok=True)
        links = "".join(f'<a href="../../files/{name}">{name}</a>\n' for name in names)
        (simple / project / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    (simple / "index.html").write_text("".join(
        f'<a href="{project}/">{project}</a>\n' for project in projects))
    files_link = root / "files"
    if not files_link.exists():
        files_link.symlink_to(files)


class LocalIndex:
    """An HTTP package index on 127.0.0.1 serving a directory (simple/ and files/)."""

    def __init__(self, root: Path) -> None:
        handler = _quiet_handler(root)
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.requests: list[str] = handler.requests

    @property
    def url(self) -> str:
        """The index URL to give pip (`--index-url`)."""
        return f"http://127.0.0.1:{self.server.server_address[1]}/simple/"

    def __enter__(self) -> LocalIndex:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _quiet_handler(root: Path) -> type:
    requests: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, format: str, *args: object) -> None:
            requests.append(self.path)

    Handler.requests = requests  # type: ignore[attr-defined]
    return Handler
