"""Prefix-aware routing: among the workers that keep every target, prefer the one most likely to still hold the
request's prefix in its KV cache, so that a conversation's second turn skips most of its prefill there.

**What a worker holds is estimated, not asked.** A worker's engine keeps the pages of prompts it has served
(and of their answers) until it needs them back (adaserve/engine/model/prefix_cache.py). The gateway has no
tokenizer and workers do not publish their page hashes, so, like the "estimate" mode of the Gateway API
Inference Extension's prefix scorer (and llm-d's approximate one, or SGLang's router with its text radix tree),
the gateway remembers what it sent where:

- A request's text (``request_text``: a completion's prompt; a chat's messages, each as role, name, content
  and tool calls, one after the other; token ids as decimal numbers) is cut into blocks of ``block_chars``
  characters; only whole blocks count. Block i's key is the hash of block i-1's key and block i's text
  (``block_keys``), so one key stands for everything up to the end of its block: two requests share block i's
  key only if they share their first i+1 blocks (up to a hash collision: 64 bits, harmless, it only misroutes).
- Per worker, ``PrefixIndex`` keeps the keys of the blocks recently sent to it, in LRU order, at most
  ``capacity`` of them: a request's keys when it is dispatched there, and when it ends, the keys of its prompt
  followed by its answer (``answered_text``: the engine caches the answer too, and a chat's next turn repeats it
  as an assistant message). A request's keys are touched from the last to the first, so the LRU end drops a
  prefix's tail before its head, as the engine's own eviction does, and a walk from the first block is the
  match.
- The match of a worker is the number of leading blocks of the request it holds (``PrefixIndex.matched``).

**The choice** (``prefer``, called by ``routing.Router.choose`` after its policy picked a worker): among the
workers the policy chose from that have headroom (slack >= 0: every target still holds there if the request
joins, and a free slot), the one with the longest match; ties and no match at all keep the policy's choice
(between tied workers that are not the policy's, fewer requests, then more slack). A worker without headroom
is never chosen for its prefix, however much of it it holds: headroom decides who may take a request, the
prefix only which of those. A cost of that order: while only one worker holds a system prompt that every
conversation starts with, new conversations go there until its headroom runs out; the next one then goes to
another worker, which from then on holds the system prompt too, and ties are the policy's again.

**Balance.** A worker is preferred for its prefix only while it carries at most ``max_imbalance`` (a quarter
of its slots, at least 2) more requests than the policy's pick. Without that guard, two demo workers sharing
one system prompt took every conversation on the first worker while the second sat idle (headroom held on
the first throughout; docs/results/affinity-cpu-demo-tiny-2workers.json): new conversations now spill to the
other worker once the first is that much busier, and that worker then holds the system prompt too.

**Several gateway replicas** each keep their own index, in their own memory: routing stays correct (every
choice is still one the headroom rule allows), only affinity weakens, as a conversation whose turns reach
different replicas is matched on each by what that replica sent. A worker that restarts under the same id
has lost its cache while the index still credits it: its requests prefill again, as without this module,
until the index forgets. Workers that leave the directory are forgotten (``PrefixIndex.retain``).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from adaserve.contract.generate import ChatMessage, GenerateRequest
from adaserve.gateway.view import WorkerView

DEFAULT_BLOCK_CHARS = 64  # about 16 tokens of English text: the engine's pages are of this order
MAX_BLOCKS = 1024  # keys hashed per request (64k characters at 64 a block): enough to tell conversations apart
BALANCE_MIN = 2  # a prefix's worker may carry this many more requests than the policy's pick (max_imbalance)
_MESSAGE = "\x1e"  # before each message; a separator no chat text carries, so renderings never run together
_FIELD = "\x1f"  # between a message's fields


def _message(m: ChatMessage) -> str:
    calls = getattr(m, "tool_calls", None)
    rendered_calls = json.dumps([c.model_dump(mode="json") for c in calls], sort_keys=True) if calls else ""
    parts = (m.role, getattr(m, "name", None) or "", getattr(m, "tool_call_id", None) or "", rendered_calls,
             m.content)
    return _MESSAGE + _FIELD.join(parts)


def render_messages(messages: Sequence[ChatMessage]) -> str:
    """A chat's messages as one text, message after message; the content comes last in each, so a message list
    followed by an answer renders as a prefix of the next turn's list (which repeats that answer)."""
    return "".join(_message(m) for m in messages)


def request_text(request: GenerateRequest) -> str | None:
    """The text a request's prefix is judged on: its messages rendered, its prompt, or its token ids (a
    continuation's resumed tokens are left out: its prompt is what it shares with others). None: nothing."""
    if request.messages:
        return render_messages(request.messages)
    if request.prompt:
        return request.prompt
    if request.prompt_token_ids:
        return "\x00" + " ".join(str(t) for t in request.prompt_token_ids) + " "
    return None


