"""prefix_index.py and its hooks: the request text and its chained block keys, the per-worker LRU index, the
preference among workers with headroom, and admission / the Gateway using them."""

from __future__ import annotations

from typing import Any

import pytest

from adaserve.contract.generate import ChatMessage, GenerateRequest
from adaserve.gateway.admission import Admission, Admitted
from adaserve.gateway.directory import Directory
from adaserve.gateway.metrics import GatewayMetrics
from adaserve.gateway.prefix_index import (
    PrefixIndex,
    answered_text,
    block_keys,
    prefer,
    render_messages,
    request_text,
)
from adaserve.gateway.routing import Router
from adaserve.gateway.service import Gateway
from adaserve.gateway.settings import GatewaySettings
from adaserve.gateway.slo import DEFAULT_CLASSES, SloCatalog
from tests.gateway.unit.fakes import FakeSource, curve, registration
from tests.gateway.unit.helpers import run, view

CATALOG = SloCatalog.of(list(DEFAULT_CLASSES), "chat")
CHAT = CATALOG.classes["chat"]
SYSTEM = "You are a careful assistant who answers questions about the standard library in detail. " * 3
# quick alone, slow with company: with one request on it, no class has slack there, though slots are free
BUSY = {"budget": 16, "measured": curve((1, 30.0, 1.0), (2, 400.0, 1.0)), "active": 1, "by_class": {"chat": 1}}


def chat(*turns: tuple[str, str]) -> GenerateRequest:
    return GenerateRequest(messages=[ChatMessage(role=r, content=c) for r, c in turns])


def keys(text: str | None, block_chars: int = 16) -> list[int]:
    assert text is not None
    return block_keys(text, block_chars=block_chars)


# ---- text and keys ----------------------------------------------------------------------------------------------


def test_keys_are_chained_over_whole_blocks() -> None:
    a = keys("x" * 64 + "same middle block" + "a" * 40)
    b = keys("x" * 64 + "same middle block" + "b" * 40)
    assert len(a) == len(b) == (64 + 17 + 40) // 16  # the partial last block is left out
    assert a[:5] == b[:5] and a[5:] != b[5:]  # equal up to the first block that differs
    assert all(x != y for x, y in zip(a[5:], b[5:], strict=True))  # and different in every block after it
    # a block's key depends on everything before it: the same text after another start has another key
    assert keys("y" * 16 + "z" * 16)[1] != keys("x" * 16 + "z" * 16)[1]
    assert keys("short") == [] and keys("x" * 64) == keys("x" * 64)
    assert len(block_keys("x" * 1000, block_chars=10, max_blocks=7)) == 7
    with pytest.raises(ValueError):
        block_keys("abc", block_chars=0)


def test_a_second_turn_extends_the_first_turn_and_its_answer() -> None:
    first = chat(("system", SYSTEM), ("user", "How do I sort a dict by value?"))
    answer = "Use sorted(d.items(), key=lambda kv: kv[1]) and build a new dict from the pairs."
    second = chat(("system", SYSTEM), ("user", "How do I sort a dict by value?"), ("assistant", answer),
                  ("user", "And in reverse order?"))
    before, after, turn2 = request_text(first), answered_text(first, answer), request_text(second)
    assert before and after and turn2
    assert turn2.startswith(after) and after.startswith(before) and len(after) > len(before)
    held = keys(after)
    assert keys(turn2)[:len(held)] == held  # every block of the first turn and its answer is matched
    # another conversation with the same system prompt shares only the system prompt's blocks
    other = keys(request_text(chat(("system", SYSTEM), ("user", "What is a deque?"))))
    shared = next(i for i, (x, y) in enumerate(zip(held, other, strict=False)) if x != y)
    assert 0 < shared <= len(render_messages([ChatMessage(role="system", content=SYSTEM)])) // 16 + 1


def test_messages_render_apart_and_completions_append_the_answer() -> None:
    # the same characters split differently between messages or roles are different texts
    assert request_text(chat(("user", "ab"), ("user", "c"))) != request_text(chat(("user", "a"), ("user", "bc")))
    assert request_text(chat(("user", "hi"))) != request_text(chat(("system", "hi")))
    completion = GenerateRequest(prompt="def parse_args(argv):")
    assert request_text(completion) == "def parse_args(argv):"
    assert answered_text(completion, "\n    return argv") == "def parse_args(argv):\n    return argv"
    assert answered_text(completion, "") is None
    ids = GenerateRequest(prompt_token_ids=[1, 2, 3])
    assert request_text(ids) and request_text(ids) != request_text(GenerateRequest(prompt_token_ids=[1, 2, 4]))
    assert answered_text(ids, "text") is None  # text cannot be lined up with token ids


