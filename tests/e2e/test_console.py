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


# The sim streams a token every 80 ms: a 24-token answer takes about 2 s, long enough to watch it grow.
PLAY_CATALOG = sim_catalog(replicas=2, args=["--step-ms", "80"])


def fill(driver, css: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.CSS_SELECTOR, css)
    box.clear()
    box.send_keys(value)


def assistant_turns(driver) -> list[dict]:
    """Each answer of the playground's conversation: its state, request id, text, stats, and the replica
    its served-by panel names."""
    return driver.execute_script("""return [...document.querySelectorAll('#pg-conversation .turn.assistant')].map((t) => ({
        state: t.getAttribute('data-state'), rid: t.getAttribute('data-request-id'),
        status: t.getAttribute('data-status'), code: t.getAttribute('data-code'),
        text: t.querySelector('.answer').innerText, chunks: Number(t.querySelector('.answer').getAttribute('data-chunks') || 0),
        stats: Object.fromEntries([...t.querySelectorAll('[data-stat]')].map((s) => [s.dataset.stat, s.lastChild.textContent])),
        replica: (t.querySelector('.served[data-replica]') || {getAttribute: () => null}).getAttribute('data-replica'),
        served: (t.querySelector('.served') || {innerText: ''}).innerText,
        curl: (t.querySelector('pre.curl') || {textContent: ''}).textContent,
        python: (t.querySelector('pre.python') || {textContent: ''}).textContent}))""")


