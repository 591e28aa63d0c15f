"use strict";
// Several runs side by side, by name: one chart per series, one line per run, on the optimizer-step axis.
(() => {
  const {el} = Dash;
  const runIds = [...new Set(new URLSearchParams(location.search).getAll("run"))];
  const chartsNode = document.getElementById("charts");
  Charts.smoothingControl(document.getElementById("smoothing"));
  const charts = new Map();  // series name -> LineChart

  if (runIds.length === 0) {
    Dash.showError(document.getElementById("compare-error"), new Error("run: pick runs to compare on the run list"));
    return;
  }
  let labels = runIds;  // each run's name once read (its id until then, or where it has none)

  async function refresh() {
    const runs = await Promise.all(runIds.map((id) => Dash.getJSON(`/runs/${encodeURIComponent(id)}`)));
    labels = runs.map((run) => run.name || run.run_id);
    document.getElementById("compared").replaceChildren(...runs.map((run, i) => el("li", {},
      el("span", {style: `color: ${Charts.PALETTE[i % Charts.PALETTE.length]}`}, "■ "),
      el("a", {href: Dash.runUrl(run.run_id), title: run.run_id}, labels[i]))));
    const answers = await Promise.all(runIds.map((id) => Dash.getJSON(`/runs/${encodeURIComponent(id)}/metrics`)))
      .catch((error) => { Dash.showError(document.getElementById("compare-error"), error); throw error; });
    // loss first, then what the client logged (rewards, evals), then the service's other measures
    const rank = (name) => (name === "loss" ? 0 : answers.some((a) => a.series[name]?.source === "client") ? 1 : 2);
    const names = [...new Set(answers.flatMap((a) => Object.keys(a.series)))]
      .sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
    for (const name of names) {
      if (!charts.has(name)) {
        const unit = answers.map((a) => a.series[name]).find(Boolean).unit;
        charts.set(name, new Charts.LineChart(chartsNode, {id: `chart-${name.replace(/[^\w-]/g, "_")}`, title: name,
                                                           unit, series: labels.map((label) => ({label}))}));
      }
      const {xs, ys} = Charts.align(answers.map((a) => (a.series[name] ? a.series[name].points : [])));
      charts.get(name).setData(xs, ys, labels.map((label) => ({label})));
    }
  }

  Dash.poll(refresh);
})();
