"use strict";
// What every page shares: JSON reads, element building (text only: nothing from the API ever
// becomes markup), number and time formats, and polling for live updates without reload.

const Dash = (() => {
  const API = "/dashboard/api";
  const POLL_MS = 3000;

  class ApiError extends Error {
    constructor(status, detail) { super(detail); this.status = status; }
  }

  async function getJSON(path) {
    const response = await fetch(API + path, {credentials: "same-origin", headers: {Accept: "application/json"}});
    if (response.status === 401) {  // the session ended (logout elsewhere, key revoked): back to the login form
      location.assign("/dashboard/login");
      throw new ApiError(401, "not logged in");
    }
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new ApiError(response.status, body.detail || `${response.status} ${response.statusText}`);
    }
    return response.json();
  }

  // el("td", {className: "num"}, "text", otherNode): strings become text nodes, never HTML.
  function el(tag, props = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props)) {
      if (key === "dataset") Object.assign(node.dataset, value);
      else if (key.startsWith("aria-") || key === "role" || key === "scope") node.setAttribute(key, value);
      else node[key] = value;
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function fillTable(tbody, rows, emptyNote) {
    tbody.replaceChildren(...rows);
    if (emptyNote) emptyNote.hidden = rows.length > 0;
  }

  function number(x, digits = 3) {
    if (x === null || x === undefined || Number.isNaN(x)) return "–";
    if (Number.isInteger(x)) return x.toLocaleString("en-US");
    const magnitude = Math.abs(x);
    if (magnitude !== 0 && (magnitude < 1e-3 || magnitude >= 1e6)) return x.toExponential(2);
    return x.toLocaleString("en-US", {maximumSignificantDigits: digits + 1});
  }

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return `${i === 0 ? n : n.toFixed(1)} ${units[i]}`;
  }

  function ago(iso) {
    if (!iso) return "–";
    const seconds = (Date.now() - Date.parse(iso)) / 1000;
    if (seconds < 60) return `${Math.max(0, Math.round(seconds))} s ago`;
    if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
    if (seconds < 86400) return `${Math.round(seconds / 3600)} h ago`;
    return `${Math.round(seconds / 86400)} d ago`;
  }

  function until(iso) {
    if (!iso) return "kept until deleted";
    const seconds = (Date.parse(iso) - Date.now()) / 1000;
    if (seconds <= 0) return "expired";
    if (seconds < 3600) return `expires in ${Math.round(seconds / 60)} min`;
    if (seconds < 86400) return `expires in ${Math.round(seconds / 3600)} h`;
    return `expires in ${Math.round(seconds / 86400)} d`;
  }

  function time(iso) {
    return iso ? new Date(iso).toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC") : "–";
  }

  function showError(node, error) {
    node.textContent = error.message;
    node.hidden = false;
  }

  // Run `refresh` now and every few seconds; the page's "live" note says when it last succeeded.
  // A failed refresh is shown there and tried again; one returning false stops polling (nothing more to show).
  function poll(refresh) {
    const live = document.getElementById("live");
    async function tick() {
      let again = true;
      try {
        again = (await refresh()) !== false;
        if (live) live.textContent = `live · updated ${new Date().toLocaleTimeString("en-GB")}`;
      } catch (error) {
        if (live) live.textContent = `update failed: ${error.message}`;
        again = !(error instanceof ApiError && error.status === 404);
      }
      if (again) setTimeout(tick, POLL_MS);
    }
    return tick();
  }

  const runUrl = (runId) => `/dashboard/runs/${encodeURIComponent(runId)}`;

  return {ApiError, getJSON, el, fillTable, number, bytes, ago, until, time, showError, poll, runUrl,
          scriptData: () => document.currentScript.dataset};
})();
