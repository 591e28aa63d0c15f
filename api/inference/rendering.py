"""Messages to prompt tokens with the base model's own chat template, and sampled tokens back to text.

transformers' tokenizer does both (`apply_chat_template`, `decode`); vLLM's Hermes parser reads tool
calls out of the text. Both load lazily: an API replica imports no transformers until a call needs
its tokenizer (tests/test_import_footprint.py), and vLLM only when a call passes tools.

The prompt the sampler gets is exactly what is rendered here, and the tokens it returns are stored
as they are: text only ever goes out to the caller, never back into what is trained.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from api.inference.errors import InferenceError

ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = {"role", "content", "name", "tool_call_id", "tool_calls", "refusal"}
# One call at a time into a tokenizer: the routes run in a thread pool, and a fast tokenizer whose
# settings change while another thread uses it fails with "Already borrowed" (tokenizers' Rust RefCell).
_USE = threading.Lock()


@lru_cache(maxsize=4)
def tokenizer_of(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@lru_cache(maxsize=4)
def end_token_ids(model_path: str) -> frozenset[int]:
    """The tokens that end a sample on their own (EOS, as vLLM reads it: the tokenizer's and the
    generation config's); the caller's text leaves them out."""
    ids = {tokenizer_of(model_path).eos_token_id}
    config = Path(model_path, "generation_config.json")
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos])
    return frozenset(i for i in ids if isinstance(i, int))


@lru_cache(maxsize=4)
def max_token_bytes(model_path: str) -> int:
    """The UTF-8 length of the tokenizer's longest vocabulary entry, as the vocabulary spells it (added and
    special tokens included): no token stands for more text (api/input_policy.py, prompt_byte_limit)."""
    vocab = tokenizer_of(model_path).get_vocab()
    return max((len(token.encode("utf-8", "surrogatepass")) for token in vocab), default=1)


# --- requests -----------------------------------------------------------------------------------


def _text_content(content: Any, where: str) -> str | None:
    """A message's content as the template takes it: a string (text parts joined as vLLM joins them)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InferenceError(400, f"{where}: a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise InferenceError(400, f"{where}[{j}].type: only text parts are supported, got {str(kind)[:40]!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's tool calls, arguments parsed from their JSON text (templates print them
    with `tojson`, as vLLM hands them over)."""
    if not isinstance(calls, list):
        raise InferenceError(400, f"{where}: a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InferenceError(400, f"{where}[{j}].function: needs a name and arguments")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass  # a template gets the text as it came
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def template_messages(messages: list[Any]) -> list[dict]:
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InferenceError(400, f"{where}: expected an object with a role and content")
        role = message.get("role")
        if role not in ROLES:
            raise InferenceError(400, f"{where}.role: one of {', '.join(ROLES)}, got {str(role)[:40]!r}")
        for key in message:
            if key not in _MESSAGE_KEYS:
                raise InferenceError(400, f"{where}.{str(key)[:40]}: not supported by this server")
        if message.get("refusal") is not None:
            raise InferenceError(400, f"{where}.refusal: not supported by this server")
        content = _text_content(message.get("content"), f"{where}.content")
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise InferenceError(400, f"{where}.content: required (only an assistant message with tool_calls may "
                                      "leave it out)")
        rendered: dict[str, Any] = {"role": role, "content": content}
        for key in ("name", "tool_call_id"):
            if key in message:
                if not isinstance(message[key], str):
                    raise InferenceError(400, f"{where}.{key}: a string")
                rendered[key] = message[key]
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise InferenceError(400, f"{where}.tool_calls: only assistant messages make tool calls")
            rendered["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        out.append(rendered)
    return out


def _template_source(tokenizer) -> str:
    template = tokenizer.chat_template
    return json.dumps(template) if isinstance(template, dict) else str(template or "")


def tool_parser_name(tokenizer) -> str | None:
    """vLLM's tool-call parser that fits the model's chat template, or None. Only Hermes-style
    <tool_call>{json}</tool_call> is wired up."""
    return "hermes" if "<tool_call>" in _template_source(tokenizer) else None


def check_tools(tokenizer, tools: list[dict], model_name: str) -> None:
    for i, tool in enumerate(tools):
        function = tool.get("function")
        named = isinstance(function, dict) and isinstance(function.get("name"), str)
        if tool.get("type") != "function" or not named:
            raise InferenceError(400, f"tools[{i}]: only {{\"type\": \"function\", \"function\": {{\"name\", ...}}}} "
                                      "tools are supported")
    source = _template_source(tokenizer)
    if "tools" not in source:
        raise InferenceError(400, f"tools: the chat template of {model_name} does not render tools")
    if tool_parser_name(tokenizer) is None:
        raise InferenceError(400, f"tools: the chat template of {model_name} has no tool-call format this server "
                                  "parses (Hermes-style <tool_call>{json}</tool_call>)")


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None, model_name: str) -> list[int]:
    from jinja2 import TemplateError

    if not tokenizer.chat_template:
        raise InferenceError(400, f"messages: {model_name} has no chat template; send token ids to /completions")
    try:
        with _USE:
            encoded = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)
    except (TemplateError, ValueError) as e:
        raise InferenceError(400, f"messages: the chat template of {model_name} cannot render them: {e}") from None
    return [int(t) for t in encoded["input_ids"]]


def prompt_tokens(tokenizer, prompt: str | list, vocab_size: int) -> list[int]:
    """/completions' prompt: a string (tokenized as vLLM does, special tokens added) or token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        with _USE:
            tokens = tokenizer(prompt)["input_ids"]
    elif prompt and all(isinstance(t, int) for t in prompt):
        tokens = prompt
    else:
        raise InferenceError(400, "prompt: one prompt per request (a string or token ids); use n for several samples")
    if not tokens:
        raise InferenceError(400, "prompt: needs at least one token")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InferenceError(400, f"prompt: token id {bad} is not in [0, {vocab_size})")
    return [int(t) for t in tokens]


# --- answers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class Completion:
    text: str | None
    tool_calls: list[ToolCall]
    finish_reason: str  # "stop" | "length" | "tool_calls"


def completion_of(tokenizer, model_path: str, tokens: list[int], stop_reason: str, stop_strings: tuple[str, ...],
                  parse_tools: bool) -> Completion:
    """The text of sampled `tokens` as OpenAI answers it: without the end token, cut before a stop
    string, and with tool calls taken out when the call passed tools (special tokens kept then, as
    vLLM keeps them: some models' <tool_call> is one)."""
    if stop_reason == "stop" and tokens and tokens[-1] in end_token_ids(model_path):
        tokens = tokens[:-1]
    with _USE:
        text = tokenizer.decode(tokens, skip_special_tokens=not parse_tools)
    if stop_reason == "stop" and stop_strings:
        cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
    finish = "length" if stop_reason == "length" else "stop"
    if not parse_tools:
        return Completion(text, [], finish)
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    found = Hermes2ProToolParser(tokenizer).extract_tool_calls(text, request=None)
    if not found.tools_called:
        return Completion(text, [], finish)
    calls = [ToolCall(call.id, call.function.name, call.function.arguments) for call in found.tool_calls]
    return Completion(found.content, calls, "tool_calls")


def token_strings(tokenizer, tokens: list[int], as_ids: bool) -> list[str]:
    """Each token as the logprobs answer names it: its text, or "token_id:<id>" (vLLM's extension)."""
    if as_ids:
        return [f"token_id:{t}" for t in tokens]
    with _USE:
        return [tokenizer.decode([t]) for t in tokens]
