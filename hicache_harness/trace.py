"""Mooncake-format workload traces: loading, validating, writing, tokenising.

Format (one JSON object a line, blank lines ignored)::

    {"timestamp": 0, "input_length": 40160, "output_length": 6,
     "hash_ids": [0, 1, 2, ..., 78]}

- ``timestamp``: arrival time in milliseconds, a finite number >= 0;
- ``input_length`` / ``output_length``: token counts, integers >= 0;
- ``hash_ids``: one non-negative integer per 512-token block of the prompt
  (``len(hash_ids) == ceil(input_length / 512)``; the last block is partial
  when ``input_length`` is not a multiple of 512). Equal ids mean equal block
  content, and ids are *chained*: a block's id depends on its whole prefix, so
  a request's cached prefix is the longest prefix of its id chain seen before.
- ``session`` (optional, written by :func:`write_trace` for generated
  workloads): an integer naming the chat session the request belongs to.

Unknown extra fields are ignored. :func:`load_trace` is all or nothing: it
reads and validates the whole file before returning, and any defect raises
:class:`TraceError` naming the file, the 1-based line and the problem.

:func:`request_tokens` turns a request into token ids for a replay at any
tokens-per-block granularity (for example one cache page per block): each
block's tokens are a pure function of its id, so equal ids give equal tokens
and a radix tree over the tokens sees exactly the trace's prefix sharing.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hicache_cp.errors import HiCacheError

BLOCK_TOKENS = 512
"""Tokens per hash block in the Mooncake format (fixed by the format)."""

DEFAULT_VOCAB_SIZE = 1 << 32
"""Token ids from :func:`request_tokens` lie in ``[0, vocab_size)``; default 32-bit."""

MAX_HASH_ID = 1 << 63
"""Hash ids are 64-bit signed integers in the format's producers; larger ones are refused."""

MAX_LENGTH = 1 << 26
"""Longest prompt or output accepted, in tokens (64 Mi: far beyond any model's context)."""

_REQUIRED_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(HiCacheError, ValueError):
    """A trace file is malformed; the message names the file, line and defect."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    ``index`` is the request's 0-based position in the trace (blank lines not
    counted). ``hash_ids`` has ``ceil(input_length / BLOCK_TOKENS)`` entries.
    ``session`` names the chat session for generated workloads, else ``None``.
    """

    index: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: int | None = None

    @property
    def full_blocks(self) -> int:
        """Number of complete 512-token blocks (a partial tail block excluded)."""
        return self.input_length // BLOCK_TOKENS


# --------------------------------------------------------------------------- load


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_line(obj: object, index: int) -> TraceRequest:
    """Validate one decoded line; raise ``ValueError`` with the defect (no location)."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [f for f in _REQUIRED_FIELDS if f not in obj]
    if missing:
        raise ValueError(f"missing field(s) {missing}")
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise ValueError(f"'timestamp' must be a number, got {type(ts).__name__} {ts!r}")
    if not math.isfinite(ts) or ts < 0:
        raise ValueError(f"'timestamp' must be finite and >= 0, got {ts!r}")
    lengths: dict[str, int] = {}
    for name in ("input_length", "output_length"):
        v = obj[name]
        if not _is_int(v):
            raise ValueError(f"'{name}' must be an integer, got {type(v).__name__} {v!r}")
        if not 0 <= v <= MAX_LENGTH:
            raise ValueError(f"'{name}' must be in [0, {MAX_LENGTH}], got {v}")
        lengths[name] = v
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise ValueError(f"'hash_ids' must be a list, got {type(ids).__name__}")
    for pos, b in enumerate(ids):
        if not _is_int(b):
            raise ValueError(
                f"'hash_ids'[{pos}] must be an integer, got {type(b).__name__} {b!r}"
            )
        if not 0 <= b < MAX_HASH_ID:
            raise ValueError(f"'hash_ids'[{pos}] must be in [0, 2**63), got {b}")
    want = -(-lengths["input_length"] // BLOCK_TOKENS)
    if len(ids) != want:
        raise ValueError(
            f"'hash_ids' has {len(ids)} entries but input_length "
            f"{lengths['input_length']} needs ceil({lengths['input_length']}/"
            f"{BLOCK_TOKENS}) = {want}"
        )
    session = obj.get("session")
    if session is not None and not _is_int(session):
        raise ValueError(f"'session' must be an integer or absent, got {session!r}")
    return TraceRequest(
        index=index,
        timestamp_ms=float(ts),
        input_length=lengths["input_length"],
        output_length=lengths["output_length"],
        hash_ids=tuple(ids),
        session=session,
    )


MAX_NESTING = 32
"""Deepest JSON nesting a trace line may have (a request is 2 deep); deeper
would only exhaust the parser's recursion."""


