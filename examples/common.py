"""What the examples share: chat prompts as token ids, per-step logs, learning-curve plots."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def chat_prompt(tokenizer, user_text: str) -> list[int]:
    """The token ids of a one-turn chat up to where the assistant's answer starts (the base
    model's own chat template when it has one, else a plain "Q:/A:" layout)."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": user_text}], add_generation_prompt=True,
                                             tokenize=False)
    else:
        text = f"Q: {user_text}\nA: "
    return tokenizer.encode(text, add_special_tokens=False)


def end_of_answer(tokenizer) -> int:
    """The token that ends an assistant answer: the chat template's end of turn, else EOS."""
    for token in ("<|im_end|>", "<|eot_id|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            return token_id
    return tokenizer.eos_token_id


@dataclass
class RunLog:
    """One run's per-step metrics, appended to `<results>/<name>.jsonl` as they come, and sent to the
    service with `training.log_metrics` when a training client is given: the dashboard then charts
    the rewards and evals only the example knows next to the service's own numbers (docs/dashboard.md)."""

    name: str
    results: Path = RESULTS
    training: object | None = None  # a loraplex TrainingClient
    rows: list[dict] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.results.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")

    @property
    def path(self) -> Path:
        return self.results / f"{self.name}.jsonl"

    def log(self, **metrics) -> None:
        row = {"seconds": round(time.monotonic() - self.started, 2), **metrics}
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        numbers = {k: v for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))
                   and not isinstance(v, bool) and math.isfinite(v)}
        if self.training is not None and numbers:
            self.training.log_metrics(numbers, step=metrics.get("step"))
        print(f"[{self.name}] " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                           for k, v in row.items()), flush=True)


def plot(log: RunLog, curves: list[str]) -> Path:
    """A PNG of the given metrics against the step, one panel each: `<results>/<name>.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(4 * len(curves), 3.2), squeeze=False)
    for ax, name in zip(axes[0], curves):
        points = [(row["step"], row[name]) for row in log.rows if row.get(name) is not None]
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(log.name)
    fig.tight_layout()
    path = log.results / f"{log.name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
