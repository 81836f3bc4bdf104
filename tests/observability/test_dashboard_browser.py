"""The operator dashboard in headless Chromium against a live router on 127.0.0.1 (FakeBackend).

Needs Debian's chromium + chromium-driver and the selenium package (`make test` installs them);
skipped with a message saying so when they are missing. Never downloads a browser.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from router.app import build_app
from testkit.backend import FakeBackend
from testkit.harness import wait_until
from tests.router.conftest import running_server

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@pytest.fixture
def browser(tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (make install adds it)")
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip("chromium and chromedriver are not installed: apt-get install -y chromium chromium-driver")
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_AVOID_STATS", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        "--window-size=1440,1400",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def severe_console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def test_dashboard_shows_pools_then_traffic(browser, tmp_path, tokenizer):
    from selenium.webdriver.common.by import By  # selenium is optional: the fixture skips without it

    backend = FakeBackend(tokenizer, num_prefill=2, num_decode=2, first_token_delay=0.01, token_delay=0.002)
    with running_server(build_app(backend, tokenizer, "SmolLM2-135M-Instruct", 8192)) as url:
        assert url.startswith("http://127.0.0.1:")
        browser.get(url + "/dashboard")
        # Before any traffic: both pools listed, empty states, no console errors.
        wait_until(lambda: browser.execute_script("return document.body.dataset.polls"), 10, "the first status poll")
        rows = {
            r.get_attribute("data-worker"): r.get_attribute("class")
            for r in browser.find_elements(By.CSS_SELECTOR, "#workers tr[data-worker]")
        }
        assert rows == {
            "prefill-0": "pool-prefill",
            "prefill-1": "pool-prefill",
            "decode-0": "pool-decode",
            "decode-1": "pool-decode",
        }
        assert "no requests yet" in browser.find_element(By.ID, "recent").text
        assert "one router" in browser.find_element(By.ID, "routers").text  # FakeBackend keeps no leases
        assert browser.find_elements(By.CSS_SELECTOR, "#ttft-chart circle.pt") == []
        assert severe_console_errors(browser) == []

        ids = []
        for i in range(4):
            r = httpx.post(
                url + "/v1/chat/completions",
                timeout=30,
                json={"messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 8},
            )
            assert r.status_code == 200
            ids.append(r.json()["id"])
        points = wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#ttft-chart circle.pt"), 10, "TTFT points")
        assert len(points) == 4
        recent = browser.find_elements(By.CSS_SELECTOR, "#recent tr")
        assert len(recent) == 4
        titles = {r.find_element(By.CSS_SELECTOR, "td").get_attribute("title") for r in recent}
        assert titles == set(ids)
        assert "remote" in browser.find_element(By.ID, "routing").text
        assert severe_console_errors(browser) == []
        shot = tmp_path / "dashboard.png"
        assert browser.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        # The README's screenshot is refreshed on request only: a test run leaves the tree as it was.
        if os.environ.get("BATON_UPDATE_SCREENSHOT") == "1":
            shutil.copyfile(shot, ROOT / "bench" / "results" / "dashboard.png")


class LeasedFakeBackend(FakeBackend):
    """Reports two router processes' leases, in RayBackend.routers' shape (what /v1/status carries)."""

    def routers(self) -> dict:
        return {
            "this": "router-0",
            "leases": [
                {
                    "router_id": "router-0",
                    "workers": ["prefill-0", "decode-0"],
                    "requests": 3,
                    "idle_s": 0.4,
                    "lease_s": 5.0,
                },
                {"router_id": "router-1.0", "workers": ["decode-0"], "requests": 1, "idle_s": 4.2, "lease_s": 5.0},
            ],
        }


def test_dashboard_lists_every_router_with_its_lease(browser, tokenizer):
    from selenium.webdriver.common.by import By

    with running_server(build_app(LeasedFakeBackend(tokenizer), tokenizer, "SmolLM2-135M-Instruct", 8192)) as url:
        assert httpx.get(url + "/v1/status", timeout=10).json()["routers"]["this"] == "router-0"
        browser.get(url + "/dashboard")
        wait_until(lambda: browser.execute_script("return document.body.dataset.polls"), 10, "the first status poll")
        rows = {
            r.get_attribute("data-router"): [td.text for td in r.find_elements(By.TAG_NAME, "td")]
            for r in browser.find_elements(By.CSS_SELECTOR, "#routers tr[data-router]")
        }
        # id, workers leased, requests, lease age, expiry = lease_s - idle_s (5.0 - 0.4, 5.0 - 4.2)
        assert rows == {
            "router-0": ["router-0 (this page)", "2", "3", "0.4 s", "4.6 s"],
            "router-1.0": ["router-1.0", "1", "1", "4.2 s", "0.8 s"],
        }
        classes = {
            r.get_attribute("data-router"): r.get_attribute("class")
            for r in browser.find_elements(By.CSS_SELECTOR, "#routers tr[data-router]")
        }
        assert classes == {"router-0": "this-router", "router-1.0": ""}
        late = browser.find_element(By.CSS_SELECTOR, '#routers tr[data-router="router-1.0"] td:last-child')
        assert late.get_attribute("class") == "down"  # under a quarter of its term left
        assert severe_console_errors(browser) == []