def answered_text(request: GenerateRequest, answer: str) -> str | None:
    """The request's text followed by its answer, as a worker's cache then holds them: a chat's answer as one
    more assistant message (the next turn repeats it so), a completion's appended to its prompt. None for a
    prompt of token ids (its answer's text cannot be lined up with them) or an empty answer."""
    if not answer:
        return None
    if request.messages:
        said = ChatMessage.model_construct(role="assistant", content=answer, name=None, tool_calls=None,
                                           tool_call_id=None)
        return render_messages([*request.messages, said])
    if request.prompt:
        return request.prompt + answer
    return None


def block_keys(text: str, *, block_chars: int = DEFAULT_BLOCK_CHARS, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """The chained keys of ``text``'s whole blocks of ``block_chars`` characters, the first ``max_blocks``."""
    if block_chars < 1:
        raise ValueError("block_chars must be at least 1")
    keys: list[int] = []
    previous = b"\x00" * 8
    for start in range(0, min(len(text) // block_chars, max_blocks) * block_chars, block_chars):
        previous = hashlib.blake2b(previous + text[start:start + block_chars].encode("utf-8", "surrogatepass"),
                                   digest_size=8).digest()
        keys.append(int.from_bytes(previous, "big"))
    return keys


class PrefixIndex:
    """Per worker, the block keys recently sent to it, least recently used first; at most ``capacity`` each."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._held: dict[str, OrderedDict[int, None]] = {}

    def record(self, worker_id: str, keys: Sequence[int]) -> None:
        """``worker_id`` now holds ``keys`` (a request's, in order): each becomes the most recently used, the
        first block most of all, so the LRU end loses the tails of prefixes first."""
        if not keys:
            return
        held = self._held.setdefault(worker_id, OrderedDict())
        for k in reversed(keys):
            held[k] = None
            held.move_to_end(k)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def matched(self, worker_id: str, keys: Sequence[int]) -> int:
        """How many of ``keys``' leading blocks the worker holds (0 for a worker never sent anything)."""
        held = self._held.get(worker_id)
        if not held:
            return 0
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n

    def matches(self, worker_ids: Collection[str], keys: Sequence[int]) -> dict[str, int]:
        """``matched`` for each worker."""
        return {w: self.matched(w, keys) for w in worker_ids}

    def held(self, worker_id: str) -> int:
        """How many block keys the index holds for the worker."""
        return len(self._held.get(worker_id, ()))

    def retain(self, worker_ids: Collection[str]) -> None:
        """Forget every worker not in ``worker_ids`` (gone from the directory)."""
        for w in [w for w in self._held if w not in worker_ids]:
            del self._held[w]


@dataclass(frozen=True)
class Preference:
    """What the prefix did to one choice."""

    worker: WorkerView  # the choice after the prefix was weighed
    matched: int  # the blocks of the request the chosen worker holds
    moved: bool  # the prefix chose another worker than the policy had
    passed_over: bool  # a worker without headroom held more of the prefix than the chosen one


def max_imbalance(w: WorkerView) -> int:
    """How many more requests than the policy's pick a worker may carry and still be preferred for a prefix:
    a quarter of its slots, at least 2 (SGLang's cache-aware router has the same kind of guard)."""
    return max(BALANCE_MIN, w.max_active // 4)


def prefer(chosen: WorkerView, pool: Sequence[WorkerView], slacks: Mapping[str, float],
           matched: Mapping[str, int], *, everyone: Sequence[WorkerView] = ()) -> Preference:
    """The policy's ``chosen`` worker, or, when another worker of ``pool`` with headroom (slack >= 0 and a free
    slot) holds a longer prefix of the request than every other such worker and ``chosen``, that one. Ties
    keep ``chosen``; between tied others, fewer requests, then more slack, then the id. ``everyone``: all the
    workers the request could have gone to, busy ones included, to tell whether the prefix was passed over."""
    # headroom, and not so much busier than the policy's pick that affinity would pile every conversation there
    able = [w for w in pool if w.free_slots > 0 and slacks.get(w.id, -1.0) >= 0
            and w.active <= chosen.active + max_imbalance(w)]
    longest = max((matched.get(w.id, 0) for w in able), default=0)
    best = chosen
    if longest > 0 and matched.get(chosen.id, 0) < longest:
        best = min((w for w in able if matched.get(w.id, 0) == longest),
                   key=lambda w: (w.active, -slacks[w.id], w.id))
    got = matched.get(best.id, 0)
    elsewhere = max((matched.get(w.id, 0) for w in (*everyone, *pool)), default=0)
    return Preference(best, got, best.id != chosen.id, elsewhere > got)
