"use strict";
// Line charts on uPlot (static/vendor/, see docs/dashboard.md). Charts of one page share their x
// axis cursor: hovering step 12 on the loss shows step 12 on every other chart.

const Charts = (() => {
  const PALETTE = ["#2458c6", "#d9480f", "#2b8a3e", "#862e9c", "#c2255c", "#1098ad", "#e67700", "#495057"];
  const HEIGHT = 190;
  const STEP_INCREMENTS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000];

  // uPlot's own range, widened where the values barely move: its tick maths fails ("Invalid array
  // length") on a span far below the values' size, such as a loss of -1 +- 1e-7.
  function valueRange(_, min, max) {
    const magnitude = Math.max(Math.abs(min), Math.abs(max));
    const least = magnitude > 0 ? magnitude * 1e-3 : 1;
    if (max - min < least) [min, max] = [(min + max) / 2 - least, (min + max) / 2 + least];
    return uPlot.rangeNum(min, max, 0.1, true);
  }

  class LineChart {
    // series: [{label, color?}]; time: x values are Unix seconds (else optimizer steps)
    constructor(parent, {id, title, unit = "", series, xLabel = "optimizer step", time = false}) {
      this.options = {series, unit, xLabel, time};
      this.plot = null;
      this.empty = Dash.el("p", {className: "empty"}, "No points yet.");
      this.body = Dash.el("div", {className: "chart-body"});
      this.panel = Dash.el("section", {className: "chart", id, "aria-label": title, dataset: {points: "0"}},
                           Dash.el("h3", {}, title), this.empty, this.body);
      parent.append(this.panel);
      window.addEventListener("resize", () => this.plot && this.plot.setSize(this.size()));
    }

    size() { return {width: Math.max(280, this.panel.clientWidth - 18), height: HEIGHT}; }

    // xs ascending; ys[i][j] is series i at xs[j], null where it has no value
    setData(xs, ys, series = this.options.series) {
      const withValue = xs.filter((_, j) => ys.some((column) => column[j] !== null && column[j] !== undefined));
      this.panel.dataset.points = String(withValue.length);
      this.empty.hidden = withValue.length > 0;
      if (withValue.length === 0) {
        if (this.plot) { this.plot.destroy(); this.plot = null; }
        return;
      }
      const labels = series.map((s) => s.label).join("\n");
      if (this.plot && this.labels === labels) {
        this.plot.setData([xs, ...ys]);
        return;
      }
      if (this.plot) this.plot.destroy();  // the series changed (a new client metric, a run added)
      this.labels = labels;
      this.options.series = series;
      this.plot = new uPlot(this.uplotOptions(series, xs.length), [xs, ...ys], this.body);
    }

    uplotOptions(series, n) {
      const {unit, xLabel, time} = this.options;
      return {
        ...this.size(),
        cursor: {sync: {key: time ? "time" : "steps"}},
        scales: {x: {time}, y: {range: unit === "fraction" ? [0, 1] : valueRange}},
        // steps are whole numbers: no tick at step 1.5
        axes: [time ? {label: xLabel} : {label: xLabel, incrs: STEP_INCREMENTS}, {label: unit, size: 64, values: (_, ticks) => ticks.map((v) => Dash.number(v))}],
        series: [
          {label: time ? "time" : "step"},
          ...series.map((s, i) => ({
            label: s.label, stroke: s.color || PALETTE[i % PALETTE.length], width: 2, spanGaps: true,
            points: {show: n <= 60}, value: (_, v) => Dash.number(v),
          })),
        ],
      };
    }
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

  return {LineChart, align, PALETTE};
})();
