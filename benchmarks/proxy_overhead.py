"""What the OpenAI-compatible inference API (api/inference/) costs against direct `sample`, side by side.

    .venv/bin/python -m benchmarks.proxy_overhead [--model SmolLM2-135M-Instruct] [--prompts 8]
        [--max-tokens 64] [--rounds 5] [--latency-probes 8]      # from the repository root

It starts `python -m service serve` (embedded: API, scheduler, trainer and vLLM sampler in one
process of its own) on loopback, saves a LoRA snapshot of a new training run, and sends the same
`prompts` chat prompts, with the same seeds, three ways in every round (the order rotating from
round to round):
  direct      loraplex `SamplingClient.sample` of the chat-rendered prompt tokens (all at once)
  completions `POST /oai/api/v1/completions` with those token ids as the prompt (openai SDK, all at once)
  chat        `POST /oai/api/v1/chat/completions` with the messages, rendered by the server (openai SDK)
Throughput is generated tokens / wall time of the round's batch, per way; the proxy ways record
every call in the rollout store, which is part of what they cost. The ratio is proxy / direct.

Latency, one request at a time (`latency-probes` each, median): the time to the first streamed token
of a chat call with `stream: true`, beside the time a direct `sample` of one token takes (the first
token a caller of the non-streaming API can hold), and a non-streaming chat call of one token.
Writes benchmarks/results/proxy_overhead.json (every figure) and proxy_overhead.md (the table).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import loraplex
import openai
import typer
from loraplex import types
from transformers import AutoTokenizer

from models.registry import model_info
from service.embedded import free_port
from tests.distributed.processes import create_tenant_key, start_service, wait_healthy
from tests.reliability.processes import stop

RESULTS = Path(__file__).parent / "results"
WAYS = ("direct", "completions", "chat")
QUESTIONS = ("Tell me about the sea.", "How do plants grow?", "Write a short story about a cat.",
             "Why is the sky blue?", "Describe a busy market.", "What makes a good friend?",
             "Explain how a bicycle works.", "Write a poem about winter.")


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" (request {i})"}]


class Ways:
    """The three ways to sample one prompt; each returns the number of tokens generated."""

    def __init__(self, base_url: str, key: str, base_model: str, tokenizer, max_tokens: int) -> None:
        service = loraplex.ServiceClient(base_url=base_url, api_key=key)
        training = service.create_lora_training_client(base_model, rank=16, seed=0)
        self.snapshot = training.save_weights_for_sampler("bench").result().path
        self.sampler = service.create_sampling_client(model_path=self.snapshot)
        self.oai = openai.OpenAI(base_url=f"{base_url}/oai/api/v1", api_key=key, max_retries=0, timeout=600)
        self.tokenizer, self.max_tokens = tokenizer, max_tokens

    def prompt(self, i: int) -> list[int]:
        return self.tokenizer.apply_chat_template(messages(i), add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"]

    def direct(self, i: int, max_tokens: int | None = None):
        params = types.SamplingParams(max_tokens=max_tokens or self.max_tokens, temperature=1.0, seed=i)
        return self.sampler.sample(types.ModelInput.from_ints(self.prompt(i)), 1, params)

    def completions(self, i: int) -> int:
        answer = self.oai.completions.create(model=self.snapshot, prompt=self.prompt(i), max_tokens=self.max_tokens,
                                             temperature=1.0, seed=i)
        return answer.usage.completion_tokens

    def chat(self, i: int, max_tokens: int | None = None) -> int:
        answer = self.oai.chat.completions.create(model=self.snapshot, messages=messages(i), temperature=1.0, seed=i,
                                                  max_tokens=max_tokens or self.max_tokens)
        return answer.usage.completion_tokens

    def first_streamed_token(self, i: int) -> float:
        start = time.perf_counter()
        stream = self.oai.chat.completions.create(model=self.snapshot, messages=messages(i), temperature=1.0, seed=i,
                                                  max_tokens=self.max_tokens, stream=True)
        try:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    return time.perf_counter() - start
        finally:
            stream.close()
        raise RuntimeError("the stream carried no token")


def batch(ways: Ways, way: str, prompts: int, pool: ThreadPoolExecutor) -> tuple[float, int]:
    """All prompts at once one way: (seconds until the last answer, tokens generated)."""
    start = time.perf_counter()
    if way == "direct":
        futures = [ways.direct(i) for i in range(prompts)]
        tokens = sum(len(f.result().sequences[0].tokens) for f in futures)
    else:
        tokens = sum(pool.map(getattr(ways, way), range(prompts)))
    return time.perf_counter() - start, tokens


def latency(ways: Ways, probes: int) -> dict:
    def timed(call) -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    out = {"direct_one_token_ms": [1000 * timed(lambda: ways.direct(i, 1).result()) for i in range(probes)],
           "chat_one_token_ms": [1000 * timed(lambda: ways.chat(i, 1)) for i in range(probes)]}
    try:
        out["chat_stream_first_token_ms"] = [1000 * ways.first_streamed_token(i) for i in range(probes)]
    except openai.BadRequestError as e:  # streaming not available on this server
        out["chat_stream_first_token_ms"] = None
        out["stream_refused"] = str(e)[:300]
    return out


def measure(base_url: str, key: str, model: str, prompts: int, max_tokens: int, rounds: int, probes: int) -> dict:
    info = model_info(model)
    ways = Ways(base_url, key, info.name, AutoTokenizer.from_pretrained(info.path), max_tokens)
    runs: dict[str, list[tuple[float, int]]] = {way: [] for way in WAYS}
    with ThreadPoolExecutor(prompts) as pool:
        for way in WAYS:  # warm-up: the snapshot loaded into the sampler, tokenizers and templates cached
            batch(ways, way, 2, pool)
        for r in range(rounds):
            for way in WAYS[r % 3:] + WAYS[:r % 3]:
                runs[way].append(batch(ways, way, prompts, pool))
                print(f"round {r} {way}: {runs[way][-1][1]} tokens in {runs[way][-1][0]:.2f} s", flush=True)
    rates = {way: statistics.median(tokens / seconds for seconds, tokens in runs[way]) for way in WAYS}
    return {"model": info.name, "prompts": prompts, "max_tokens": max_tokens, "rounds": rounds,
            "runs": {way: [{"seconds": s, "tokens": t} for s, t in runs[way]] for way in WAYS},
            "tokens_per_second": rates,
            "ratio_to_direct": {way: rates[way] / rates["direct"] for way in WAYS[1:]},
            "latency": latency(ways, probes)}


def median(values) -> str:
    return "n/a" if not values else f"{statistics.median(values):.1f}"


def table(result: dict) -> list[str]:
    rates, ratio, lat = result["tokens_per_second"], result["ratio_to_direct"], result["latency"]
    stream = lat["chat_stream_first_token_ms"]
    lines = ["| measure | value |", "|---|---|"]
    lines += [f"| {way}: generated tokens/s (median of {result['rounds']} rounds) | {rates[way]:.1f} |" for way in WAYS]
    lines += [f"| **{way} / direct** (tokens/s) | **{ratio[way]:.2f}x** |" for way in WAYS[1:]]
    lines += [f"| direct `sample` of 1 token, one at a time (ms, median) | {median(lat['direct_one_token_ms'])} |",
              f"| chat.completions of 1 token, one at a time (ms, median) | {median(lat['chat_one_token_ms'])} |",
              f"| chat.completions `stream: true`, time to first token (ms, median) | "
              f"{median(stream) if stream else 'not supported: ' + lat.get('stream_refused', '')} |"]
    return lines


def main(model: str = "tiny", prompts: int = 8, max_tokens: int = 64, rounds: int = 5, latency_probes: int = 8,
         write: bool = True) -> None:
    data_dir, port = Path(tempfile.mkdtemp(prefix="proxy-overhead-")), free_port()
    env = os.environ | {"LORAPLEX_BASE_MODEL": model, "LORAPLEX_DATA_DIR": str(data_dir),
                        "LORAPLEX_MAX_LORA_RANK": "16", "LORAPLEX_SAMPLER_KV_CACHE_GIB": "0.5",
                        "LORAPLEX_LONG_POLL_SECONDS": "10"}
    server = start_service("serve", env, "--port", str(port))
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, base_url, seconds=600)
        key = create_tenant_key(f"sqlite:///{(data_dir / 'loraplex.db').resolve()}", "bench")
        result = measure(base_url, key, model, prompts, max_tokens, rounds, latency_probes)
    finally:
        stop(server)
    command = (f".venv/bin/python -m benchmarks.proxy_overhead --model {model} --prompts {prompts} "
               f"--max-tokens {max_tokens} --rounds {rounds} --latency-probes {latency_probes}")
    lines = table(result)
    print("\n".join(lines))
    if write:  # the latest run of each model: one entry per model in the JSON, one table each in the .md
        RESULTS.mkdir(exist_ok=True)
        path = RESULTS / "proxy_overhead.json"
        runs = json.loads(path.read_text()) if path.exists() else {}
        runs[result["model"]] = {"command": command, "cpu_count": os.cpu_count(), **result}
        path.write_text(json.dumps(runs, indent=2) + "\n")
        (RESULTS / "proxy_overhead.md").write_text("\n".join(
            f"## {model}\n\nCommand: `{run['command']}` (`python -m service serve` with the vLLM sampler on "
            f"loopback, a LoRA rank 16 snapshot, temperature 1, {run['cpu_count']} CPU cores)\n\n"
            + "\n".join(table(run)) + "\n" for model, run in runs.items()))


if __name__ == "__main__":
    typer.run(main)
