"use strict";
// A trajectory's turns: the prompt (folded: its messages, and the text the sampler saw), what came in since
// the turn before (a tool's output, the environment's answer), and the sampled tokens as a heatmap of the
// sampler's logprob of each beside the trainer's: where the two disagree, the colours differ.
(() => {
  const {el, number} = Dash;
  const {runId, sessionId} = Dash.scriptData();

  const shown = (text) => text.replace(/\n/g, "↵").replace(/\t/g, "⇥");
  // logprob -10 (or less) red ... 0 green: a log scale, so a small model's spread still shows
  const heat = (logprob) => (logprob === null || logprob === undefined
    ? "#e9ecef" : `hsl(${Math.round(120 * Math.max(0, 1 + Math.min(0, logprob) / 10))} 75% 80%)`);

  function tokenSpans(choice, logprobs, side) {
    return choice.tokens.map((token, i) => {
      const lp = logprobs ? logprobs[i] : null;
      const sampler = choice.sampler_logprobs[i];
      const trainer = choice.trainer_logprobs ? choice.trainer_logprobs[i] : null;
      const tip = `token ${token} · sampler ${number(sampler)} · trainer ${number(trainer)}`;
      return el("span", {className: "tok", tabIndex: 0, title: tip, "aria-label": tip, style: `background: ${heat(lp)}`,
                         dataset: {side, token, samplerLogprob: sampler, trainerLogprob: trainer ?? ""}},
                shown(choice.token_texts[i]));
    });
  }

  function tokenTable(choice) {
    const rows = choice.tokens.map((token, i) => {
      const sampler = choice.sampler_logprobs[i];
      const trainer = choice.trainer_logprobs ? choice.trainer_logprobs[i] : null;
      return el("tr", {}, el("td", {className: "num"}, i), el("td", {}, shown(choice.token_texts[i])),
        el("td", {className: "num"}, token), el("td", {className: "num"}, number(sampler)),
        el("td", {className: "num"}, number(trainer)),
        el("td", {className: "num"}, trainer === null ? "–" : number(trainer - sampler)));
    });
    return el("details", {}, el("summary", {}, "Per-token numbers"),
      el("table", {}, el("thead", {}, el("tr", {}, ...["#", "text", "token id", "sampler logprob", "trainer logprob",
                                                         "trainer − sampler"].map((h) => el("th", {scope: "col"}, h)))),
         el("tbody", {}, rows)));
  }

  function choiceBlock(choice) {
    const trained = choice.trainer_logprobs !== null;
    return el("section", {className: "choice", dataset: {choice: choice.choice}},
      el("h3", {}, `Choice ${choice.choice} · reward ${number(choice.reward)} · ${choice.finish_reason} · `
                   + `${choice.tokens.length} tokens`),
      el("div", {className: "charts"},
        el("div", {}, el("h4", {}, "Sampler logprob"), el("div", {className: "tokens sampler"},
          tokenSpans(choice, choice.sampler_logprobs, "sampler"))),
        el("div", {}, el("h4", {}, "Trainer logprob"), trained
          ? el("div", {className: "tokens trainer"}, tokenSpans(choice, choice.trainer_logprobs, "trainer"))
          : el("p", {className: "empty"}, "Not trained yet (or trained in a datum that does not match it token for token)."))),
      tokenTable(choice));
  }

  let drawn = null;  // the trajectory as last drawn (JSON)

  async function refresh() {
    const path = `/runs/${encodeURIComponent(runId)}/trajectories/${encodeURIComponent(sessionId)}`;
    const trajectory = await Dash.getJSON(path).catch((error) => {
      Dash.showError(document.getElementById("trajectory-error"), error);
      throw error;
    });
    const text = JSON.stringify(trajectory);
    if (text === drawn) return true;  // unchanged: the page stays as the reader left it (open tables, focus)
    drawn = text;
    document.getElementById("trajectory-summary").textContent =
      `${trajectory.turns.length} turn${trajectory.turns.length === 1 ? "" : "s"} · `
      + `trajectory reward ${number(trajectory.reward)}`;
    document.getElementById("turns").replaceChildren(...trajectory.turns.map((turn) => el("section", {className: "turn"},
      el("h2", {}, `Turn ${turn.turn} · policy version ${turn.policy_version ?? "base model"} · `
                   + `${turn.prompt_tokens} prompt tokens`),
      turn.new_input_text !== null
        ? el("div", {className: "new-input"}, el("h4", {}, "Since the last turn (tool, environment or user)"),
             el("pre", {className: "prompt"}, turn.new_input_text))
        : null,
      el("details", {className: "prompt-block"}, el("summary", {}, `Prompt as the sampler saw it (${turn.prompt_tokens} tokens)`),
        turn.messages ? el("ol", {className: "messages"}, turn.messages.map((m) => el("li", {dataset: {role: m.role}},
          el("strong", {}, `${m.role}: `), m.content))) : null,
        el("pre", {className: "prompt"}, turn.prompt_text)),
      turn.choices.map(choiceBlock))));
    return true;  // later turns, rewards and the trainer's logprobs arrive while it is open
  }

  Dash.poll(refresh);
})();
