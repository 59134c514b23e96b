"""The journal of committed objects: one directory entry per logical host page, in the segment.

An entry says what a host page holds once its copy committed: the page's
request position, its token ids, the 128-bit prefix chain hash through it
(`key`) and the one before it (`parent`), and a commit sequence number. A
restarted engine rebuilds its tree from the entries (`adopt`), so the
journal is exactly the set of committed host copies, kept in step with the
tree by two calls, each made by the journal's single writer (the rank that
owns it: rank 0 of the cache's agreement, or vLLM's scheduler):

    commit(pages, first_position, tokens, parent)  a backup committed: fields first,
                                                   then `state = COMMITTED` last
    release(pages)                                 pages leave L2 (eviction, a failed
                                                   check, ...): `state = FREE` before
                                                   the allocator may hand them out again
    clear()                                        a reset: every entry FREE

Why no lock: the writer is one thread of one process, and a crash can only
cut its stores at an instruction boundary, in program order. So an entry is
COMMITTED only after its fields were written, and only after every rank's
copy landed (the commit is the agreed decision), and it is FREE before its
page is ever written again. An entry of a backup still PENDING at a crash
was never written: it is not adopted, and its page is free after restart.

Checksums are not the journal's: each copy's checksum table in the segment
is its `HostPool`'s (`HostPool.sums`, `hicache_cp.checksum`), written by
whichever rank copied a page, before that rank votes that its copy landed;
so they precede the commit too, and every load checks against them
(docs/integrity.md).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from hicache_cp.keys import HASH_BYTES, chain_hashes
from hicache_cp.node.segment import NodeSegment

#: Entry states. COMMITTED is a magic word so that garbage is never mistaken for it.
FREE = 0
COMMITTED = 0x4D4D_4F43  # "COMM"
ROOT = bytes(HASH_BYTES)  # the parent key of position 0


def seed(parent: bytes) -> bytes:
    """What the chain hash of a page continues from: its parent's key, or nothing at
    position 0 (so keys are `hicache_cp.keys.chain_hashes` of the whole prefix)."""
    return b"" if parent == ROOT else parent


@dataclass(frozen=True)
class Entries:
    """The COMMITTED entries of a journal, copied out (arrays aligned by entry)."""

    pages: np.ndarray  # logical host page ids
    positions: np.ndarray
    seq: np.ndarray
    keys: list[bytes]
    parents: list[bytes]
    tokens: np.ndarray  # [n, page_size] int64

    def __len__(self) -> int:
        return len(self.pages)


def key_words(key: bytes) -> np.ndarray:
    """A 16-byte key as the entry's two little-endian words."""
    return np.frombuffer(key, "<u8", 2)


class Journal:
    """The directory of one node segment; see the module docstring.

    `writer`: whether this process keeps it (exactly one per engine). The
    others only record checksums and read it.
    """

    def __init__(self, segment: NodeSegment, *, writer: bool) -> None:
        self.seg = segment
        self.writer = writer
        self.page_size = segment.geometry.layout.page_size
        entries = self._entries()
        committed = entries["state"] == COMMITTED
        last = int(entries["seq"][committed].max()) if committed.any() else 0
        self._seq = itertools.count(last + 1)
        self.commits = 0
        self.releases = 0

    def _entries(self) -> np.ndarray:
        directory = self.seg.directory
        assert directory is not None, "journal of a closed segment"
        return directory

    # -- the writer's calls ------------------------------------------------------

    def commit(self, pages: np.ndarray, first_position: int, tokens: np.ndarray, parent: bytes) -> bytes:
        """Record that `pages` (logical host pages of request positions
        [first_position, first_position + len(pages))) now hold the committed KV
        of `tokens` (int64, whole pages) after the prefix whose chain hash is
        `parent` (ROOT at position 0). Returns the chain hash through the last
        page. O(pages): one hash a page, vectorised field writes, state last."""
        assert self.writer, "only the journal's writer commits"
        pages = np.asarray(pages, np.int64)
        n = len(pages)
        if n == 0:
            return parent
        keys = chain_hashes(tokens, self.page_size, seed(parent))
        assert len(keys) == n, (len(keys), n)
        e = self._entries()
        e["state"][pages] = FREE  # a page committed twice is rewritten from scratch
        e["position"][pages] = np.arange(first_position, first_position + n, dtype=np.int64)
        e["seq"][pages] = next(self._seq)
        e["key"][pages] = np.frombuffer(b"".join(keys), "<u8").reshape(n, 2)
        e["parent"][pages] = np.frombuffer(parent + b"".join(keys[:-1]), "<u8").reshape(n, 2)
        e["flags"][pages] = 0
        self.seg.tokens[pages] = np.asarray(tokens, np.int64).reshape(n, self.page_size)  # type: ignore[index]
        e["state"][pages] = COMMITTED  # last: the entries exist only now
        self.commits += n
        return keys[-1]

    def release(self, pages: np.ndarray) -> None:
        """`pages` leave L2: FREE from now on (before they can be reused). O(pages);
        `releases` counts the entries that were COMMITTED."""
        assert self.writer, "only the journal's writer releases"
        if len(pages):
            state = self._entries()["state"]
            pages = np.asarray(pages, np.int64)
            self.releases += int(np.count_nonzero(state[pages] == COMMITTED))
            state[pages] = FREE

    def clear(self) -> None:
        """Every entry FREE: nothing of this engine's L2 is adopted later (a reset). O(directory)."""
        self.release(self.committed_pages())

    def key_of(self, page: int, position: int) -> bytes | None:
        """The chain hash of `page` if it is COMMITTED at request position `position`, else None."""
        e = self._entries()[page]
        if int(e["state"]) != COMMITTED or int(e["position"]) != position:
            return None
        return e["key"].tobytes()

    # -- every rank's calls ------------------------------------------------------

    def committed(self) -> Entries:
        """Every COMMITTED entry (page 0, the dummy, never is), copied out. O(directory)."""
        e = self._entries()
        pages = np.flatnonzero(e["state"] == COMMITTED).astype(np.int64)
        pages = pages[pages > 0]
        rows = e[pages]
        keys = rows["key"].tobytes()
        parents = rows["parent"].tobytes()
        k = HASH_BYTES
        return Entries(
            pages, rows["position"].copy(), rows["seq"].copy(),
            [keys[i * k : (i + 1) * k] for i in range(len(pages))],
            [parents[i * k : (i + 1) * k] for i in range(len(pages))],
            self.seg.tokens[pages].copy(),  # type: ignore[index]
        )  # fmt: skip

    def committed_pages(self) -> np.ndarray:
        """Logical host pages whose entries are COMMITTED, ascending. O(directory)."""
        pages = np.flatnonzero(self._entries()["state"] == COMMITTED).astype(np.int64)
        return pages[pages > 0]
