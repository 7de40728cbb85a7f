"""The draft selectors alone: what each chooses from given slot results (no model)."""

from __future__ import annotations

import pytest

from adaserve.engine.speculation.draft_bandit import (
    Choice,
    EpsilonGreedy,
    PromptLength,
    SlotResult,
    UCBDrafts,
    make_selector,
)
from adaserve.engine.speculation.policies import make_policy, split_policy


def choice(rid: str = "r", prompt_len: int = 10, current: int | None = None, switch=(0.0, 0.0)) -> Choice:
    return Choice(rid, prompt_len, current, tuple(switch))


def test_slot_reward_counts_the_switch() -> None:
    r = SlotResult(arm=0, tokens=10, seconds=1.0, switch_s=1.0)
    assert r.steady == 10.0 and r.reward == 5.0


def test_ucb_tries_every_arm_then_settles_on_the_better() -> None:
    ucb = UCBDrafts(2, min_slots=1)
    assert ucb.choose(choice("a")) == 0
    ucb.observe("a", SlotResult(0, 4, 1.0))
    assert ucb.choose(choice("b")) == 1  # arm 1 untried anywhere
    ucb.observe("b", SlotResult(1, 12, 1.0))
    for i in range(20):  # many requests: arm 1 is three times better
        arm = ucb.choose(choice(f"x{i}"))
        ucb.observe(f"x{i}", SlotResult(arm, 12 if arm == 1 else 4, 1.0))
    assert ucb.choose(choice("new")) == 1


def test_ucb_switch_cost_keeps_a_request_on_a_slightly_worse_arm() -> None:
    ucb = UCBDrafts(2, c=0.0, min_slots=1)
    for arm, tok in ((0, 10), (1, 11)):
        for i in range(5):
            ucb.observe(f"p{arm}{i}", SlotResult(arm, tok, 1.0))
    assert ucb.choose(choice("r", current=0, switch=(0.0, 0.0))) == 1
    # recomputing the KV would take half a slot: 11 * 1 / 1.5 < 10
    assert ucb.choose(choice("r", current=0, switch=(0.0, 0.5))) == 0


def test_ucb_learns_a_request_that_differs_from_the_pool() -> None:
    ucb = UCBDrafts(2, c=0.0, min_slots=1)
    for i in range(10):  # the pool: arm 0 better
        ucb.observe(f"p{i}", SlotResult(0, 10, 1.0))
        ucb.observe(f"q{i}", SlotResult(1, 5, 1.0))
    ucb.observe("hard", SlotResult(0, 4, 1.0))  # hard on arm 0: not a reason to leave it
    assert ucb.choose(choice("hard", current=0)) == 0
    for _ in range(2):  # this request, on both: a little worse than the pool on arm 0, far better on arm 1
        ucb.observe("odd", SlotResult(0, 8, 1.0))
    for _ in range(3):
        ucb.observe("odd", SlotResult(1, 20, 1.0))
    assert ucb.choose(choice("odd", current=1)) == 1
    assert ucb.choose(choice("other")) == 0


def test_prompt_length_rule_uses_the_running_median() -> None:
    rule = PromptLength(sizes=(10.0, 2.0))  # draft 1 is the small one
    assert rule.choose(choice("a", prompt_len=100)) == 0  # median of [100] is 100: not shorter
    assert rule.choose(choice("b", prompt_len=10)) == 1
    assert rule.choose(choice("a", prompt_len=100)) == 0  # decided once per request


def test_epsilon_greedy_explores_about_epsilon() -> None:
    eps = EpsilonGreedy(2, epsilon=0.2, seed=1)
    eps.observe("a", SlotResult(0, 10, 1.0))
    eps.observe("b", SlotResult(1, 5, 1.0))
    picks = [eps.choose(choice(f"r{i}")) for i in range(2000)]
    assert 0.05 < picks.count(1) / len(picks) < 0.15  # half of the random picks land on the worse arm


def test_make_selector_and_policy_names() -> None:
    assert make_selector("d1", sizes=(1.0, 2.0)).choose(choice()) == 1
    with pytest.raises(ValueError, match="only 2 drafts"):
        make_selector("d2", sizes=(1.0, 2.0))
    with pytest.raises(ValueError, match="unknown draft selector"):
        make_selector("thompson", sizes=(1.0, 2.0))
    assert split_policy("spin") == ("chain:4", "ucb")
    assert split_policy("spin-length") == ("chain:4", "length")
    assert split_policy("spin@d1") == ("chain:4", "d1")
    assert split_policy("adaserve@eps") == ("adaserve", "eps")
    assert split_policy("adaserve") == ("adaserve", None)
    assert make_policy("spin").name == "chain"
    with pytest.raises(ValueError, match="bad draft selector"):
        make_policy("adaserve@best")


