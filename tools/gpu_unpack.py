"""Join the two halves of a packed site (tools/gpu_wheels.sh), check the whole against its
SHA-256 and unpack it into a folder, as tools/gpu_session.sh does on the GPU machine:

    python tools/gpu_unpack.py FIRST SECOND SHA256_FILE FOLDER

SHA256_FILE is ``sha256sum``'s line for the whole file. Exit status 0 when unpacked; 1 with
one line on stderr when the halves do not match it (nothing is unpacked) or the archive is
unreadable; 2 for a wrong command line.
"""

from __future__ import annotations

import hashlib
import io
import sys
import tarfile
from pathlib import Path

PROG = "tools/gpu_unpack.py"


def unpack(first: Path, second: Path, sums: Path, folder: Path) -> None:
    """Unpack the tar.xz that ``first`` and ``second`` make into ``folder``; ValueError if
    their SHA-256 is not the one in ``sums``."""
    data = first.read_bytes() + second.read_bytes()
    want = sums.read_text().split()[0]
    if hashlib.sha256(data).hexdigest() != want:
        raise ValueError(f"the halves {first.name} and {second.name} do not match the SHA-256 "
                         f"in {sums}: not unpacked")
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
        tar.extractall(folder, filter="data")


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(f"usage: {PROG} FIRST SECOND SHA256_FILE FOLDER", file=sys.stderr)
        return 2
    first, second, sums, folder = map(Path, argv)
    try:
        unpack(first, second, sums, folder)
    except (OSError, ValueError, tarfile.TarError, EOFError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    print(f"{PROG}: unpacked into {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
