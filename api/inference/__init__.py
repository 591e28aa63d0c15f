"""The middleman: OpenAI- and Anthropic-compatible inference over tenants' sampler snapshots
(docs/inference-proxy.md).

An agent harness written against the `openai` SDK points its `base_url` at `<server>/oai/api/v1` and
its `api_key` at a tenant's key; every call samples through the same multi-LoRA sampler as `asample`
(its batches and quotas) and is recorded in the rollout store (db/rollouts.py) with the exact
tokens, logprobs and policy version, for training without a string round trip.

    openai_api.py  the routes: chat/completions, completions, models; the rest answers "not supported"
    responses_api.py, responses_params.py, responses_answers.py, responses_stream.py: OpenAI Responses
    anthropic_api.py, anthropic_params.py, anthropic_answers.py, anthropic_stream.py: Anthropic Messages
    calls.py       what every API shares: the key, `model`, the body, errors, sampling and recording a turn
    event_streams.py  stream: true as named server-sent events (Anthropic's and Responses' format)
    params.py      the request bodies, and what is done with every OpenAI parameter
    targets.py     `model` -> the snapshot that answers (sampler path, policy alias, base model)
    rendering.py   messages -> prompt tokens (the chat template), tokens -> text, tool calls
    generate.py    a prompt through the sampler: submitted like asample, awaited in the route
    responses.py   the answers, as the `openai` package's own types
    streaming.py   `stream: true`: the engine's tokens as server-sent events, the turn recorded at the end
    chunks.py      the streamed chunks, as the `openai` package's own types, and the text safe to send
    errors.py      errors in OpenAI's shape, naming the field
    keys.py        the key as a bearer token or x-api-key (and handed to the request guard)
"""
