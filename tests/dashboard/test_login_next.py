"""The dashboard login's `next`: where a login goes afterwards is a path under /dashboard as the
browser will resolve it, whatever the form says (an open redirect otherwise: a link to the login
page with a crafted `next` would send a logged-in user to any page or site)."""

from __future__ import annotations

import httpx
import pytest

from api.dashboard.auth import safe_next
from tests.servers import running_server

STAYS = {
    "/dashboard": "/dashboard",
    "/dashboard/runs/s1:train:0?step=3": "/dashboard/runs/s1:train:0?step=3",
    "/dashboard/runs/../compare?run=a&run=b": "/dashboard/compare?run=a&run=b",
    "/dashboard//runs": "/dashboard/runs",
}
LEAVES = ["/dashboard/../../evil", "/dashboard/..", "/dashboard/%2e%2e/evil", "/dashboard/%2E%2E/%2e%2e/evil",
          "/dashboard/runs/../../../evil", "/dashboard/..%2fevil", "https://evil.example/dashboard",
          "//evil.example/dashboard", "/dashboardx", "/evil", "dashboard", "/dashboard\\..\\evil",
          "/dashboard/\r\nSet-Cookie: x=1", "", None]


@pytest.mark.parametrize("target, expected", STAYS.items())
def test_a_dashboard_path_is_kept_resolved(target, expected):
    assert safe_next(target) == expected


@pytest.mark.parametrize("target", LEAVES)
def test_anything_leaving_the_dashboard_goes_to_its_first_page(target):
    assert safe_next(target) == "/dashboard"


def test_login_redirects_only_inside_the_dashboard(tmp_path):
    with running_server(tmp_path, sampler_enabled=False) as server:
        key = server.new_tenant("next-check")
        with httpx.Client(base_url=server.base_url) as http:
            for target in ("/dashboard/../../evil", "/dashboard/%2e%2e/evil", "/dashboard/runs/../compare"):
                form = http.post("/dashboard/login", data={"api_key": key, "next": target})
                assert form.status_code == 303, form.text
                assert form.headers["location"] == safe_next(target)
                scripted = http.post("/dashboard/login", data={"api_key": key, "next": target},
                                     headers={"Accept": "application/json"})
                assert scripted.json()["next"] == safe_next(target)
            assert form.headers["location"] == "/dashboard/compare"


@pytest.mark.slow  # a Chromium of its own: ~2 s
def test_the_login_page_script_goes_where_the_server_says(tmp_path):
    """With scripts on, the form posts for JSON and static/login.js goes to the server's `next`."""
    from playwright.sync_api import sync_playwright

    from tests.dashboard.test_pages_browser import CHROMIUM

    with running_server(tmp_path, sampler_enabled=False) as server, sync_playwright() as playwright:
        key = server.new_tenant("next-script")
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        try:
            page = browser.new_page()
            page.goto(f"{server.base_url}/dashboard/login")
            page.evaluate("document.querySelector('#login-form [name=next]').value = '/dashboard/../../evil'")
            page.fill("#api_key", key)
            page.click("#login-form button[type=submit]")
            page.wait_for_url(f"{server.base_url}/dashboard", timeout=15_000)
        finally:
            browser.close()
