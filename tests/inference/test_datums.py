"""Stored trajectories as training datums (loraplex.rollouts.trajectory_datums, which the server's
datums route runs): one datum when every turn extends the last exactly, else one per turn and choice;
loss inputs only on sampled tokens, the sampler's logprobs as they were recorded."""

from __future__ import annotations

import numpy as np
import pytest

from loraplex.rollouts import RolloutSample, RolloutTurn, Trajectory, TrajectoryDatums, trajectory_datums


def turn(number: int, prompt: list[int], *samples: tuple[list[int], list[float]], rewards=None) -> RolloutTurn:
    rewards = rewards or [None] * len(samples)
    return RolloutTurn(f"t{number}", number, "completions", "tiny", None, None, prompt,
                       [RolloutSample(i, tokens, logprobs, "stop", r) for i, ((tokens, logprobs), r)
                        in enumerate(zip(samples, rewards))])


def rows(datum, name: str) -> list:
    return datum.arrays()[name].tolist()


def test_turns_that_extend_each_other_make_one_datum_with_inputs_only_on_sampled_tokens():
    first = turn(0, [1, 2, 3], ([10, 11], [-0.5, -0.25]))
    second = turn(1, [1, 2, 3, 10, 11, 4, 5], ([12], [-0.125]))
    built = trajectory_datums(Trajectory("s", [first, second], reward=2.0))
    assert built.per_trajectory and built.sources == [[(0, 0), (1, 0)]] and "extends" in built.reason
    [datum] = built.datums
    assert datum.model_input.to_ints() == [1, 2, 3, 10, 11, 4, 5]  # every token but the last
    assert rows(datum, "target_tokens") == [2, 3, 10, 11, 4, 5, 12]  # row j predicts token j + 1
    assert rows(datum, "logprobs") == [0, 0, -0.5, -0.25, 0, 0, -0.125]
    assert rows(datum, "advantages") == [0, 0, 2, 2, 0, 0, 2]
    assert set(datum.loss_fn_inputs) == {"target_tokens", "logprobs", "advantages"}  # importance_sampling's inputs


def test_a_prompt_that_rewrites_history_makes_one_datum_per_turn_and_says_where():
    first = turn(0, [1, 2, 3], ([10, 11], [-0.5, -0.25]))
    second = turn(1, [1, 2, 3, 10, 99, 4], ([12], [-0.125]))  # the template re-tokenized the answer
    built = trajectory_datums(Trajectory("s", [first, second]), advantage=1.0)
    assert not built.per_trajectory and built.sources == [[(0, 0)], [(1, 0)]]
    assert "turn 1's prompt does not extend turn 0's" in built.reason and "position 4 is token 99" in built.reason
    assert [d.model_input.to_ints() for d in built.datums] == [[1, 2, 3, 10], [1, 2, 3, 10, 99, 4]]
    assert rows(built.datums[1], "advantages") == [0, 0, 0, 0, 0, 1]


def test_several_choices_are_a_datum_each_with_their_own_rewards():
    group = turn(0, [1, 2], ([10], [-1.0]), ([11, 12], [-2.0, -3.0]), rewards=[1.0, None])
    built = trajectory_datums(Trajectory("s", [group], reward=-1.0))
    assert not built.per_trajectory and "2 sampled choices" in built.reason
    # each choice's own reward, else the trajectory's
    assert [rows(d, "advantages") for d in built.datums] == [[0, 1.0], [0, -1.0, -1.0]]
    assert [rows(d, "advantages") for d in trajectory_datums(Trajectory("s", [group]), advantage=0.5).datums] == \
        [[0, 0.5], [0, 0.5, 0.5]]


def test_a_missing_reward_names_the_field_and_sft_needs_none():
    trajectory = Trajectory("s", [turn(0, [1, 2], ([10, 11], [-1.0, -2.0]))])
    with pytest.raises(ValueError, match="^advantage: trajectory 's' turn 0 choice 0 has no reward"):
        trajectory_datums(trajectory)
    with pytest.raises(ValueError, match="^kind: "):
        trajectory_datums(trajectory, kind="dpo")
    [datum] = trajectory_datums(trajectory, kind="sft").datums
    assert datum.arrays().keys() == {"target_tokens", "weights"} and rows(datum, "weights") == [0, 1, 1]


def test_datums_travel_as_json_unchanged():
    trajectory = Trajectory("s", [turn(0, [1, 2], ([10, 11], [-0.1, -0.2]))], reward=1.0)
    built = trajectory_datums(trajectory)
    again = TrajectoryDatums.from_json(built.to_json())
    assert (again.per_trajectory, again.reason, again.sources) == (built.per_trajectory, built.reason, built.sources)
    for a, b in zip(again.datums, built.datums):
        assert a.model_input == b.model_input
        for name, array in b.arrays().items():
            assert a.arrays()[name].dtype == array.dtype and np.array_equal(a.arrays()[name], array)
    assert Trajectory.from_json(trajectory.to_json()) == trajectory
