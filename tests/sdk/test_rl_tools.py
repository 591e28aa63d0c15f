"""prefix_overlap and check_sequence_extension on hand-built cases with known answers."""

from __future__ import annotations

import pytest

from loraplex import check_sequence_extension, prefix_overlap


def test_prefix_overlap_counts_trie_nodes():
    assert prefix_overlap([]) == 0.0
    assert prefix_overlap([[1, 2, 3]]) == 0.0
    assert prefix_overlap([[1, 2, 3], [1, 2, 3]]) == pytest.approx(0.5)  # 3 nodes / 6 tokens
    # a GRPO group: one 4-token prompt, 4 different 2-token completions -> 4 + 8 nodes of 24 tokens
    group = [[9, 8, 7, 6, c, c + 1] for c in (10, 20, 30, 40)]
    assert prefix_overlap(group) == pytest.approx(1 - 12 / 24)
    # a tree, not pairs: [1,2], [1,3], [1,2,4] -> nodes 1, 2, 3, 4 = 4 of 7 tokens
    assert prefix_overlap([[1, 2], [1, 3], [1, 2, 4]]) == pytest.approx(1 - 4 / 7)
    assert prefix_overlap([[1, 2], [3, 4]]) == 0.0


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def render_keeping_history(messages: list[dict]) -> list[int]:
    text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
    return encode(text + "<assistant>")


def render_stripping_reasoning(messages: list[dict]) -> list[int]:
    """Like chat templates that drop earlier turns' <think> blocks from the history."""
    def content(m):
        return m["content"].split("</think>")[-1] if m["role"] == "assistant" else m["content"]
    return encode("".join(f"<{m['role']}>{content(m)}</{m['role']}>" for m in messages) + "<assistant>")


def conversation() -> list[dict]:
    turns = []
    for user, answer in [("2+2?", "<think>add</think>4"), ("times 3?", "<think>mul</think>12"), ("ok", "bye")]:
        turns.append({"role": "user", "content": user})
        # the sampled tokens: the answer and the closing tag the model generates as its stop sequence
        turns.append({"role": "assistant", "content": answer, "tokens": encode(answer + "</assistant>")})
    return turns


def test_history_preserving_template_extends_every_turn():
    report = check_sequence_extension(render_keeping_history, conversation())
    assert report.ok and len(report.turns) == 2 and report.first_break is None


def test_a_template_that_strips_reasoning_breaks_where_the_reasoning_was():
    convo = conversation()
    report = check_sequence_extension(render_stripping_reasoning, convo)
    assert not report.ok
    first = report.first_break
    assert first.turn == 0
    prompt0 = render_stripping_reasoning(convo[:1])
    assert first.break_at == len(prompt0)  # right where the first sampled token should be
    assert first.expected == ord("<") and first.got == ord("4")  # "<think>" was dropped, "4" follows


def test_assistant_turns_need_their_tokens():
    convo = conversation()
    del convo[1]["tokens"]
    with pytest.raises(ValueError, match=r"conversation\[1\].tokens"):
        check_sequence_extension(render_keeping_history, convo)