def test_a_new_user_tries_the_model_and_makes_a_team_key_in_the_browser(tmp_path, browser):
    """From `llmgw up` to a conversation and to a key, in the console only: a streamed answer appears
    token by token with its figures, the served-by panel names the replica `llmgw explain` names for the
    request; the first key made on the keys page is an admin key, the next ones an admin's, each an
    event naming who made it; a pasted key that may not call the model gets the gateway's own error; a
    key made in the console works from the openai client, and its revocation takes effect within the key
    refresh."""
    import openai
    import requests

    port = free_port()
    (tmp_path / "catalog.yaml").write_text(PLAY_CATALOG)
    procs = ProcessSet(tmp_path / "logs")
    keys_interval = 0.5
    env = {"LLMGW_AGENT_TICK": "0.2", "LLMGW_GATEWAY_KEYS_INTERVAL": str(keys_interval)}
    up = procs.start("up", [python(), "-m", "llmgw", "up", "--catalog", str(tmp_path / "catalog.yaml"), "--port",
                            str(port), "--state-dir", str(tmp_path / "state"), "--node", "solo"], env=env)
    cli_env = {**os.environ, "LLMGW_STATE_DIR": str(tmp_path / "state")}
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: "ready: the gateway answers" in up.log() or not up.alive(), 120, what="llmgw up ready")
        assert up.alive(), up.log()
        wait_until(lambda: requests.get(base + "/healthz", timeout=2).json()["endpoints"] == 2, 60, what="two routed")
        redis_port = re.search(r"started Redis on 127\.0\.0\.1:(\d+)", up.log()).group(1)
        store = Store(connect(f"redis://127.0.0.1:{redis_port}/0"))
        replicas = {r.id for r in store.all_replicas()}

        # The playground, with no key in use: the model is offered, the answer streams in.
        browser.get(base + "/ui#playground")
        wait_until(lambda: attr(browser, "#pg-key-info [data-key-state]", "data-key-state") == "none", 15,
                   what="the playground to say no key is needed")
        wait_until(lambda: browser.execute_script("return document.getElementById('pg-model').value") == "chat", 10,
                   what="the model offered")
        fill(browser, "#pg-max-tokens", "24")
        fill(browser, "#pg-system", "You are terse.")
        fill(browser, "#pg-user", "Tell me about llamas.")
        click(browser, "#pg-send")
        seen: set[int] = set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            turns = assistant_turns(browser)
            if turns and turns[-1]["state"] != "streaming":
                break
            if turns:
                seen.add(len(turns[-1]["text"]))
        [first] = assistant_turns(browser)
        assert first["state"] == "done", first
        assert len(seen - {0}) >= 3, f"the answer did not grow token by token: {sorted(seen)}"
        assert first["chunks"] > 3 and first["text"]
        assert first["stats"]["completion_tokens"] == "24" and first["stats"]["ttft"] != "n/a"
        assert first["stats"]["tps"] != "n/a" and int(first["stats"]["prompt_tokens"]) > 0
        # Which replica served it and why: the gateway's record, as `llmgw explain REQUEST_ID` says it.
        wait_until(lambda: assistant_turns(browser)[0]["replica"], 15, what="the served-by panel")
        first = assistant_turns(browser)[0]
        assert first["replica"] in replicas and f"Served by replica {first['replica']}" in first["served"]
        explained = subprocess.run([python(), "-m", "llmgw", "explain", first["rid"]], capture_output=True, text=True,
                                   timeout=60, env=cli_env)
        assert explained.returncode == 0, explained.stdout + explained.stderr
        assert f"Served by replica {first['replica']} on node solo (sim): HTTP 200" in explained.stdout
        # The same request as code, ready to copy.
        assert f"{base}/v1/chat/completions" in first["curl"] and '"stream":true' in first["curl"]
        assert "$LLMGW_API_KEY" in first["curl"] and "client.chat.completions.create(" in first["python"]
        assert "stream=True" in first["python"] and '"You are terse."' in first["python"]
        # The conversation goes on: the next request carries the first answer.
        fill(browser, "#pg-user", "And alpacas?")
        click(browser, "#pg-send")
        wait_until(lambda: [t["state"] for t in assistant_turns(browser)] == ["done", "done"], 30,
                   what="the second answer")
        second = assistant_turns(browser)[1]
        assert first["text"].split()[0] in second["python"] and '"assistant"' in second["python"]
        no_stray_values(browser, "playground")

        # The keys page: the first key is an admin key, and the console uses it from then on.
        click(browser, 'nav a[data-tab="keys"]')
        wait_until(lambda: browser.find_element("id", "keys-bootstrap").is_displayed(), 10, what="the first-key note")

        def create(name: str, **fields: str) -> str:
            fill(browser, '#key-create input[name="name"]', name)
            for f, v in fields.items():
                fill(browser, f'#key-create input[name="{f}"]', v)
            click(browser, '#key-create button[name="save"]')
            wait_until(lambda: attr(browser, "#new-secret", "data-key") == name, 10, what=f"the secret of {name}")
            return text(browser, "#new-secret-value").strip()

        ops = create("ops")
        wait_until(lambda: attr(browser, 'tr[data-key="ops"]', "data-admin") == "true", 10, what="ops listed, admin")
        assert browser.execute_script("return sessionStorage.getItem('llmgw.key')") == ops
        team = create("team", models="elsewhere")
        app = create("app")
        assert len({ops, team, app}) == 3 and all(k.startswith("sk-llmgw-") for k in (ops, team, app))
        no_stray_values(browser, "keys")
        click(browser, 'nav a[data-tab="events"]')
        wait_until(lambda: "admin key 'ops'" in text(browser, 'tr[data-kind="key_created"]'), 10,
                   what="the key events naming the admin key")
        assert "first key" in text(browser, 'tr[data-kind="key_created"]')

        # A pasted key that may not call the model: the gateway's answer, as it gave it.
        click(browser, 'nav a[data-tab="playground"]')
        browser.find_element("id", "pg-key").send_keys(team)
        click(browser, "#pg-key-use")
        wait_until(lambda: attr(browser, "#pg-key-info [data-key-name]", "data-key-name") == "team", 15,
                   what="the playground naming the pasted key")
        assert "models: elsewhere" in text(browser, "#pg-key-info")
        fill(browser, "#pg-model", "chat")
        fill(browser, "#pg-user", "Hello?")
        click(browser, "#pg-send")
        wait_until(lambda: assistant_turns(browser)[-1]["state"] == "error", 15, what="the refusal shown")
        refused = assistant_turns(browser)[-1]
        direct = requests.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {team}"}, timeout=10,
                               json={"model": "chat", "messages": [{"role": "user", "content": "Hello?"}]})
        assert (int(refused["status"]), refused["code"]) == (direct.status_code, direct.json()["error"]["code"])
        assert direct.json()["error"]["message"] in refused["text"]

        # A key made in the console works from the openai client; revoked there, it stops within the bound.
        ask = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

        def answered() -> bool:  # a new client each time: a new connection, to whichever worker takes it
            with openai.OpenAI(base_url=base + "/v1", api_key=app, max_retries=0, timeout=30) as client:
                return bool(client.chat.completions.create(**ask).choices)

        wait_until(lambda: all(answered() for _ in range(4)), 10, what="the app key taken by every gateway worker")
        click(browser, 'nav a[data-tab="keys"]')
        wait_until(lambda: attr(browser, 'tr[data-key="app"]', "data-key") == "app", 10, what="the keys list")
        click(browser, 'tr[data-key="app"] button[name="revoke"]')
        wait_until(lambda: text(browser, 'tr[data-key="app"] button[name="revoke"]') == "confirm revoke", 5,
                   what="the revoke confirmation")
        click(browser, 'tr[data-key="app"] button[name="revoke"]')
        revoked_at = time.monotonic()

        def refused_now() -> bool:
            try:
                answered()
            except openai.AuthenticationError:
                return True
            return False

        # Refused by every worker: several in a row, each on a new connection.
        wait_until(lambda: all(refused_now() for _ in range(4)), keys_interval + 5, what="the revoked key refused")
        assert time.monotonic() - revoked_at < keys_interval + 5
        assert not text(browser, 'tr[data-key="app"]')
        assert [e.kind for e in store.latest_events(5, kind="key_revoked")] == ["key_revoked"]
    finally:
        up.signal_group(signal.SIGINT)
        try:
            up.popen.wait(60)
        except subprocess.TimeoutExpired:
            pass
        procs.stop_all()
