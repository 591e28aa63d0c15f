"use strict";
// The login form works without scripts (a plain POST, answered with a redirect); with them, a wrong
// key is said on the form instead of on a JSON page.
(() => {
  const form = document.getElementById("login-form");
  const notice = document.getElementById("login-error");
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    notice.hidden = true;
    const response = await fetch(form.action, {
      method: "POST", credentials: "same-origin", headers: {Accept: "application/json"},
      body: new URLSearchParams(new FormData(form)),
    }).catch((error) => ({ok: false, json: async () => ({detail: `could not reach the server: ${error.message}`})}));
    if (response.ok) {
      // the server's normalised target: a prefix check here would let "/dashboard/../evil" through
      const body = await response.json().catch(() => ({}));
      location.assign(body.next || "/dashboard");
      return;
    }
    const body = await response.json().catch(() => ({}));
    notice.textContent = body.detail || `login failed (${response.status})`;
    notice.hidden = false;
    form.elements.api_key.focus();
  });
})();
