"""The web console in a real browser on a real system: `llmgw up` with a simulated catalog, /ui in
headless Chromium (Debian's chromium, driven by Selenium through chromium-driver). The model, its
replicas' states and the node appear; a replica killed with kill -9 shows as Failed and then Ready again
while the page keeps polling (never reloaded); the catalog and the events show; with keys in use the
page refuses an ordinary key and takes an admin one. No page ever shows a null, undefined or NaN.

Without the browser the test is skipped with the line that installs it, and fails under CI
(harness/needs.py)."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import time

import pytest

from llmgw.state.keypolicy import new_key
from llmgw.state import keys
from llmgw.state.store import Store, connect
from harness import needs
from harness.cluster import sim_catalog
from harness.procs import ProcessSet, free_port, python, wait_until

pytestmark = pytest.mark.slow

CATALOG = sim_catalog(replicas=2)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000"]


@pytest.fixture
def browser(tmp_path):
    chromium, driver_path = needs.browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}"]:
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path, log_output=str(tmp_path / "chromedriver.log")),
                              options=opts)
    try:
        yield driver
    finally:
        driver.quit()


# Read in one script call: the page re-renders every 2 s, so an element found by one WebDriver call may
# be replaced before the next (a stale element).
def attr(driver, css: str, name: str) -> str | None:
    return driver.execute_script("const e = document.querySelector(arguments[0]); "
                                 "return e ? e.getAttribute(arguments[1]) : null", css, name)


def text(driver, css: str) -> str:
    return driver.execute_script("return [...document.querySelectorAll(arguments[0])]"
                                 ".map((e) => e.innerText).join(' ')", css)


# A JavaScript value printed where a word or a number belongs: a field shown without a check for null.
STRAY = re.compile(r"\b(null|undefined|NaN)\b")


def no_stray_values(driver, page: str) -> None:
    """Fail on a line of the page's visible text showing null, undefined or NaN. The catalog's YAML
    document is left out: there `null` is YAML's own word for a field not set."""
    shown = driver.execute_script("const doc = document.getElementById('catalog-yaml');"
                                  "return document.body.innerText.replace(doc ? doc.innerText : '', '')")
    stray = [line for line in shown.splitlines() if STRAY.search(line)]
    assert not stray, f"the {page} page shows {stray}"


def click(driver, css: str) -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.CSS_SELECTOR, css).click()


def test_the_console_follows_a_running_system(tmp_path, browser):
    port = free_port()
    (tmp_path / "catalog.yaml").write_text(CATALOG)
    procs = ProcessSet(tmp_path / "logs")
    # A restart waits 8 s after a crash, so the Failed state lasts several of the page's 2 s polls.
    env = {"LLMGW_AGENT_BACKOFF_BASE": "8", "LLMGW_AGENT_TICK": "0.2"}
    up = procs.start("up", [python(), "-m", "llmgw", "up", "--catalog", str(tmp_path / "catalog.yaml"), "--port",
                            str(port), "--state-dir", str(tmp_path / "state"), "--node", "solo"], env=env)
    try:
        wait_until(lambda: "ready: the gateway answers" in up.log() or not up.alive(), 120, what="llmgw up ready")
        assert up.alive(), up.log()
        redis_port = re.search(r"started Redis on 127\.0\.0\.1:(\d+)", up.log()).group(1)
        store = Store(connect(f"redis://127.0.0.1:{redis_port}/0"))
        wait_until(lambda: len([r for r in store.all_replicas() if r.first_ready_at]) == 2, 60, what="two Ready")
        replicas = sorted(r.id for r in store.all_replicas())
        url = f"http://127.0.0.1:{port}/ui"

        # Models: the model and both replicas, Ready.
        browser.get(url + "#models")
        wait_until(lambda: all(attr(browser, f'tr[data-replica="{rid}"]', "data-state") == "Ready" for rid in replicas),
                   20, what="both replicas Ready on the models page")
        assert "chat" in text(browser, '[data-model="chat"] h2') and "2/2 Ready" in text(browser, '[data-model="chat"]')
        no_stray_values(browser, "models")
        # A figure the page does not have says n/a (with a title saying why), never "?" or a bare "-".
        bars = text(browser, '[data-model="chat"] .bars')
        assert "?" not in bars and not re.search(r"(^|\s)-(\s|$)", bars), bars
        browser.execute_script("window.llmgwNotReloaded = true")  # gone if the page ever reloads

        # Fleet: the node, live, with both replicas on it.
        click(browser, 'nav a[data-tab="fleet"]')
        wait_until(lambda: attr(browser, '[data-node="solo"]', "data-live") == "true", 10, what="node solo on the fleet")
        assert all(attr(browser, f'[data-node="solo"] [data-replica="{rid}"]', "data-state") == "Ready" for rid in replicas)
        no_stray_values(browser, "fleet")
        assert " in 0," not in text(browser, '[data-node="solo"]')  # an empty weights cache says "empty"

        # kill -9 one engine: Failed, then Ready again, on the page as it polls.
        click(browser, 'nav a[data-tab="models"]')
        victim = store.get_replica(replicas[0])
        os.kill(victim.engine_pid, signal.SIGKILL)
        row = f'tr[data-replica="{victim.id}"]'
        wait_until(lambda: attr(browser, row, "data-state") == "Failed", 15, what="the killed replica shown Failed")
        assert "killed by SIGKILL" in text(browser, row)
        no_stray_values(browser, "models")
        wait_until(lambda: attr(browser, row, "data-state") == "Ready", 40, what="the replica shown Ready again")
        assert browser.execute_script("return window.llmgwNotReloaded === true")

        # Catalog: the applied version, its YAML and its history.
        click(browser, 'nav a[data-tab="catalog"]')
        wait_until(lambda: "name: chat" in text(browser, "#catalog-yaml"), 10, what="the catalog on its page")
        assert "version 1 (applied)" in text(browser, "h2") and text(browser, 'tr[data-version="1"]')
        no_stray_values(browser, "catalog")

        # Events: the crash is in the history.
        click(browser, 'nav a[data-tab="events"]')
        wait_until(lambda: "killed by SIGKILL" in text(browser, 'tr[data-kind="replica_failed"]'), 10,
                   what="the crash on the events page")
        no_stray_values(browser, "events")

        # Keys in use: the page asks for a key, refuses an ordinary one, takes an admin one.
        _, ordinary = store.create_key("app")
        rec, admin = new_key("ops", None, None, None, time.time())
        store.r.hset(keys.API_KEYS, rec.id, dataclasses.replace(rec, admin=True).to_json())
        wait_until(lambda: browser.find_element("id", "auth").is_displayed(), 15, what="the page to ask for a key")
        browser.find_element("id", "key-input").send_keys(ordinary)
        click(browser, "#key-submit")
        wait_until(lambda: "not an admin key" in browser.find_element("id", "auth-error").text, 10,
                   what="the ordinary key refused")
        assert not text(browser, "tr[data-kind]")  # no data shown
        no_stray_values(browser, "key")
        browser.find_element("id", "key-input").send_keys(admin)
        click(browser, "#key-submit")
        wait_until(lambda: text(browser, 'tr[data-kind="replica_failed"]'), 10, what="the events again with the admin key")
        assert not browser.find_element("id", "auth").is_displayed()
        assert browser.execute_script("return window.llmgwNotReloaded === true")
    finally:
        up.signal_group(signal.SIGINT)
        try:
            up.popen.wait(60)
        except subprocess.TimeoutExpired:
            pass
        procs.stop_all()
