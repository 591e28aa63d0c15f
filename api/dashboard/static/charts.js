"use strict";
// Line charts on uPlot (static/vendor/, see docs/dashboard.md). Charts of one page share their x
// axis cursor: hovering step 12 on the loss shows step 12 on every other chart. Each chart has a
// log-scale switch (on by itself where its values span three decades or more), CSV and JSON
// downloads of its points as they came from the API, and follows the page's smoothing (EMA).

const Charts = (() => {
  // Okabe-Ito: told apart with every common colour-vision deficiency. Series take them in order;
  // MEANING gives good / bad / mixed / uniform / central one colour each, used for nothing else on a chart.
  const PALETTE = ["#0072B2", "#E69F00", "#56B4E9", "#CC79A7", "#F0E442", "#000000", "#009E73", "#D55E00"];
  const MEANING = {good: "#009E73", bad: "#D55E00", mixed: "#E69F00", uniform: "#CC79A7", central: "#0072B2"};
  const HEIGHT = 190;
  const STEP_INCREMENTS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000];
  const DECADES_FOR_LOG = 3;
  const charts = [];
  let smoothing = 0;  // EMA weight of the previous smoothed value: 0 draws the points as they are

  // uPlot's own range, widened where the values barely move: its tick maths fails ("Invalid array
  // length") on a span far below the values' size, such as a loss of -1 +- 1e-7.
  function valueRange(_, min, max) {
    const magnitude = Math.max(Math.abs(min), Math.abs(max));
    const least = magnitude > 0 ? magnitude * 1e-3 : 1;
    if (max - min < least) [min, max] = [(min + max) / 2 - least, (min + max) / 2 + least];
    return uPlot.rangeNum(min, max, 0.1, true);
  }

  // Tick labels with as many digits as it takes for neighbours to differ (a learning rate axis of
  // 1.99e-4, 2.00e-4, 2.01e-4, not 2.00e-4 three times).
  // (uPlot passes null for a tick it leaves unlabelled, as on a log axis.)
  function tickLabels(_, ticks) {
    for (let digits = 0; digits <= 8; digits += 1) {
      const labels = ticks.map((v) => format(v, digits));
      const shown = labels.filter(Boolean);
      if (new Set(shown).size === shown.length) return labels;
    }
    return ticks.map((v) => (v === null || v === undefined ? "" : String(v)));
  }

  function format(v, digits) {
    if (v === null || v === undefined) return "";
    if (v === 0) return "0";
    const magnitude = Math.abs(v);
    if (magnitude < 1e-3 || magnitude >= 1e6) return v.toExponential(digits);
    return v.toLocaleString("en-US", {minimumFractionDigits: 0, maximumFractionDigits: digits + 1});
  }

  // The span of the positive values, in decades (null when a value is not positive: no log scale).
  function decades(ys) {
    const values = ys.flat().filter((v) => v !== null && v !== undefined);
    if (!values.length || values.some((v) => v <= 0)) return null;
    return Math.log10(Math.max(...values) / Math.min(...values));
  }

  function ema(column) {
    if (!smoothing) return column;
    let last = null;
    return column.map((v) => {
      if (v === null || v === undefined) return null;
      last = last === null ? v : smoothing * last + (1 - smoothing) * v;
      return last;
    });
  }

  function download(name, text, type) {
    const link = Dash.el("a", {href: URL.createObjectURL(new Blob([text], {type})), download: name});
    document.body.append(link);
    link.click();
    link.remove();
  }

  class LineChart {
    // series: [{label, color?}]; time: x values are Unix seconds (else optimizer steps)
    constructor(parent, {id, title, unit = "", series, xLabel = "optimizer step", time = false}) {
      this.options = {id, title, series, unit, xLabel, time};
      this.plot = null;
      this.data = {xs: [], ys: []};  // as the page gave them: downloads and smoothing start from these
      this.log = null;  // null: automatic; true / false: the switch's
      this.empty = Dash.el("p", {className: "empty"}, "No points yet.");
      this.body = Dash.el("div", {className: "chart-body"});
      this.logSwitch = Dash.el("input", {type: "checkbox", className: "log-scale", "aria-label": `${title}: log scale`});
      this.logSwitch.addEventListener("change", () => { this.log = this.logSwitch.checked; this.redraw(true); });
      const tools = Dash.el("span", {className: "chart-tools"},
        Dash.el("label", {}, this.logSwitch, " log"),
        this.button("CSV", () => download(`${id}.csv`, this.csv(), "text/csv")),
        this.button("JSON", () => download(`${id}.json`, this.json(), "application/json")));
      this.panel = Dash.el("section", {className: "chart", id, "aria-label": title, dataset: {points: "0"}},
                           Dash.el("h3", {}, title, tools), this.empty, this.body);
      parent.append(this.panel);
      charts.push(this);
      window.addEventListener("resize", () => this.plot && this.plot.setSize(this.size()));
    }

    button(text, action) {
      const node = Dash.el("button", {type: "button", className: "chart-download"}, text);
      node.addEventListener("click", action);
      return node;
    }

    size() { return {width: Math.max(280, this.panel.clientWidth - 18), height: HEIGHT}; }

    // xs ascending; ys[i][j] is series i at xs[j], null where it has no value
    setData(xs, ys, series = this.options.series) {
      this.data = {xs, ys};
      const withValue = xs.filter((_, j) => ys.some((column) => column[j] !== null && column[j] !== undefined));
      this.panel.dataset.points = String(withValue.length);
      this.empty.hidden = withValue.length > 0;
      if (withValue.length === 0) {
        if (this.plot) { this.plot.destroy(); this.plot = null; }
        return;
      }
      const labels = series.map((s) => s.label).join("\n");
      const changed = !this.plot || this.labels !== labels;
      this.labels = labels;
      this.options.series = series;
      this.redraw(changed);
    }

    redraw(rebuild) {
      const {xs, ys} = this.data;
      if (!xs.length) return;
      const span = decades(ys);
      const log = span !== null && (this.log === null ? span >= DECADES_FOR_LOG : this.log);
      this.logSwitch.checked = log;
      this.logSwitch.disabled = span === null;  // a value at or below zero: no log axis
      this.panel.dataset.scale = log ? "log" : "linear";
      this.panel.dataset.smoothing = String(smoothing);
      const drawn = [xs, ...ys.map(ema)];
      if (this.plot && !rebuild && this.drawnLog === log) {
        this.plot.setData(drawn);
        return;
      }
      if (this.plot) this.plot.destroy();  // the series or the scale changed
      this.drawnLog = log;
      this.plot = new uPlot(this.uplotOptions(this.options.series, xs.length, log), drawn, this.body);
    }

    uplotOptions(series, n, log) {
      const {unit, xLabel, time} = this.options;
      const y = log ? {distr: 3} : {range: unit === "fraction" ? [0, 1] : valueRange};
      return {
        ...this.size(),
        cursor: {sync: {key: time ? "time" : "steps"}},
        scales: {x: {time}, y},
        // steps are whole numbers: no tick at step 1.5
        axes: [time ? {label: xLabel} : {label: xLabel, incrs: STEP_INCREMENTS},
               {label: log ? `${unit} (log)` : unit, size: 70, values: tickLabels}],
        series: [
          {label: time ? "time" : "step"},
          ...series.map((s, i) => ({
            label: s.label, stroke: s.color || PALETTE[i % PALETTE.length], width: 2, spanGaps: true,
            points: {show: n <= 60}, value: (_, v) => Dash.number(v),
          })),
        ],
      };
    }

    rows() {
      const {xs, ys} = this.data;
      return xs.map((x, j) => [x, ...ys.map((column) => column[j] ?? null)]);
    }

    csv() {
      const quote = (s) => `"${String(s).replaceAll('"', '""')}"`;
      const header = [this.options.time ? "time" : "step", ...this.options.series.map((s) => s.label)].map(quote);
      return [header.join(","), ...this.rows().map((row) => row.map((v) => (v === null ? "" : v)).join(","))].join("\n") + "\n";
    }

    json() {
      const {title, unit, time} = this.options;
      return JSON.stringify({title, unit, x: time ? "time" : "step", series: this.options.series.map((s) => s.label),
                             rows: this.rows()});
    }
  }

  // The page's smoothing control (an <input type=range> of 0..0.99): every chart redraws with it.
  function smoothingControl(input) {
    input.addEventListener("input", () => {
      smoothing = Number(input.value);
      for (const chart of charts) chart.redraw(false);
    });
  }

  // Points [[x, y], ...] of several series -> one ascending x column and a y column per series.
  function align(pointLists) {
    const xs = [...new Set(pointLists.flatMap((points) => points.map(([x]) => x)))].sort((a, b) => a - b);
    const index = new Map(xs.map((x, j) => [x, j]));
    const ys = pointLists.map((points) => {
      const column = new Array(xs.length).fill(null);
      for (const [x, y] of points) column[index.get(x)] = y;
      return column;
    });
    return {xs, ys};
  }

  return {LineChart, align, smoothingControl, PALETTE, MEANING};
})();
