"""The grammar a forced tool call is held to, checked on text alone (no sampler): a call in the template's
own format passes, JSON's whitespace is allowed in runs up to MAX_WHITESPACE_RUN, a longer run is not (an
untrained model would otherwise pad a forced call until max_tokens cut it open)."""

from __future__ import annotations

import xgrammar
from xgrammar.testing import _is_grammar_accept_string as accepts

from api.inference.tool_grammar import MAX_WHITESPACE_RUN, structural_tag
from tests.inference.tool_calls import TOOLS

HEAD = '<tool_call>\n{"name": "add", "arguments": '
TAIL = '}\n</tool_call>'


def grammar(choice) -> xgrammar.Grammar:
    return xgrammar.Grammar.from_structural_tag(structural_tag(TOOLS, choice))


def test_a_named_call_passes_in_its_own_format_and_pretty_printed():
    named = grammar({"type": "function", "function": {"name": "add"}})
    assert accepts(named, HEAD + '{"a": 2, "b": 3}' + TAIL)
    assert accepts(named, HEAD + '{\n        "a": 2,\n        "b": 3\n    }' + TAIL)
    assert not accepts(named, HEAD + '{"a": "two"}' + TAIL)  # the schema holds


def test_a_whitespace_run_longer_than_the_cap_is_refused():
    for choice in ({"type": "function", "function": {"name": "add"}}, "required"):
        held = grammar(choice)
        assert accepts(held, HEAD + "{" + " " * MAX_WHITESPACE_RUN + '"a": 2}' + TAIL)
        assert not accepts(held, HEAD + "{" + " " * (MAX_WHITESPACE_RUN + 1) + '"a": 2}' + TAIL)
        assert not accepts(held, HEAD + '{"a":' + "\n\t \r" * 8 + "2}" + TAIL)
