"""A notebook on another machine, as a script: run by tests/ecosystem/test_remote_tokenizer.py in a
subprocess whose HOME, HF_HOME and working directory are fresh temporary folders, with
HF_HUB_OFFLINE=1. It uses only installed packages (tinker, loraplex, transformers), never this
repository, and prints one JSON object of what it saw.

    python remote_client.py '{"base_url": ..., "api_key": ..., "model": "tiny", "pull": "cli" | "sdk"}'
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import tinker
from tinker import types

TEXT = "What is 2 + 3? 2 + 3 = 5"


def tokenizer_error(load) -> str | None:
    try:
        load()
    except OSError as e:  # what transformers raises for a hub id it can find neither online nor cached
        return str(e)[:300]
    return None


def pull(args: dict) -> str:
    if args["pull"] == "cli":  # the console script of the installed loraplex package
        loraplex_cli = Path(sys.executable).with_name("loraplex")
        done = subprocess.run([str(loraplex_cli), "tokenizer", "pull", args["model"], "--base-url", args["base_url"],
                               "--api-key", args["api_key"]], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout
    import loraplex

    pulled = loraplex.pull_tokenizer(args["base_url"], args["api_key"], args["model"])
    return f"{pulled.model} {pulled.revision} {pulled.path} {list(pulled.downloaded)}"


def main(args: dict) -> dict:
    from transformers import AutoTokenizer

    service = tinker.ServiceClient(base_url=args["base_url"], api_key=args["api_key"])
    training = service.create_lora_training_client(base_model=args["model"], rank=4, seed=0).result()
    info = training.get_info()
    hub_id = info.model_data.tokenizer_id
    seen = {"get_info": info.model_dump(mode="json"),
            "capabilities": [m.model_name for m in tinker.RestClient(base_url=args["base_url"], api_key=args["api_key"])
                             .get_server_capabilities().result().supported_models],
            # before the pull: nothing of the server's is readable here
            "error_before_pull": tokenizer_error(training.get_tokenizer),
            "auto_error_before_pull": tokenizer_error(lambda: AutoTokenizer.from_pretrained(hub_id))}
    seen["pull_output"] = pull(args)

    tokenizer = training.get_tokenizer()  # tinker's own loader: AutoTokenizer.from_pretrained(tokenizer_id)
    tokens = tokenizer.encode(TEXT)
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(tokens[1:]),
                                        "weights": np.ones(len(tokens) - 1, np.float32)})
    out = training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    seen |= {
        "tokens": tokens,
        "loss": out.metrics["loss:sum"],
        "sampler_base_model": sampler.get_base_model(),
        "sampler_tokens": sampler.get_tokenizer().encode(TEXT),  # by base-model name, as tinker does
        "auto_tokens": AutoTokenizer.from_pretrained(hub_id).encode(TEXT),
        "chat": tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False),
    }
    return seen


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
