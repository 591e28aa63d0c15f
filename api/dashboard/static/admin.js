"use strict";
// The operator's view: every tenant's load and quota use, the trainers' memory, the scheduler's cycles,
// the sampler's queue.
(() => {
  const {el, number} = Dash;
  const chartsNode = document.getElementById("charts");
  const sizes = new Charts.LineChart(chartsNode, {id: "chart-cycle-requests", title: "Requests and tenants per cycle",
    xLabel: "cycle start", time: true, series: [{label: "requests"}, {label: "tenants"}]});
  const tokens = new Charts.LineChart(chartsNode, {id: "chart-cycle-tokens", title: "Tokens per cycle",
    unit: "tokens", xLabel: "cycle start", time: true, series: [{label: "tokens"}]});

  function quotaUse(use) {
    const parts = Object.entries(use).filter(([, v]) => v !== null)
      .map(([name, v]) => el("span", {className: `tag${v >= 0.9 ? " error-text" : ""}`},
                             `${name.replaceAll("_", " ")}: ${Math.round(v * 100)}%`));
    return parts.length ? parts : el("span", {className: "muted"}, "no limits");
  }

  async function refresh() {
    const {tenants, cycles, sampler, trainers} = await Dash.getJSON("/admin/overview");
    Dash.fillTable(document.querySelector("#trainers tbody"), trainers.map((t) => el("tr", {},
      el("td", {title: t.scheduler}, t.trainer), el("td", {className: "num"}, t.budget_bytes ? Dash.bytes(t.budget_bytes) : "none"),
      el("td", {className: "num"}, number(t.resident_runs)), el("td", {className: "num"}, Dash.bytes(t.resident_bytes)),
      el("td", {className: "num"}, number(t.paged_runs)), el("td", {className: "num"}, Dash.bytes(t.paged_bytes)),
      el("td", {className: "num"}, number(t.page_ins_last_minute)),
      el("td", {className: "num"}, t.mean_page_in_seconds === null ? "–" : `${number(t.mean_page_in_seconds * 1000)} ms`),
      el("td", {className: "num"}, `${number(t.page_ins)} / ${number(t.page_outs)}`),
      el("td", {className: "num"}, `${number(t.prefetch_hits)} / ${number(t.prefetch_misses)}`))),
      document.getElementById("no-trainers"));
    Dash.fillTable(document.querySelector("#tenants tbody"), tenants.map((t) => el("tr", {dataset: {tenantId: t.tenant_id}},
      el("td", {}, t.name, t.disabled ? el("span", {className: "status deleted"}, " disabled") : null),
      el("td", {className: "num"}, number(t.live_models)),
      el("td", {className: "num"}, number(t.requests.pending)), el("td", {className: "num"}, number(t.requests.running)),
      el("td", {className: "num"}, number(t.tokens_trained_today)),
      el("td", {className: "num"}, number(t.tokens_sampled_today)),
      el("td", {className: "num"}, Dash.bytes(t.storage_bytes)), el("td", {}, quotaUse(t.quota_use)))));
    // Cycles come newest first; several can start in the same second (uPlot needs ascending x).
    const ordered = [...cycles].reverse().map((c, i) => ({...c, x: Date.parse(c.started_at) / 1000 + i * 1e-3}));
    sizes.setData(ordered.map((c) => c.x), [ordered.map((c) => c.requests), ordered.map((c) => c.tenants)]);
    tokens.setData(ordered.map((c) => c.x), [ordered.map((c) => c.tokens)]);
    const oldest = sampler.oldest_pending_seconds;
    document.getElementById("sampler-queue").textContent = `Sampler queue: ${sampler.pending} pending`
      + (oldest === null ? "" : `, oldest waiting ${number(oldest)} s`);
  }

  Dash.poll(refresh);
})();
