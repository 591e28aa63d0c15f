"use strict";
// The run list: names and tags, status, base model, hyperparameters, steps, last activity, checkpoints
// with their TTL and publish state; filter and sort; tick runs to compare them side by side.
(() => {
  const {el, number, ago, until, runUrl} = Dash;
  const isAdmin = Dash.scriptData().admin === "true";
  const tbody = document.querySelector("#runs tbody");
  const compare = document.getElementById("compare");
  const includeDeleted = document.getElementById("include-deleted");
  const selected = new Set();  // kept across refreshes

  function checkpointTags(checkpoints) {
    if (checkpoints.length === 0) return el("span", {className: "muted"}, "none");
    return checkpoints.map((c) => el("span", {
      className: `tag${c.public ? " public" : ""}`, title: c.tinker_path,
    }, `${c.checkpoint_id} · ${c.public ? "published" : "private"} · ${until(c.expires_at)}`));
  }

  const filter = document.getElementById("filter");
  let sortKey = "last_activity", descending = true;  // newest activity first
  let runs = [];

  // What a run is called on every page: its name (its or its session's metadata), else its id.
  function hyperparameters(run) {
    const c = run.lora_config;
    const targets = ["attn", "mlp", "unembed"].filter((t) => c[`train_${t}`]).join("+");
    const lr = run.learning_rate === null ? "" : ` · lr ${Dash.number(run.learning_rate)}`;
    return `rank ${c.rank} · alpha ${Dash.number(c.alpha)} · ${targets} · ${run.optimizer}${lr}`;
  }

  function matches(run, text) {
    const haystack = [run.name, run.run_id, run.base_model, ...run.tags, JSON.stringify(run.user_metadata)]
      .filter(Boolean).join(" ").toLowerCase();
    return text.toLowerCase().split(/\s+/).every((word) => haystack.includes(word));
  }

  function sorted(list) {
    const value = (run) => (sortKey === "name" ? (run.name || run.run_id).toLowerCase() : run[sortKey]);
    return [...list].sort((a, b) => (value(a) < value(b) ? -1 : value(a) > value(b) ? 1 : 0) * (descending ? -1 : 1));
  }

  function row(run) {
    const box = el("input", {type: "checkbox", name: "run", value: run.run_id, checked: selected.has(run.run_id),
                             "aria-label": `select ${run.name || run.run_id}`});
    box.addEventListener("change", () => {
      if (box.checked) selected.add(run.run_id); else selected.delete(run.run_id);
      compare.disabled = selected.size < 2;
    });
    const requests = [`${run.requests.pending} pending`];
    if (run.requests.failed) requests.push(`${run.requests.failed} failed`);
    return el("tr", {dataset: {runId: run.run_id}},
      el("td", {}, box),
      el("td", {}, el("a", {href: runUrl(run.run_id), title: run.run_id, className: "run-name"}, run.name || run.run_id),
        ...run.tags.map((tag) => el("span", {className: "tag"}, tag))),
      isAdmin ? el("td", {}, run.tenant_name) : null,
      el("td", {}, el("span", {className: `status ${run.status === "running" ? "active" : run.status}`}, run.status)),
      el("td", {}, run.base_model),
      el("td", {className: "muted"}, hyperparameters(run)),
      el("td", {className: "num"}, number(run.steps)),
      el("td", {title: Dash.time(run.last_activity)}, ago(run.last_activity)),
      el("td", {className: run.requests.failed ? "bad" : ""}, requests.join(", ")),
      el("td", {}, checkpointTags(run.checkpoints)));
  }

  function draw() {
    Dash.fillTable(tbody, sorted(runs.filter((run) => matches(run, filter.value.trim()))).map(row),
                   document.getElementById("no-runs"));
    compare.disabled = selected.size < 2;
  }

  async function refresh() {
    ({runs} = await Dash.getJSON(`/runs?include_deleted=${includeDeleted.checked}`));
    draw();
  }

  for (const button of document.querySelectorAll("button.sort")) {
    button.addEventListener("click", () => {
      descending = sortKey === button.dataset.key ? !descending : button.dataset.key !== "name";
      sortKey = button.dataset.key;
      draw();
    });
  }
  filter.addEventListener("input", draw);
  includeDeleted.addEventListener("change", refresh);
  Dash.poll(refresh);
})();