def _max_depth(line: str) -> int:
    """Deepest bracket nesting of a JSON text, brackets inside strings ignored (O(len))."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in line:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def load_trace(path: str | os.PathLike[str], limit: int | None = None) -> list[TraceRequest]:
    """Read and validate a Mooncake-format trace.

    Every line of the file is validated before anything is returned, even
    when ``limit`` is given (``limit`` keeps only the first ``limit`` requests
    of a file that is valid as a whole), so a file accepted with a limit is
    accepted without one. Blank lines are skipped.

    Raises :class:`TraceError` (a ``ValueError``) naming the file and the
    1-based line for: unreadable file, bad JSON, a non-object line, a missing
    field, a wrong type, a negative length or id, a ``hash_ids`` count that
    does not match ``input_length``, or a file with no requests; ``ValueError``
    for a negative ``limit``.

    Complexity: O(total hash ids); reads the whole file into memory.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{p}: cannot read trace: {e}") from e
    requests: list[TraceRequest] = []
    # JSON Lines ends a line at "\n" only: str.splitlines() would also split
    # inside strings at U+2028, U+0085 and other separators that JSON allows raw.
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        # the count is C-speed; the exact scan runs only on lines with many brackets
        depth = _max_depth(line) if line.count("[") + line.count("{") > MAX_NESTING else 0
        if depth > MAX_NESTING:
            raise TraceError(f"{p}:{lineno}: JSON nested {depth} deep; a trace line needs at most {MAX_NESTING}")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{p}:{lineno}: bad JSON: {e.msg} (column {e.colno})") from e
        try:
            requests.append(_parse_line(obj, len(requests)))
        except ValueError as e:
            raise TraceError(f"{p}:{lineno}: {e}") from e
    if not requests:
        raise TraceError(f"{p}:1: trace has no requests (file is empty or blank)")
    return requests if limit is None else requests[:limit]


# -------------------------------------------------------------------------- write


def write_trace(path: str | os.PathLike[str], requests: Iterable[TraceRequest]) -> None:
    """Write ``requests`` as a Mooncake-format trace, atomically.

    Writes a temporary file in the destination directory, fsyncs it and
    renames it over ``path``: readers see the old file or the complete new
    one, never a partial one; on failure the temporary file is removed and
    ``path`` is untouched. ``session`` is written only when not ``None``;
    ``index`` is not written (it is the line order). Timestamps that are whole
    numbers are written as integers. Complexity: O(total hash ids).
    """
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in requests:
                ts: float | int = r.timestamp_ms
                if float(ts).is_integer():
                    ts = int(ts)
                obj: dict[str, object] = {
                    "timestamp": ts,
                    "input_length": r.input_length,
                    "output_length": r.output_length,
                    "hash_ids": list(r.hash_ids),
                }
                if r.session is not None:
                    obj["session"] = r.session
                f.write(json.dumps(obj, separators=(", ", ": ")))
                f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# ------------------------------------------------------------------------- tokens


def unique_blocks(requests: Iterable[TraceRequest]) -> int:
    """Number of distinct hash ids in ``requests`` (the trace's footprint in blocks,
    partial tail blocks included). Complexity: O(total hash ids)."""
    seen: set[int] = set()
    for r in requests:
        seen.update(r.hash_ids)
    return len(seen)




def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised splitmix64 finaliser over uint64 (wrapping arithmetic)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def tail_tokens(tail: int, tokens_per_block: int) -> int:
    """Tokens a partial block of ``tail`` (1..511) trace tokens becomes.

    ``round(tail * tokens_per_block / 512)`` (half up), at least 1, and at most
    ``tokens_per_block - 1`` when ``tokens_per_block > 1`` so a partial block
    stays partial (never fills a cache page). ``tail == 0`` gives 0.
    """
    if not 0 <= tail < BLOCK_TOKENS:
        raise ValueError(f"tail must be in [0, {BLOCK_TOKENS}), got {tail}")
    if tail == 0:
        return 0
    n = (2 * tail * tokens_per_block + BLOCK_TOKENS) // (2 * BLOCK_TOKENS)
    return max(1, min(n, max(1, tokens_per_block - 1)))


def request_tokens(
    req: TraceRequest, tokens_per_block: int, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> np.ndarray:
    """Token ids of ``req`` at ``tokens_per_block`` tokens per hash block.

    Block id ``b`` gives tokens ``splitmix64(b * tokens_per_block + j) % vocab_size``
    for ``j`` in ``[0, tokens_per_block)``: a pure function of ``b``, so equal
    ids give equal tokens and different ids give different token blocks with
    overwhelming probability. Full blocks contribute ``tokens_per_block``
    tokens; a partial last block (``input_length % 512 = tail > 0``) contributes
    the first :func:`tail_tokens` ``(tail, tokens_per_block)`` tokens of its
    block. Length = ``full_blocks * tokens_per_block + tail_tokens``.

    Returns a new int64 array (allocates; no Python loop over tokens).
    Complexity: O(number of tokens). Raises ``ValueError`` for
    ``tokens_per_block < 1`` or ``vocab_size`` outside ``[2, 2**63]``.
    """
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    if not 2 <= vocab_size <= 1 << 63:
        raise ValueError(f"vocab_size must be in [2, 2**63], got {vocab_size}")
    full = req.full_blocks
    tail = req.input_length - full * BLOCK_TOKENS
    n_tail = tail_tokens(tail, tokens_per_block)
    n = full * tokens_per_block + n_tail
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    ids = np.asarray(req.hash_ids[: full + (1 if tail else 0)], dtype=np.uint64)
    j = np.arange(tokens_per_block, dtype=np.uint64)
    keys = ids[:, None] * np.uint64(tokens_per_block) + j[None, :]
    toks = _splitmix64(keys.reshape(-1)[:n]) % np.uint64(vocab_size)
    return toks.astype(np.int64)

