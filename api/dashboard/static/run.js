"use strict";
// One run: every series on the optimizer-step axis (a step's rollouts at the step they feed), RL groups per
// step, recent failed requests. Times are wall-clock (docs/dashboard.md).
// Polls with ?since=last_step-1 and replaces the points it holds at those steps (the newest step
// may still change, docs/dashboard.md).
(() => {
  const {el, number} = Dash;
  const runId = Dash.scriptData().runId;
  const base = `/runs/${encodeURIComponent(runId)}`;

  // The service's own series (no client code needed), one chart each or a few together.
  const SERVICE_CHARTS = [
    {id: "chart-loss", title: "Loss per token", unit: "nats/token", series: [["loss", "loss"]]},
    {id: "chart-grad-norm", title: "Gradient norm (before clipping)", series: [["grad_norm", "grad norm"]]},
    {id: "chart-learning-rate", title: "Learning rate", series: [["learning_rate", "learning rate"]]},
    {id: "chart-tokens", title: "Tokens trained per step", unit: "tokens", series: [["tokens", "tokens"]]},
    {id: "chart-stall", title: "Stall time per step", unit: "s", series: [
      ["train/queue_seconds", "trainer: waiting"], ["train/compute_seconds", "trainer: computing"],
      ["sample/seconds", "sampler: wait + compute (wall)"]]},
    {id: "chart-sampler-throughput", title: "Sampler throughput", unit: "tokens/s",
     series: [["sample/tokens_per_second", "tokens/s"]]},
    {id: "chart-sampled-tokens", title: "Tokens sampled from each snapshot", unit: "tokens",
     series: [["sample/tokens", "tokens"]]},
    {id: "chart-staleness", title: "Policy staleness", unit: "steps", series: [["staleness", "steps behind"]]},
    {id: "chart-entropy", title: "Entropy of sampled tokens", unit: "nats/token", series: [["entropy", "entropy"]]},
    {id: "chart-logprob-gap", title: "Sampler–trainer logprob gap", unit: "nats",
     series: [["logprob_gap/mean_abs", "mean |diff|"], ["logprob_gap/kl", "KL (k3)"]]},
    {id: "chart-prefix-overlap", title: "Prefix overlap of RL groups", unit: "fraction",
     series: [["prefix_overlap", "overlap"]]},
  ];
  const SERVICE_NAMES = new Set(SERVICE_CHARTS.flatMap((c) => c.series.map(([name]) => name)));

  const chartsNode = document.getElementById("charts");
  Charts.smoothingControl(document.getElementById("smoothing"));
  const clientNote = document.getElementById("no-client-metrics");
  const clientNode = document.getElementById("client-charts");

  const serviceCharts = SERVICE_CHARTS.map((spec) => ({spec, chart: new Charts.LineChart(chartsNode, {
    id: spec.id, title: spec.title, unit: spec.unit, series: spec.series.map(([, label]) => ({label}))})}));
  const clientCharts = new Map();  // group ("reward", "eval", ...) -> LineChart
  const otherCharts = new Map();  // a service series this page does not know yet -> its own chart

  const points = new Map();  // series name -> Map(step -> value)
  const units = new Map();  // series name -> unit
  const clientNames = new Set();
  let lastStep = -1;

  function merge(series, since) {
    for (const [name, {points: list, source, unit}] of Object.entries(series)) {
      if (source === "client") clientNames.add(name);
      units.set(name, unit);
      if (!points.has(name)) points.set(name, new Map());
      const held = points.get(name);
      for (const step of [...held.keys()]) if (step > since) held.delete(step);
      for (const [step, value] of list) held.set(step, value);
    }
  }

  function draw(chart, names, labels) {
    const {xs, ys} = Charts.align(names.map((name) => [...(points.get(name) || new Map()).entries()]));
    chart.setData(xs, ys, labels.map((label) => ({label})));
  }

  // The client's series, grouped by their first path segment ("reward/mean" and "reward/max" share a
  // chart), in charts of their own: a client name that a service series also has ("entropy", which the
  // API answers as "client/entropy") is never drawn with the service's.
  function drawClientCharts() {
    const groups = new Map();
    for (const name of [...clientNames].sort()) {
      const own = name.replace(/^client\//, "");
      const group = own.includes("/") ? own.slice(0, own.indexOf("/")) : own;
      if (!groups.has(group)) groups.set(group, []);
      groups.get(group).push(name);
    }
    clientNote.hidden = groups.size > 0;
    for (const [group, names] of groups) {
      const labels = names.map((name) => name.replace(/^client\//, ""));
      if (!clientCharts.has(group)) {
        clientCharts.set(group, new Charts.LineChart(clientNode, {id: `chart-client-${group.replace(/[^\w-]/g, "_")}`,
          title: `${group} (client)`, series: labels.map((label) => ({label}))}));
      }
      draw(clientCharts.get(group), names, labels);
    }
  }

  async function refreshMetrics() {
    const since = Math.max(-1, lastStep - 1);
    const answer = await Dash.getJSON(`${base}/metrics?since=${since}`);
    merge(answer.series, since);
    lastStep = Math.max(lastStep, answer.last_step);
    for (const {spec, chart} of serviceCharts) draw(chart, spec.series.map(([name]) => name), spec.series.map(([, l]) => l));
    drawClientCharts();
    for (const name of [...points.keys()].filter((n) => !SERVICE_NAMES.has(n) && !clientNames.has(n))) {
      if (!otherCharts.has(name)) {
        otherCharts.set(name, new Charts.LineChart(chartsNode, {id: `chart-${name.replace(/[^\w-]/g, "_")}`,
          title: name, unit: units.get(name), series: [{label: name}]}));
      }
      draw(otherCharts.get(name), [name], [name]);
    }
  }

  // RL groups: per-step charts and the latest steps' groups with links to their trajectories.
  const groupNode = document.getElementById("group-charts");
  const {good, bad, mixed, uniform, central} = Charts.MEANING;  // one meaning per colour, on both charts
  const rewardChart = new Charts.LineChart(groupNode, {id: "chart-group-reward", title: "Reward of sampled groups",
    series: [{label: "best", color: good}, {label: "mean", color: central}, {label: "worst", color: bad}]});
  const outcomeChart = new Charts.LineChart(groupNode, {id: "chart-group-outcomes", title: "Groups by outcome",
    unit: "fraction", series: [{label: "all good", color: good}, {label: "all bad", color: bad},
                               {label: "mixed", color: mixed}, {label: "uniform", color: uniform}]});
  const lengthChart = new Charts.LineChart(groupNode, {id: "chart-output-length", title: "Average output length",
    unit: "tokens", series: [{label: "tokens"}]});
  const groupSteps = new Map();  // step -> the API's step entry
  let lastGroupStep = -1;

  function groupRows() {
    const steps = [...groupSteps.keys()].sort((a, b) => b - a).slice(0, 5);
    return steps.flatMap((step) => groupSteps.get(step).groups.map((group) => {
      // members the service inferred (SDK samples, trained datums) have no trajectory to link to
      const sessions = [...new Set(group.members.map((m) => m.session_id).filter(Boolean))];
      const links = sessions.map((session, i) => el("a", {
        className: "tag", title: session, href: `${Dash.runUrl(runId)}/trajectories/${encodeURIComponent(session)}`},
        `#${i + 1}`));
      const reward = group.reward || {};
      const advantage = group.advantage || {};
      const prompt = group.prompt_text.replace(/\s+/g, " ").trim();
      return el("tr", {},
        el("td", {className: "num"}, step),
        // its end: where a chat template's shared system turn and examples give way to the question
        el("td", {className: "prompt-text", title: group.prompt_text},
          prompt.length > 90 ? `…${prompt.slice(-90)}` : prompt),
        el("td", {}, group.outcome.replace("_", " ")),
        el("td", {className: "num"}, group.size), el("td", {className: "num"}, number(reward.best)),
        el("td", {className: "num"}, number(reward.mean)), el("td", {className: "num"}, number(reward.worst)),
        el("td", {className: "num"}, number(advantage.best)), el("td", {className: "num"}, number(advantage.worst)),
        el("td", {className: "num"}, number(group.mean_output_tokens)), el("td", {}, links.length ? links : "–"));
    }));
  }

  async function refreshGroups() {
    const since = Math.max(-1, lastGroupStep - 1);
    const answer = await Dash.getJSON(`${base}/rl_groups?since=${since}`);
    for (const step of [...groupSteps.keys()]) if (step > since) groupSteps.delete(step);
    for (const entry of answer.steps) {
      groupSteps.set(entry.step, entry);
      lastGroupStep = Math.max(lastGroupStep, entry.step);
    }
    const steps = [...groupSteps.keys()].sort((a, b) => a - b);
    const column = (pick) => steps.map((s) => pick(groupSteps.get(s)) ?? null);
    rewardChart.setData(steps, ["best", "mean", "worst"].map((k) => column((e) => e.reward && e.reward[k])));
    // fractions of the groups whose outcome is known: by rewards, or by advantages alone (uniform / mixed)
    const known = (e) => e.groups.some((g) => g.outcome !== "unrewarded");
    outcomeChart.setData(steps, ["all_good", "all_bad", "mixed", "uniform"]
      .map((k) => column((e) => (known(e) ? e.fractions[k] : null))));
    lengthChart.setData(steps, [column((e) => e.mean_output_tokens)]);
    Dash.fillTable(document.querySelector("#groups tbody"), groupRows(), document.getElementById("no-groups"));
  }

  async function refreshFailed() {
    const {requests} = await Dash.getJSON(`${base}/requests?state=failed&limit=20`);
    const rows = requests.map((r) => el("tr", {dataset: {requestId: r.request_id}},
      el("td", {title: r.request_id}, Dash.time(r.finished_at || r.created_at)), el("td", {}, r.kind),
      el("td", {className: "num"}, r.seq_id ?? "–"), el("td", {}, r.error_category || "–"),
      el("td", {className: "error-text"}, r.error || "")));
    Dash.fillTable(document.querySelector("#failed tbody"), rows, document.getElementById("no-failed"));
  }

  async function refreshSummary() {
    const run = await Dash.getJSON(base);
    const checkpoints = run.checkpoints.length ? `${run.checkpoints.length} checkpoints` : "no checkpoints";
    document.getElementById("run-title").textContent = run.name || run.run_id;
    const c = run.lora_config;
    const targets = ["attn", "mlp", "unembed"].filter((t) => c[`train_${t}`]).join("+");
    const metadata = Object.entries(run.user_metadata).map(([k, v]) => `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`);
    document.getElementById("run-summary").textContent = [
      run.name ? run.run_id : null, run.status, run.base_model, `rank ${c.rank}, alpha ${Dash.number(c.alpha)}, ${targets}`,
      `${run.optimizer}${run.learning_rate === null ? "" : `, lr ${Dash.number(run.learning_rate)}`}`,
      `${run.steps} steps`, `last activity ${Dash.ago(run.last_activity)}`, checkpoints,
      ...run.tags.map((t) => `#${t}`), ...metadata].filter(Boolean).join(" · ");
  }

  Dash.poll(async () => {
    try {
      await refreshSummary();
    } catch (error) {
      if (error.status === 404) Dash.showError(document.getElementById("run-error"), error);
      throw error;
    }
    await Promise.all([refreshMetrics(), refreshGroups(), refreshFailed()]);
  });
})();
