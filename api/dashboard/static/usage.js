"use strict";
// Tokens trained and sampled per UTC day, one line per base model.
(() => {
  const {el, number} = Dash;
  const chartsNode = document.getElementById("charts");
  const trained = new Charts.LineChart(chartsNode, {id: "chart-tokens-trained", title: "Tokens trained per day",
    unit: "tokens", xLabel: "day (UTC)", time: true, series: []});
  const sampled = new Charts.LineChart(chartsNode, {id: "chart-tokens-sampled", title: "Tokens sampled per day",
    unit: "tokens", xLabel: "day (UTC)", time: true, series: []});

  const DAYS = 14;
  const DAY_SECONDS = 86400;

  // Every one of the last DAYS days is on the axis, with 0 where a model has no tokens that day.
  function perModel(days, field) {
    const today = Math.floor(Date.now() / 1000 / DAY_SECONDS) * DAY_SECONDS;
    const xs = Array.from({length: DAYS}, (_, i) => today - (DAYS - 1 - i) * DAY_SECONDS);
    const models = [...new Set(days.map((d) => d.base_model))].sort();
    const ys = models.map((model) => {
      const byDay = new Map(days.filter((d) => d.base_model === model)
        .map((d) => [Date.parse(`${d.date}T00:00:00Z`) / 1000, d[field]]));
      return xs.map((x) => byDay.get(x) ?? 0);
    });
    return {xs, ys: models.length ? ys : [], series: models.map((label) => ({label}))};
  }

  async function refresh() {
    const {days} = await Dash.getJSON(`/usage?days=${DAYS}`);
    for (const [chart, field] of [[trained, "tokens_trained"], [sampled, "tokens_sampled"]]) {
      const {xs, ys, series} = perModel(days, field);
      chart.setData(xs, ys, series);
    }
    const rows = [...days].reverse().map((d) => el("tr", {}, el("td", {}, d.date), el("td", {}, d.base_model),
      el("td", {className: "num"}, number(d.tokens_trained)), el("td", {className: "num"}, number(d.tokens_sampled))));
    Dash.fillTable(document.querySelector("#usage tbody"), rows, document.getElementById("no-usage"));
  }

  Dash.poll(refresh);
})();
