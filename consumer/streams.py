"""One token stream per episode, with its loss mask: what a trainer trains on
(docs/protocol.md#token-options).

Built turn by turn from the stored per-step ids (``step_tokens``), never by tokenizing text
again: the first turn's prompt ids (mask 0), its completion ids (mask 1), then each next
turn's prompt ids past the end of the stream so far (what the env and the chat template added:
mask 0) and its completion ids (mask 1). This holds while every turn's prompt ids start with
the stream so far: an append-only template with the full history.

Where a turn's prompt does not (the step's ``token_drift``: a template that rewrites history,
``message_cut`` trimming old turns, a server that renders the prompt differently), the stream
is *cut* there and a new segment starts from that turn's own prompt ids; every turn keeps its
own ids in ``step_tokens`` either way. A step without ids (invalid tokens, a server that gives
none, a context_length step with no answer) ends the segment too. An episode therefore has one
segment exactly when its turns extend one another all the way; readers (results, exports, the
browser) say how many it has and why each later one began.

Logprobs of the stream: the sampled token's logprob where the mask is 1, 0.0 where it is 0
(nothing was sampled there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from broker.tokens import TOKENS_OK, first_difference

# Why a segment begins (Segment.starts_because).
START_FIRST = "first"  # the episode's first turn with ids
START_DRIFT = "token_drift"  # the turn's prompt did not extend the stream (drift_at says where)
START_AFTER_GAP = "after_gap"  # the turn before had no ids


@dataclass
class Segment:
    first_step: int
    last_step: int
    starts_because: str
    drift_at: int | None = None  # START_DRIFT: the first prompt position that differed
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)

    def add(self, ids: Sequence[int], mask: int, logprobs: Sequence[float] | None = None) -> None:
        self.ids.extend(ids)
        self.mask.extend([mask] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


@dataclass
class EpisodeStream:
    segments: list[Segment]
    steps_without_ids: list[int]  # steps that asked for tokens but have no usable ids

    @property
    def single(self) -> bool:
        """One stream over the whole episode: what a trainer can take as it is."""
        return len(self.segments) == 1 and not self.steps_without_ids


def build(token_rows: Sequence[dict[str, Any]]) -> EpisodeStream:
    """The episode's segments from its trajectory's token rows (decoded, in step order)."""
    segments: list[Segment] = []
    gaps: list[int] = []
    cur: Segment | None = None
    for row in token_rows:
        step = int(row["step_id"])
        prompt, completion = row.get("prompt_ids"), row.get("completion_ids")
        if row.get("token_status") != TOKENS_OK or prompt is None or completion is None:
            gaps.append(step)
            cur = None
            continue
        drift = row.get("token_drift")
        if cur is not None and drift is None:
            # the stored drift is the worker's finding; checked again here (a row written by a
            # worker that did not compare, or a gap the worker did not see, must not splice)
            drift = first_difference(cur.ids, prompt)
        if cur is None or drift is not None:
            why = (START_DRIFT if drift is not None and cur is not None
                   else START_AFTER_GAP if segments or gaps else START_FIRST)
            cur = Segment(first_step=step, last_step=step, starts_because=why,
                          drift_at=drift if why == START_DRIFT else None)
            segments.append(cur)
            cur.add(prompt, 0)
        else:
            cur.add(prompt[len(cur.ids):], 0)
        lps = row.get("completion_logprobs") or [0.0] * len(completion)
        cur.add(completion, 1, lps)
        cur.last_step = step
        cur.steps.append(step)
    return EpisodeStream(segments, gaps)
