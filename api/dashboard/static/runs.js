"use strict";
// The run list: status, base model, rank, steps, last activity, checkpoints with their TTL and
// publish state; tick runs to compare them side by side.
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

  function row(run) {
    const box = el("input", {type: "checkbox", name: "run", value: run.run_id, checked: selected.has(run.run_id),
                             "aria-label": `select ${run.run_id}`});
    box.addEventListener("change", () => {
      if (box.checked) selected.add(run.run_id); else selected.delete(run.run_id);
      compare.disabled = selected.size < 2;
    });
    const requests = [`${run.requests.pending} pending`];
    if (run.requests.failed) requests.push(`${run.requests.failed} failed`);
    return el("tr", {dataset: {runId: run.run_id}},
      el("td", {}, box),
      el("td", {}, el("a", {href: runUrl(run.run_id)}, run.run_id)),
      isAdmin ? el("td", {}, run.tenant_name) : null,
      el("td", {}, el("span", {className: `status ${run.status === "running" ? "active" : run.status}`}, run.status)),
      el("td", {}, run.base_model),
      el("td", {className: "num"}, number(run.lora_rank)),
      el("td", {className: "num"}, number(run.steps)),
      el("td", {title: Dash.time(run.last_activity)}, ago(run.last_activity)),
      el("td", {className: run.requests.failed ? "bad" : ""}, requests.join(", ")),
      el("td", {}, checkpointTags(run.checkpoints)));
  }

  async function refresh() {
    const {runs} = await Dash.getJSON(`/runs?include_deleted=${includeDeleted.checked}`);
    Dash.fillTable(tbody, runs.map(row), document.getElementById("no-runs"));
    compare.disabled = selected.size < 2;
  }

  includeDeleted.addEventListener("change", refresh);
  Dash.poll(refresh);
})();
