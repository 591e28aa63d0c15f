"""RL groups inferred from training datums and sample requests (db/inferred_groups.py, db/rl_groups.py),
on plain arrays: where a datum's prompt ends, its advantage, a group's outcome from advantages alone,
and a datum's advantage landing on the sample it was built from."""

from __future__ import annotations

import numpy as np
import pytest

from db.inferred_groups import advantage_outcome, datum_member, prompt_key
from db.rl_groups import add_datum, step_summaries

PROMPT = [5, 6, 7, 8]


def cookbook_datum(completion: list[int], advantage: float, prompt: list[int] = PROMPT,
                   logprob: float = -1.5) -> tuple[np.ndarray, dict]:
    """As tinker-cookbook builds one (rl/data_processing.py): the sequence shifted into tokens and targets,
    0 on the prompt's targets, the trajectory's advantage and the sampler's logprobs on the sampled ones."""
    sequence = prompt + completion
    prompt_targets = len(prompt) - 1
    sampled = len(completion)
    return np.array(sequence[:-1], dtype=np.int64), {
        "target_tokens": np.array(sequence[1:], dtype=np.int64),
        "logprobs": np.array([0.0] * prompt_targets + [logprob] * sampled, dtype=np.float32),
        "advantages": np.array([0.0] * prompt_targets + [advantage] * sampled, dtype=np.float32)}


def test_the_prompt_ends_before_the_first_nonzero_advantage():
    member = datum_member(*cookbook_datum([40, 41, 42], 0.25))
    assert member.prompt.tolist() == PROMPT
    assert member.completion.tolist() == [40, 41, 42]  # the last target included
    assert member.advantage == 0.25


def test_all_zero_advantages_place_the_prompt_by_the_sampler_logprobs_or_weights():
    tokens, inputs = cookbook_datum([40, 41], 0.0)
    member = datum_member(tokens, inputs)
    assert (member.prompt.tolist(), member.completion.tolist(), member.advantage) == (PROMPT, [40, 41], 0.0)
    weights = {"target_tokens": inputs["target_tokens"], "advantages": inputs["advantages"],
               "weights": (inputs["logprobs"] != 0).astype(np.float32)}
    assert datum_member(tokens, weights).prompt.tolist() == PROMPT


def test_a_datum_that_says_nothing_about_its_prompt_is_no_member():
    tokens, inputs = cookbook_datum([40, 41], 0.0)
    assert datum_member(tokens, {"target_tokens": inputs["target_tokens"], "advantages": inputs["advantages"]}) is None
    assert datum_member(tokens, {"target_tokens": inputs["target_tokens"], "weights": np.ones(len(tokens))}) is None
    assert datum_member(tokens, {**inputs, "advantages": inputs["advantages"][:-1]}) is None  # not one per position


def test_a_trajectory_advantage_is_the_mean_of_its_nonzero_positions():
    tokens, inputs = cookbook_datum([40, 41, 42, 43], 1.0)
    inputs["advantages"][-2:] = 3.0  # per-token advantages (a value baseline): 1, 1, 3, 3
    assert datum_member(tokens, inputs).advantage == pytest.approx(2.0)


@pytest.mark.parametrize("advantages, outcome", [
    ([0.0, 0.0, 0.0], "uniform"), ([1.0, 1.0], "uniform"), ([0.5, -0.5, 0.0], "mixed"), ([0.3, 0.0], None),
    ([0.0], None), ([], None)])
def test_advantages_tell_uniform_and_mixed_groups_and_nothing_else(advantages, outcome):
    assert advantage_outcome(advantages) == outcome


def sample_member(choice: int, tokens: list[int]) -> dict:
    return {"source": "sample", "session_id": None, "turn": 0, "choice": choice, "reward": None, "advantage": None,
            "output_tokens": len(tokens), "_tokens": np.array(tokens)}


def test_a_datum_advantage_goes_to_the_sample_it_was_built_from():
    members = [sample_member(0, [40, 41]), sample_member(1, [50])]
    add_datum(members, datum_member(*cookbook_datum([50], -0.5)))
    add_datum(members, datum_member(*cookbook_datum([40, 41], 0.5)))
    assert [m["advantage"] for m in members] == [0.5, -0.5]
    add_datum(members, datum_member(*cookbook_datum([60, 61, 62], 0.0)))  # sampled by no request it knows
    assert len(members) == 3 and members[2]["source"] == "datum" and members[2]["output_tokens"] == 3


def test_steps_of_datum_groups_show_advantages_and_outcomes_but_no_reward():
    groups = {}
    for prompt, completions, advantages in ((PROMPT, [[40], [41], [42]], [0.5, -0.25, -0.25]),
                                            ([9, 9], [[43], [44]], [0.0, 0.0])):
        for completion, advantage in zip(completions, advantages):
            member = datum_member(*cookbook_datum(completion, advantage, prompt))
            add_datum(groups.setdefault((2, prompt_key(member.prompt)), []), member)
    assert sorted(groups) == sorted([(2, prompt_key(PROMPT)), (2, prompt_key([9, 9]))])
    [step] = step_summaries(groups, good_above=0.0)
    assert step["step"] == 2 and step["reward"] is None
    assert step["fractions"] == {"all_good": 0.0, "all_bad": 0.0, "mixed": 0.5, "uniform": 0.5}
    mixed, uniform = sorted(step["groups"], key=lambda g: g["outcome"])
    assert (mixed["outcome"], mixed["size"], mixed["prompt_ids"]) == ("mixed", 3, PROMPT)
    assert mixed["advantage"] == {"best": 0.5, "mean": 0.0, "worst": -0.25}
    assert (uniform["outcome"], uniform["size"], uniform["reward"]) == ("uniform", 2, None)
    assert all("_tokens" not in m for g in step["groups"] for m in g["members"])


def test_rewards_decide_the_outcome_where_there_are_any():
    members = [sample_member(0, [40]), sample_member(1, [41])]
    members[0]["reward"], members[1]["reward"] = 1.0, 1.0
    add_datum(members, datum_member(*cookbook_datum([40], 0.0)))
    add_datum(members, datum_member(*cookbook_datum([41], 0.0)))
    [step] = step_summaries({(1, prompt_key(PROMPT)): members}, good_above=0.0)
    assert step["groups"][0]["outcome"] == "all_good" and step["fractions"]["all_good"] == 1.0


def test_equal_advantages_stay_equal_whatever_the_datums_length():
    """A group's mean reward can miss its members' equal rewards by a rounding step: every member then
    carries the same tiny advantage, which must read as equal (uniform) for short and long datums alike."""
    tiny = float(np.float32(7.450581e-09))
    short, long = (datum_member(*cookbook_datum(list(range(40, 40 + n)), tiny)) for n in (3, 37))
    assert short.advantage == long.advantage
    assert advantage_outcome([short.advantage, long.advantage]) == "uniform"