# ---- the index --------------------------------------------------------------------------------------------------


def test_the_index_matches_leading_blocks_per_worker() -> None:
    index = PrefixIndex(capacity=100)
    k = list(range(10, 20))
    index.record("a", k[:6])
    assert index.matched("a", k) == 6 and index.matched("b", k) == 0
    assert index.matched("a", [99, *k]) == 0  # a match starts at the first block
    assert index.matches(["a", "b"], k[:3]) == {"a": 3, "b": 0}
    index.retain({"b"})
    assert index.matched("a", k) == 0 and index.held("a") == 0
    with pytest.raises(ValueError):
        PrefixIndex(capacity=0)


def test_the_lru_drops_the_tails_of_old_prefixes_first() -> None:
    index = PrefixIndex(capacity=6)
    old, new = [1, 2, 3, 4], [5, 6, 7, 8]
    index.record("a", old)
    index.record("a", new)
    assert index.held("a") == 6
    assert index.matched("a", new) == 4 and index.matched("a", old) == 2  # old lost 3 and 4, not 1 and 2
    index.record("a", old[:1])  # used again: now the most recent
    index.record("a", [9, 10])
    assert index.matched("a", old) == 1 and index.matched("a", new) == 3


# ---- the preference ---------------------------------------------------------------------------------------------


def test_prefer_the_longest_prefix_among_workers_with_headroom() -> None:
    a, b, c = view("a", active=2), view("b"), view("c", active=1)
    slacks = {"a": 0.2, "b": 0.9, "c": 0.5}
    got = prefer(b, [a, b, c], slacks, {"a": 5, "c": 2})
    assert (got.worker.id, got.matched, got.moved, got.passed_over) == ("a", 5, True, False)
    # a tie with the policy's pick keeps it; no match anywhere keeps it
    assert prefer(b, [a, b, c], slacks, {"a": 5, "b": 5}).worker.id == "b"
    assert prefer(b, [a, b, c], slacks, {}).worker.id == "b"
    assert prefer(b, [a, b, c], slacks, {"a": 0}).matched == 0
    # a tie between two others: fewer requests
    assert prefer(b, [a, b, c], slacks, {"a": 4, "c": 4}).worker.id == "c"


def test_a_prefix_does_not_pile_requests_onto_a_much_busier_worker() -> None:
    # 8 slots each: a prefix's worker may carry 2 more requests than the policy's pick, no more
    b = view("b", active=1)
    slacks = {"a": 0.3, "b": 0.9}
    assert prefer(b, [view("a", active=3), b], slacks, {"a": 9}).worker.id == "a"
    assert prefer(b, [view("a", active=4), b], slacks, {"a": 9}).worker.id == "b"
    # bigger workers allow more: a quarter of their slots
    big_b = view("b", active=1, max_active=32)
    assert prefer(big_b, [view("a", active=9, max_active=32), big_b], slacks, {"a": 9}).worker.id == "a"
    assert prefer(big_b, [view("a", active=10, max_active=32), big_b], slacks, {"a": 9}).worker.id == "b"


def test_a_worker_without_headroom_is_never_chosen_for_its_prefix() -> None:
    a, b = view("a", active=1), view("b")
    got = prefer(b, [a, b], {"a": -0.1, "b": 0.5}, {"a": 9, "b": 1})
    assert (got.worker.id, got.matched, got.moved, got.passed_over) == ("b", 1, False, True)
    full = view("a", active=8)  # no free slot
    got = prefer(b, [b], {"b": 0.5}, {"a": 9}, everyone=[full, b])
    assert (got.worker.id, got.passed_over) == ("b", True)
    # nobody has headroom: the policy's choice stands
    assert prefer(b, [a, b], {"a": -0.1, "b": -0.2}, {"a": 9}).worker.id == "b"


def test_router_choose_weighs_the_prefix_after_its_policy() -> None:
    a, b = view("a", active=2), view("b")
    for policy in ("headroom", "least-loaded", "round-robin"):
        router = Router(policy)
        first = router.choose([a, b], "chat", lambda _: None, matched={"a": 3})
        assert first is not None and first.worker.id == "a" and first.prefix is not None and first.prefix.matched == 3
    plain = Router("headroom").choose([a, b], "chat", lambda _: None)
    assert plain is not None and plain.worker.id == "b" and plain.prefix is None


# ---- admission and the gateway ----------------------------------------------------------------------------------


