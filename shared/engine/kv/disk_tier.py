"""The disk tier: KV pages as files named by their content hash chain.

Identical pages (the same tokens after the same prefix) have the same name, so they are stored
once, and a restarted daemon finds its pages again by scanning the directory. Each file is
``MAGIC | digest(payload) | len(payload) | payload``: a torn or corrupted write fails the digest
on read, is deleted, and reads as a miss. The digest is keyed by the tier's ``namespace`` (the
model's weights fingerprint, KV dtype and page shape): page names hash tokens only, so another
model sharing the directory (a fine-tune of the same shape) writes pages under the same names,
and unkeyed they would have been read as this model's KV. Files are written to a temporary name and renamed.
The pages hold the fleet's prompts (as KV), so only the daemon's user may read them: directories
are 0700 and files 0600. Anything else in the directory (a stray name, a symlink, a broken one)
is ignored by the start-up scan, never followed.

Threading: the index (which hashes are stored, LRU order) belongs to the engine thread; the
file methods (`write_file`, `read_file`, `delete_file`) touch no shared state and run on the
copy worker.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict
from pathlib import Path

PageHash = bytes
MAGIC = b"FSKVPG01"
_HEADER = struct.Struct("<8s16sQ")  # magic, blake2b-128 of the payload, payload length
SUFFIX = ".kv"


def payload_digest(payload: bytes | memoryview, key: bytes = b"") -> bytes:
    """blake2b-128 of ``payload``, keyed with ``key`` (a tier's namespace key, up to 64 bytes)."""
    return hashlib.blake2b(payload, digest_size=16, key=key).digest()


def _is_page_name(stem: str) -> bool:
    """32 lowercase hex digits: the name ``path_of`` gives a page."""
    return len(stem) == 32 and all(c in "0123456789abcdef" for c in stem)


class DiskTier:
    """Content-addressed page files under ``directory`` (created if missing)."""

    def __init__(self, directory: Path | str, max_pages: int = 0, namespace: bytes = b"") -> None:
        if max_pages < 0:
            raise ValueError(f"max_pages must be >= 0, got {max_pages}")
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory.chmod(0o700)  # also one an operator made with the default 0755
        self.max_pages = max_pages  # 0 = unbounded
        self._key = hashlib.blake2b(namespace, digest_size=32).digest()  # keys every page's digest
        self._index: OrderedDict[PageHash, None] = OrderedDict()  # oldest first
        self._scan()

    def _scan(self) -> None:
        """Index the pages a previous run left (oldest mtime first); drop temporary files."""
        found = []
        for path in self.directory.glob("*/*"):
            if path.is_symlink() or not path.is_file():
                continue
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)
            elif path.suffix == SUFFIX and _is_page_name(path.stem) and path.parent.name == path.stem[:2]:
                found.append((path.stat().st_mtime, bytes.fromhex(path.stem)))
        for _, page_hash in sorted(found):
            self._index[page_hash] = None

    # --- index (engine thread) -------------------------------------------------------------

    def __contains__(self, page_hash: PageHash) -> bool:
        return page_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    def touch(self, page_hash: PageHash) -> None:
        """``page_hash`` was used (read) now: the last of the stored pages to be dropped."""
        if page_hash in self._index:
            self._index.move_to_end(page_hash)

    def add(self, page_hash: PageHash) -> list[PageHash]:
        """Record ``page_hash`` as stored (its file is written by a queued op). Returns the LRU
        hashes dropped to stay within ``max_pages``: the caller deletes their files."""
        self._index[page_hash] = None
        self._index.move_to_end(page_hash)
        dropped = []
        while self.max_pages and len(self._index) > self.max_pages:
            dropped.append(self._index.popitem(last=False)[0])
        return dropped

    def discard(self, page_hash: PageHash) -> None:
        self._index.pop(page_hash, None)

    # --- files (copy worker) ---------------------------------------------------------------

    def path_of(self, page_hash: PageHash) -> Path:
        name = page_hash.hex()
        return self.directory / name[:2] / (name + SUFFIX)

    def write_file(self, page_hash: PageHash, payload: bytes | memoryview) -> None:
        path = self.path_of(page_hash)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(_HEADER.pack(MAGIC, payload_digest(payload, self._key), len(payload)))
            f.write(payload)
        os.replace(tmp, path)

    def read_file(self, page_hash: PageHash, expected_len: int) -> bytearray | None:
        """The page's payload, or None when it is missing, torn or corrupt (then deleted)."""
        path = self.path_of(page_hash)
        try:
            with open(path, "rb") as f:
                data = bytearray(f.read())
        except FileNotFoundError:
            return None
        if len(data) == _HEADER.size + expected_len:
            magic, digest, length = _HEADER.unpack_from(data)
            payload = memoryview(data)[_HEADER.size :]
            if magic == MAGIC and length == expected_len and payload_digest(payload, self._key) == digest:
                return data[_HEADER.size :]
        path.unlink(missing_ok=True)
        return None

    def delete_file(self, page_hash: PageHash) -> None:
        self.path_of(page_hash).unlink(missing_ok=True)
