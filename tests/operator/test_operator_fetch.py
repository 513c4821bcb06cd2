"""The model-fetch init container's code against a local HTTP server: file, tar folder, checksum, bad URL."""
from __future__ import annotations

import functools
import hashlib
import http.server
import io
import tarfile
import threading

import pytest

from cpuserve.operator.fetch import download, main


@pytest.fixture()
def served(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(5)


def test_file_with_checksum(served, tmp_path):
    root, base = served
    data = b"GGUF" + bytes(range(256)) * 100
    (root / "m.gguf").write_bytes(data)
    dest = download(f"{base}/m.gguf", tmp_path / "models" / "model.gguf", hashlib.sha256(data).hexdigest())
    assert dest.read_bytes() == data
    assert not (tmp_path / "models" / "model.gguf.part").exists()


def test_checksum_mismatch_leaves_nothing(served, tmp_path):
    root, base = served
    (root / "m.gguf").write_bytes(b"abc")
    with pytest.raises(ValueError, match="expected 0000"):
        download(f"{base}/m.gguf", tmp_path / "model.gguf", "0" * 64)
    assert not (tmp_path / "model.gguf").exists() and not (tmp_path / "model.gguf.part").exists()


def test_tar_folder_unpacks(served, tmp_path):
    root, base = served
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, body in (("config.json", b"{}"), ("tokenizer.json", b"{}"), ("model.safetensors", b"x" * 10)):
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    (root / "m.tar.gz").write_bytes(buf.getvalue())
    dest = download(f"{base}/m.tar.gz", tmp_path / "model")
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_cli_errors_name_the_flag(capsys, tmp_path):
    assert main(["--url", "ftp://h/m.gguf", "--dest", str(tmp_path / "m")]) == 1
    assert "--url 'ftp://h/m.gguf': must start with http:// or https://" in capsys.readouterr().err