def admission(docs: list[dict[str, Any]], index: PrefixIndex | None) -> Admission:
    s = GatewaySettings(workers=["http://x"], queue_timeout_s=0.2, refresh_s=0.05)
    directory = Directory(FakeSource(docs), refresh_s=s.refresh_s, suspect_s=s.suspect_s)
    return Admission(directory, Router(s.routing), CATALOG, s, GatewayMetrics(), index)


def admit(adm: Admission, k: list[int]) -> Admitted:
    async def main() -> Admitted:
        await adm.directory.refresh()
        return await adm.admit(CHAT, model=None, exclude=set(), keys=k)
    return run(main())


def test_admission_sends_a_request_to_its_prefix_while_that_worker_has_headroom() -> None:
    k = keys("conversation one, its first turn and answer" * 3)
    docs = [registration("a", active=1, by_class={"chat": 1}), registration("b")]
    index = PrefixIndex(100)
    index.record("a", k)
    assert admit(admission(docs, index), k).choice.worker.id == "a"
    assert admit(admission(docs, None), k).choice.worker.id == "b"  # without affinity: the idler worker
    assert admit(admission(docs, index), k[:0]).choice.worker.id == "b"  # no keys: the policy's choice


def test_admission_never_sends_a_request_to_its_prefix_without_headroom() -> None:
    k = keys("conversation one, its first turn and answer" * 3)
    index = PrefixIndex(100)
    index.record("a", k)
    busy = admit(admission([registration("a", **BUSY), registration("b", budget=16, measured=BUSY["measured"])],
                           index), k)
    assert busy.choice.worker.id == "b" and busy.choice.slack >= 0
    assert busy.choice.prefix is not None and busy.choice.prefix.passed_over
    full = admit(admission([registration("a", max_active=1, active=1), registration("b")], index), k)
    assert full.choice.worker.id == "b"


def test_the_gateway_records_prompts_and_answers_and_counts_what_the_prefix_did() -> None:
    gw = Gateway(GatewaySettings(workers=["http://x"], queue_timeout_s=0.0, prefix_block_chars=16))
    gw.directory.source = FakeSource([registration("a", active=1, by_class={"chat": 1}), registration("b")])
    answer = "Use sorted(d.items(), key=lambda kv: kv[1]) and build a new dict from the pairs."
    first = chat(("system", SYSTEM), ("user", "How do I sort a dict by value?"))
    second = chat(("system", SYSTEM), ("user", "How do I sort a dict by value?"), ("assistant", answer),
                  ("user", "And in reverse order?"))

    def sample(name: str, **labels: str) -> float:
        return gw.metrics.registry.get_sample_value(name, labels) or 0.0

    async def main() -> tuple[str, str]:
        await gw.directory.refresh()
        k1 = gw.prefix_keys(first)
        one = await gw.admission.admit(CHAT, model=None, exclude=set(), keys=k1)
        gw.directory.acquire(one.choice.worker.id, "chat")  # as Gateway.open does: b is now as busy as a
        gw.routed(one.choice.worker.id, one.choice, k1)
        gw.answered(one.choice.worker.id, first, answer)
        k2 = gw.prefix_keys(second)
        two = await gw.admission.admit(CHAT, model=None, exclude=set(), keys=k2)
        gw.routed(two.choice.worker.id, two.choice, k2)
        assert gw.prefixes is not None
        assert gw.prefixes.matched(two.choice.worker.id, k2) == len(k2)
        assert two.choice.prefix is not None and two.choice.prefix.matched == len(keys(answered_text(first, answer)))
        await gw.http.aclose()
        return one.choice.worker.id, two.choice.worker.id

    # the first turn goes to the idle worker b; the second follows it there, where the policy alone would pick a
    # (as busy, first by id)
    assert run(main()) == ("b", "b")
    assert sample("adaserve_gateway_prefix_routed_total") == 1
    assert sample("adaserve_gateway_prefix_requests_total", result="miss") == 1
    assert sample("adaserve_gateway_prefix_requests_total", result="hit") == 1
    assert sample("adaserve_gateway_prefix_blocks_total", what="sent") == len(keys(request_text(first))) + len(
        keys(request_text(second)))
    assert sample("adaserve_gateway_prefix_blocks_total", what="matched") > 0


def test_prefix_index_blocks_0_turns_affinity_off() -> None:
    gw = Gateway(GatewaySettings(workers=["http://x"], prefix_index_blocks=0))
    assert gw.prefixes is None and gw.admission.prefixes is None
    assert gw.prefix_keys(chat(("user", SYSTEM))) == []
    run(gw.http.aclose())