def test_ucb_does_not_open_a_draft_group_of_one_for_a_small_gain() -> None:
    """Drafts run one after another: a lone request on the other draft delays every other request. A
    personal lean pays that cost; the pool's own choice does not (every request follows it)."""
    ucb = UCBDrafts(2, c=0.0, min_slots=1)
    for i in range(10):  # the pool: arm 0 a little better
        ucb.observe(f"p{i}", SlotResult(0, 10, 1.0))
        ucb.observe(f"q{i}", SlotResult(1, 9, 1.0))
    for _ in range(2):  # this request leans to arm 1
        ucb.observe("r", SlotResult(0, 8, 1.0))
        ucb.observe("r", SlotResult(1, 12, 1.0))
    assert ucb.choose(Choice("r", 10, 0, (0.0, 0.0), (0.0, 0.0))) == 1
    assert ucb.choose(Choice("r", 10, 0, (0.0, 0.0), (0.0, 2.0))) == 0  # the others would wait on its group
    assert ucb.choose(Choice("new", 10, 1, (0.0, 0.0), (2.0, 0.0))) == 0  # the pool's choice: no join cost


def test_ucb_gives_every_draft_its_first_slots() -> None:
    ucb = UCBDrafts(2, min_slots=3)
    picks = []
    for i in range(6):
        arm = ucb.choose(choice(f"r{i}"))
        picks.append(arm)
        ucb.observe(f"r{i}", SlotResult(arm, 10 if arm == 0 else 1, 1.0))
    assert sorted(picks) == [0, 0, 0, 1, 1, 1]  # however bad draft 1 looks after one slot


def test_ucb_counts_slots_in_flight_toward_every_drafts_first_slots() -> None:
    """A batch's requests choose before any of their slots reports: the first slots are min_slots per draft,
    spread over both from the first request on, not every request that chose before the first report."""
    ucb = UCBDrafts(2, min_slots=4)
    picks = [ucb.choose(choice(f"r{i}")) for i in range(20)]
    assert picks[:8] == [0, 1] * 4 and picks[8:] == [0] * 12  # then the first draft until one reports
    assert ucb.pending == [16, 4]
    for i, arm in enumerate(picks):
        ucb.observe(f"r{i}", SlotResult(arm, 10, 1.0))
    assert ucb.pending == [0, 0] and [s.slots for s in ucb.pooled] == [16, 4]


def test_ucb_explores_with_a_few_slots_of_a_batch_not_all_of_them() -> None:
    """Delayed feedback: while a draft's bonus leads, requests choosing before its slots report count them
    as pulls, so the bonus shrinks as they choose and the rest of the batch stays on the better draft."""
    def warmed() -> UCBDrafts:
        ucb = UCBDrafts(2, min_slots=1)
        for i in range(100):
            ucb.observe(f"p{i}", SlotResult(0, 10, 1.0))
        for i in range(4):
            ucb.observe(f"q{i}", SlotResult(1, 17, 2.0))
        return ucb

    ucb = warmed()
    assert ucb.choose(choice("first")) == 1  # little known of draft 1: its bonus leads
    picks = [ucb.choose(choice(f"r{i}")) for i in range(30)]
    assert 1 <= picks.count(1) <= 10 and picks[-1] == 0
    ucb.forget("first")  # a request ending before its slot ran: that slot no longer counts
    assert ucb.pending == [picks.count(0), picks.count(1)]
    # counting only reported slots, the whole batch would have followed the bonus
    without = warmed()
    assert [without._choose(choice(f"r{i}")) for i in range(30)] == [1] * 30


def test_ucb_moves_the_batch_together_within_a_round() -> None:
    """Drafts run one after another: a few requests on a second draft slow every iteration. In a round the
    pool's choice is made once, so a draft's first slots (and any exploration) take the whole batch, and a
    newcomer during the round joins it, where per-request choices would split the batch over both drafts."""
    ucb = UCBDrafts(2, min_slots=4)

    def batch(round_no: int, current: int | None) -> list[int]:
        return [ucb.choose(Choice(f"r{i}", 10, current, (0.0, 0.0), (), round_no)) for i in range(10)]

    assert batch(0, None) == [0] * 10  # not [0, 1] * 4 + ...: one group
    for i in range(10):
        ucb.observe(f"r{i}", SlotResult(0, 10, 1.0))
    assert batch(1, 0) == [1] * 10  # the second draft's first slots, again the whole batch
    for i in range(10):
        ucb.observe(f"r{i}", SlotResult(1, 5, 1.0))
    assert batch(2, 1) == [0] * 10  # the better draft, for everyone
    assert ucb.choose(Choice("newcomer", 10, None, (0.0, 0.0), (), 2)) == 0


def test_ucb_explores_with_a_whole_round_only_if_the_draft_would_still_lead_after_it() -> None:
    """A round gives a batch of slots at once: a draft whose bonus leads by a little is worth one more
    slot, not thirty. Each draft is ranked as if it had taken the round (its pulls + the batch)."""

    def trained() -> UCBDrafts:
        ucb = UCBDrafts(2)
        for i in range(200):
            ucb.observe(f"a{i}", SlotResult(0, 10, 1.0))
        for i in range(10):  # the other draft: 15% worse, seen little
            ucb.observe(f"b{i}", SlotResult(1, 8.5, 1.0))
        return ucb

    join = (0.0, 0.5)  # a group of its own on draft 1 would cost the others half a slot
    assert trained().choose(Choice("r", 10, 0, (0.0, 0.0), join, 0, batch=1)) == 1  # its bonus leads: explore
    assert trained().choose(Choice("r", 10, 0, (0.0, 0.0), join, 0, batch=30)) == 0  # not after 30 more slots
