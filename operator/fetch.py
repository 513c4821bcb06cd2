"""Init-container download of a model: `python -m cpuserve.operator.fetch --url URL --dest PATH [--sha256 HEX]`.

A GGUF URL is saved as the file PATH; a .tar/.tar.gz/.tgz URL is unpacked into the folder PATH (safetensors).
Writes go to a temporary name first, so a half-downloaded file is never mistaken for a model.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

CHUNK = 1 << 20


def download(url: str, dest: Path, sha256: str | None = None, timeout: float = 60.0) -> Path:
    """Fetch `url` into `dest` (a file, or a folder for tar archives) and return `dest`.

    Raises:
        ValueError: the URL scheme is not http(s), or the SHA-256 does not match.
    """
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url {url!r}: must start with http:// or https://")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    digest = hashlib.sha256()
    with urllib.request.urlopen(url, timeout=timeout) as rsp, open(part, "wb") as out:  # noqa: S310 (scheme checked)
        while chunk := rsp.read(CHUNK):
            digest.update(chunk)
            out.write(chunk)
    if sha256 and digest.hexdigest() != sha256.lower():
        part.unlink()
        raise ValueError(f"--sha256: download of {url} has SHA-256 {digest.hexdigest()}, expected {sha256}")
    if url.split("?")[0].endswith((".tar", ".tar.gz", ".tgz")):
        staging = dest.with_name(dest.name + ".unpack")
        shutil.rmtree(staging, ignore_errors=True)
        with tarfile.open(part) as tar:
            tar.extractall(staging, filter="data")  # "data" refuses absolute paths, links out and devices
        part.unlink()
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(staging, dest)
    else:
        os.replace(part, dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cpuserve.operator.fetch", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="HTTP(S) URL of a GGUF file or a tar of a safetensors folder")
    parser.add_argument("--dest", required=True, type=Path, help="file (GGUF) or folder (tar) to create")
    parser.add_argument("--sha256", default=None, help="expected SHA-256 of the downloaded bytes")
    args = parser.parse_args(argv)
    try:
        path = download(args.url, args.dest, args.sha256)
    except (ValueError, OSError, tarfile.TarError) as err:
        print(f"fetch failed: {err}", file=sys.stderr)
        return 1
    print(f"fetched {args.url} -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
