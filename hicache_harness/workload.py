"""The embedded default workload: multi-turn chat sessions sharing system prompts.

``hicache-cp replay`` without ``--trace`` replays :func:`default_workload`, so a
fresh install needs no trace file. The generator writes exactly what a
Mooncake trace would contain (hash ids per 512-token block, chained: equal ids
mean equal prefixes) and sets ``TraceRequest.session``.

Model:

- ``system_prompts`` shared system prompts of ``system_blocks`` full blocks
  each; every session (and half of the single-shot requests) starts with one.
- A session has 1..``max_turns`` turns. Turn *k*'s prompt is turn *k-1*'s
  prompt plus the model's answer to it plus the new user message, so every
  turn extends the previous turn's prefix. Content is tracked in tokens: new
  content fills the session's open (partial) block and then new full blocks,
  each full block getting a fresh id from one counter. A prompt that ends
  mid-block carries one more fresh id for that partial block; the next turn
  cannot reuse it (the block then holds more tokens, so different content),
  exactly as in Mooncake traces.
- Sessions start at exponential inter-arrival times and think between turns
  for exponential times, so sessions interleave; single-shot requests (a
  fresh prompt, optionally behind a system prompt) arrive in between.

The defaults give about 300 requests of 25-30 blocks on average (7,000-9,500
block accesses, about 1,600 distinct blocks); the output is a pure function
of the arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hicache_harness.trace import BLOCK_TOKENS, TraceRequest


@dataclass(slots=True)
class _Session:
    """A chat session's content so far: full blocks plus an open block."""

    sid: int | None  # None for single-shot requests
    full_ids: list[int]
    open_tokens: int  # tokens in the partial last block, 0..BLOCK_TOKENS-1


class _Ids:
    """Fresh hash ids from a counter."""

    def __init__(self, start: int) -> None:
        self.next = start

    def take(self, n: int) -> list[int]:
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


def _append(s: _Session, tokens: int, ids: _Ids) -> None:
    """Append ``tokens`` of new content to the session; whole blocks get fresh ids."""
    total = s.open_tokens + tokens
    s.full_ids.extend(ids.take(total // BLOCK_TOKENS))
    s.open_tokens = total % BLOCK_TOKENS


def _prompt(
    s: _Session, ids: _Ids, timestamp_ms: float, output_length: int
) -> TraceRequest:
    """The request for the session's current content (index assigned later)."""
    tail = [ids.take(1)[0]] if s.open_tokens else []
    return TraceRequest(
        index=-1,
        timestamp_ms=timestamp_ms,
        input_length=len(s.full_ids) * BLOCK_TOKENS + s.open_tokens,
        output_length=output_length,
        hash_ids=tuple(s.full_ids) + tuple(tail),
        session=s.sid,
    )


def default_workload(
    seed: int = 0,
    sessions: int = 60,
    single_shot: int = 30,
    system_prompts: int = 4,
    system_blocks: tuple[int, int] = (8, 24),
    max_turns: int = 8,
    user_tokens: tuple[int, int] = (200, 2500),
    output_tokens: tuple[int, int] = (50, 1000),
    session_gap_ms: float = 2000.0,
    think_ms: float = 15000.0,
) -> list[TraceRequest]:
    """Generate the default multi-turn chat workload.

    Arguments: ``sessions`` chat sessions with 1..``max_turns`` turns each
    (uniform); ``single_shot`` one-turn requests with no session
    (``session=None``); ``system_prompts`` shared prompts whose lengths in
    full blocks are drawn uniformly from ``system_blocks`` (inclusive);
    user-message and answer lengths in tokens uniform over ``user_tokens`` and
    ``output_tokens`` (inclusive); session starts ``session_gap_ms`` apart on
    average (exponential) and ``think_ms`` average pause between turns.

    Returns requests sorted by timestamp (ties by session and turn, so turns
    of a session stay in order), with ``index`` their position. Hash ids
    ``0..`` are the system prompts, then fresh content in generation order.
    Deterministic in all arguments (numpy ``default_rng(seed)``).
    Complexity: O(total blocks). Raises ``ValueError`` for out-of-range sizes.
    """
    if sessions < 0 or single_shot < 0 or sessions + single_shot == 0:
        raise ValueError(
            f"need sessions >= 0, single_shot >= 0 and at least one request, "
            f"got sessions={sessions}, single_shot={single_shot}"
        )
    if system_prompts < 1 or max_turns < 1:
        raise ValueError(
            f"system_prompts and max_turns must be >= 1, got {system_prompts}, {max_turns}"
        )
    for name, (lo, hi) in (
        ("system_blocks", system_blocks),
        ("user_tokens", user_tokens),
        ("output_tokens", output_tokens),
    ):
        if not 0 <= lo <= hi:
            raise ValueError(f"{name} must be (lo, hi) with 0 <= lo <= hi, got {(lo, hi)}")
    if session_gap_ms < 0 or think_ms < 0:
        raise ValueError(f"times must be >= 0, got {session_gap_ms}, {think_ms}")

    rng = np.random.default_rng(seed)
    ids = _Ids(0)
    prompts = [
        ids.take(int(rng.integers(system_blocks[0], system_blocks[1] + 1)))
        for _ in range(system_prompts)
    ]

    def draw(lo_hi: tuple[int, int]) -> int:
        return int(rng.integers(lo_hi[0], lo_hi[1] + 1))

    # (timestamp, session order key, turn, request)
    keyed: list[tuple[float, int, int, TraceRequest]] = []
    start = 0.0
    for sid in range(sessions):
        start += float(rng.exponential(session_gap_ms))
        s = _Session(sid=sid, full_ids=list(prompts[int(rng.integers(system_prompts))]),
                     open_tokens=0)
        t = start
        for turn in range(int(rng.integers(1, max_turns + 1))):
            _append(s, draw(user_tokens), ids)
            out = draw(output_tokens)
            keyed.append((round(t, 3), sid, turn, _prompt(s, ids, round(t, 3), out)))
            _append(s, out, ids)
            t += float(rng.exponential(think_ms))
    horizon = max(start, 1.0)
    for k in range(single_shot):
        t = round(float(rng.uniform(0.0, horizon)), 3)
        shared = rng.random() < 0.5
        s = _Session(
            sid=None,
            full_ids=list(prompts[int(rng.integers(system_prompts))]) if shared else [],
            open_tokens=0,
        )
        _append(s, draw(user_tokens) * 4, ids)  # documents / long one-off prompts
        req = _prompt(s, ids, t, draw(output_tokens))
        keyed.append((t, sessions + k, 0, req))

    keyed.sort(key=lambda x: (x[0], x[1], x[2]))
    out_reqs: list[TraceRequest] = []
    for i, (_, _, _, r) in enumerate(keyed):
        out_reqs.append(
            TraceRequest(
                index=i,
                timestamp_ms=r.timestamp_ms,
                input_length=r.input_length,
                output_length=r.output_length,
                hash_ids=r.hash_ids,
                session=r.session,
            )
        )
    return out_reqs
