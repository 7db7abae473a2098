"""The dashboard at /ui in a real headless Chromium (Debian's `chromium`, driven by Playwright
over CDP; Playwright never downloads a browser here), against a real daemon on the stand-in;
and /docs with every asset served by the daemon itself.

Screenshots (desktop and phone width) are written under tests/artifacts/ (ignored by git).
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import pytest

from .support.configs import standin_config, two_configs
from .support.daemon import Daemon, start_daemon, until
from .support.gpu import start_holder
from .support.procs import Proc, free_port, require_tool

ARTIFACTS = Path(__file__).with_name("artifacts")
TOKEN = "ui-s3cret"
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
# Each wait on the page is bounded; a state change must show within this (the page polls /status
# every second).
UPDATE_MS = 2000


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chromium = require_tool("chromium")
    from playwright.sync_api import sync_playwright  # noqa: PLC0415

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=chromium, headless=True)
        yield b
        b.close()


@pytest.fixture
def page_for(browser: Any) -> Iterator[Any]:
    """`page_for(daemon, viewport)`: a fresh context (no storage, no cookies) on /ui, with every
    request the page makes recorded in `page.requested`."""
    contexts = []

    def open_page(d: Daemon, viewport: dict[str, int] = DESKTOP, path: str = "/ui") -> Any:
        context = browser.new_context(viewport=viewport)
        contexts.append(context)
        page = context.new_page()
        page.requested = []
        page.on("request", lambda r: page.requested.append(r.url))
        page.errors = []
        page.on("pageerror", lambda e: page.errors.append(str(e)))
        page.goto(d.url + path)
        return page

    yield open_page
    for context in contexts:
        context.close()


def expect(locator: Any) -> Any:
    from playwright.sync_api import expect as pw_expect  # noqa: PLC0415

    return pw_expect(locator)


def only_the_daemon(page: Any, d: Daemon) -> None:
    own = urlsplit(d.url).netloc
    foreign = [u for u in page.requested if urlsplit(u).scheme in ("http", "https", "ws", "wss")
               and urlsplit(u).netloc != own]  # fmt: skip
    assert not foreign, f"the page fetched from elsewhere: {foreign}"


def screenshot(page: Any, name: str) -> Path:
    """A full-page PNG kept under tests/artifacts/, checked to show something (many colours,
    not one flat fill)."""
    from PIL import Image  # noqa: PLC0415

    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.evaluate("window.scrollTo(0, 0)")  # the sticky header at the top of the picture
    png = page.screenshot(path=str(path), full_page=True)
    image = Image.open(io.BytesIO(png)).convert("RGB")
    width = page.viewport_size["width"]
    assert image.size[0] == width
    colours = image.getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 50, f"{path}: {len(colours)} colours: a blank page?"
    print(f"screenshot: {path} ({image.size[0]}x{image.size[1]}, {len(colours)} colours)")
    return path


def test_dashboard_shows_the_server_and_follows_a_stop_within_2_s(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, page_for: Any
) -> None:
    # A process an earlier daemon life recorded as its own (an orphan) on GPU 5.
    orphan = start_holder(procs, fake_gpu, 5, 3000)
    created = psutil.Process(orphan.pid).create_time()
    (tmp_path / "state").mkdir()
    known = {"known_processes": [[orphan.pid, created, "20261204T000000-000001"]]}
    (tmp_path / "state" / "state.json").write_text(json.dumps(known))
    d = start_daemon(procs, tmp_path, fake_gpu, two_configs(), default="good")
    d.wait_state("ready")
    holder = start_holder(procs, fake_gpu, 3, 5000)  # a foreign process on GPU 3

    def holders() -> dict[int, str]:
        return {p["pid"]: p["holder"] for g in d.status()["gpus"] for p in g["processes"]}

    until(lambda: holder.pid in holders(), 10, "the foreign holder in /status")
    seen = holders()
    assert seen[orphan.pid] == "orphan" and seen[holder.pid] == "foreign"
    assert sorted(seen.values()) == ["foreign", "orphan", "ours"]
    page = page_for(d)
    expect(page.locator("#state")).to_have_text("ready", timeout=UPDATE_MS)
    expect(page.locator("#config")).to_have_text("good")
    st = d.status()
    facts = page.locator("#server-facts")
    expect(facts).to_contain_text(str(st["pid"]))
    expect(facts).to_contain_text(st["launch_id"])
    # GPU 0 holds the stand-in's scheduler (ours); GPU 3 the foreign holder.
    expect(page.locator('[data-gpu="0"] [data-holder="ours"]')).to_have_count(1, timeout=UPDATE_MS)
    foreign = page.locator('[data-gpu="3"] [data-holder="foreign"]')
    expect(foreign).to_contain_text(f"pid {holder.pid}")
    expect(foreign).to_contain_text("4.9 GiB")
    expect(page.locator('[data-gpu="3"]')).to_contain_text("4.9 GiB / 140.4 GiB")
    expect(page.locator('[data-gpu="5"] [data-holder="orphan"]')).to_contain_text(
        f"pid {orphan.pid}"
    )
    # The live log: the launch's lines so far, then the ones that come after.
    log = page.locator("#log")
    expect(log).to_contain_text("The server is fired up and ready to roll!", timeout=UPDATE_MS)
    expect(page.locator('#timeline [data-event="launch"]')).to_have_count(1, timeout=UPDATE_MS)
    screenshot(page, "dashboard-desktop")

    res = d.http.post("/stop")
    assert res.status_code == 202
    d.wait_state("stopped")
    # Within 2 s of the daemon's own record of `stopped`, the page says so.
    expect(page.locator("#state")).to_have_text("stopped", timeout=UPDATE_MS)
    expect(page.locator("#exit-body")).to_contain_text("requested_stop", timeout=UPDATE_MS)
    expect(page.locator('#timeline [data-event="exit"]')).to_have_count(1, timeout=UPDATE_MS)
    assert not page.errors, page.errors
    only_the_daemon(page, d)


def test_a_swap_from_the_page_shows_its_outcome_and_a_rollback_its_evidence(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, page_for: Any
) -> None:
    configs = two_configs(oom=standin_config("--standin-crash-on-load=cuda_oom"))
    d = start_daemon(procs, tmp_path, fake_gpu, configs, default="good")
    d.wait_state("ready")
    page = page_for(d)
    expect(page.locator("#state")).to_have_text("ready", timeout=UPDATE_MS)
    select = page.locator("#config-select")
    expect(select.locator("option")).to_have_count(3, timeout=UPDATE_MS)

    # The argv of the chosen config, and its preflight.
    select.select_option("other")
    expect(page.locator("#config-argv")).to_contain_text("-m gpuwarden.standin --model-path")
    page.click("#check-btn")
    expect(page.locator("#config-result")).to_contain_text("Preflight passed for other")

    # A swap asks first; cancelling touches nothing.
    page.click("#swap-btn")
    expect(page.locator("#confirm-dialog")).to_be_visible()
    expect(page.locator("#confirm-title")).to_have_text("Swap to other?")
    page.click("#confirm-cancel")
    expect(page.locator("#confirm-dialog")).to_be_hidden()
    assert d.status()["config"] == "good"

    page.click("#swap-btn")
    page.click("#confirm-ok")
    expect(page.locator("#config-result")).to_contain_text("Swap to other: ready", timeout=30000)
    assert d.status()["config"] == "other"
    expect(page.locator("#config")).to_have_text("other", timeout=UPDATE_MS)

    # A config that dies while loading: rolled back, with SGLang's evidence on the page.
    select.select_option("oom")
    page.click("#swap-btn")
    page.click("#confirm-ok")
    result = page.locator("#config-result")
    expect(result).to_contain_text("Swap to oom: rolled_back", timeout=30000)
    expect(result).to_contain_text("reason: cuda_oom")
    expect(page.locator("#exit-body")).to_contain_text("cuda_oom", timeout=UPDATE_MS)
    expect(page.locator("#exit-body .evidence")).to_contain_text("out of memory")
    expect(page.locator('#timeline [data-event="rollback"]')).to_contain_text("oom → other")
    d.wait_state("ready")
    expect(page.locator("#state")).to_have_text("ready", timeout=UPDATE_MS)
    # The crash's lines are marked as errors in the live log (the stream followed the launches).
    expect(page.locator("#log .l.err").filter(has_text="out of memory").first).to_be_visible(
        timeout=UPDATE_MS
    )
    screenshot(page, "dashboard-rollback")
    page.check("#log-errors")
    assert page.locator("#log .l:not(.err)").first.is_hidden()

    # The dump, read with the page's own request.
    page.click("#dump-open")
    expect(page.locator("#dump-text")).to_contain_text("cuda_oom", timeout=10000)
    assert not page.errors, page.errors
    only_the_daemon(page, d)


def test_a_restart_shows_its_phase_with_an_eta_then_where_its_start_went(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, page_for: Any
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, {"slow": standin_config(scale=0.4)}, default="slow")
    d.wait_state("ready")
    page = page_for(d)
    facts = page.locator("#server-facts")
    expect(facts).to_contain_text("start took", timeout=UPDATE_MS)
    expect(facts).to_contain_text("weights")
    mark = d.mark()
    d.http.post("/restart", params={"wait": "false"})
    # The second start of the config: its phase, the time in it, and when it will be ready.
    progress = page.locator("#swap-progress")
    expect(progress).to_contain_text("loading weights", timeout=15000)
    expect(progress).to_contain_text("ready in ~")
    expect(facts).to_contain_text("loading weights")
    d.wait_state("ready", after=mark)
    expect(progress).to_be_hidden(timeout=UPDATE_MS)
    expect(facts).to_contain_text("start took")
    assert not page.errors, page.errors
    only_the_daemon(page, d)


def test_sweeps_show_their_table_and_chart_on_a_phone(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, page_for: Any
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, two_configs(), default="good")
    d.wait_state("ready")
    body = {"configs": ["good", "other"], "requests": 1, "warmup": 0, "max_tokens": 16}
    res = d.http.post("/sweeps", json=body)
    assert res.status_code == 202, res.text
    sid = res.json()["id"]
    d.wait_event("server.sweep_finished", sweep_id=sid, timeout=90)
    page = page_for(d, PHONE)
    expect(page.locator("#sweep-select")).to_have_value(sid, timeout=UPDATE_MS)
    table = page.locator("#sweep-body table")
    expect(table.locator("tbody tr")).to_have_count(2, timeout=5000)
    expect(table.locator("thead")).to_contain_text("tok/s")
    chart = page.locator("#sweep-body img")
    expect(chart).to_be_visible()
    page.wait_for_function("document.querySelector('#sweep-body img').naturalWidth > 100")
    expect(page.locator("#state")).to_have_text("ready")
    # Nothing wider than the phone: the cards stack and wide content scrolls inside them.
    overflow = page.evaluate("document.documentElement.scrollWidth")
    assert overflow <= PHONE["width"], overflow
    screenshot(page, "dashboard-phone")
    assert not page.errors, page.errors
    only_the_daemon(page, d)


def test_with_a_token_the_page_asks_once_and_sends_it_as_a_header(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, page_for: Any
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    d = start_daemon(
        procs, tmp_path, fake_gpu, two_configs(), default="good", token_file=str(token_file)
    )
    d.wait_state("ready")
    headers = {"Authorization": f"Bearer {TOKEN}"}
    page = page_for(d)
    dialog = page.locator("#token-dialog")
    expect(dialog).to_be_visible(timeout=UPDATE_MS)
    page.fill("#token-input", "wrong")
    page.click("#token-submit")
    expect(page.locator("#token-error")).to_have_text("The token was refused.")
    expect(dialog).to_be_visible()
    page.fill("#token-input", TOKEN)
    page.click("#token-submit")
    expect(dialog).to_be_hidden()
    expect(page.locator("#state")).to_have_text("ready", timeout=UPDATE_MS)
    # The live log comes through the token-carrying fetch stream.
    expect(page.locator("#log")).to_contain_text("fired up and ready to roll", timeout=UPDATE_MS)
    assert page.evaluate("sessionStorage.getItem('gpuwarden.token')") == TOKEN
    assert page.context.cookies() == []

    # A reload keeps the token for this tab: no second prompt.
    page.reload()
    expect(page.locator("#state")).to_have_text("ready", timeout=UPDATE_MS)
    assert dialog.is_hidden()
    assert d.http.post("/stop", headers=headers).status_code == 202
    d.wait_state("stopped")
    expect(page.locator("#state")).to_have_text("stopped", timeout=UPDATE_MS)
    assert not page.errors, page.errors


def test_docs_render_offline_in_the_browser(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, page_for: Any
) -> None:
    d = start_daemon(procs, tmp_path, fake_gpu, two_configs())
    page = page_for(d, path="/docs")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("gpuwarden", timeout=10000)
    expect(page.locator(".swagger-ui")).to_contain_text("/restart")
    only_the_daemon(page, d)


# -- over plain HTTP (no browser) ----------------------------------------------------------


def test_the_shell_and_assets_need_no_token_but_data_does(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    d = start_daemon(procs, tmp_path, fake_gpu, two_configs(), token_file=str(token_file))
    ui = d.http.get("/ui")
    assert ui.status_code == 200 and ui.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in ui.headers["content-security-policy"]
    assert "set-cookie" not in ui.headers
    # Everything the page and the docs load comes from the daemon itself.
    assert not re.search(r"""(?:src|href)=["']?(?:https?:)?//""", ui.text), ui.text
    for path in ("/ui/app.js", "/ui/style.css", "/ui/favicon.svg"):
        res = d.http.get(path)
        assert res.status_code == 200 and res.content, path
    for name in ("swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"):
        res = d.http.get(f"/docs/assets/{name}")
        assert res.status_code == 200 and len(res.content) > 1000, name
    assert d.http.get("/ui/secret.txt").status_code == 404
    assert d.http.get("/docs/assets/..%2Fstatus").status_code == 404
    # The data and the docs keep the token rule.
    for path in ("/status", "/logs", "/docs", "/openapi.json", "/dump"):
        assert d.http.get(path).status_code == 401, path
    docs = d.http.get("/docs", headers={"Authorization": f"Bearer {TOKEN}"})
    assert docs.status_code == 200
    assert "/docs/assets/swagger-ui-bundle.js" in docs.text
    assert not re.search(r"https?://", docs.text), docs.text
    # A state-changing request from another site is still refused, page or no page.
    res = d.http.post(
        "/stop",
        headers={"Authorization": f"Bearer {TOKEN}", "Origin": "http://evil.example"},
    )
    assert res.status_code == 403


def test_the_front_proxy_shows_what_it_does_with_requests(
    procs: list[Proc], tmp_path: Path, fake_gpu: Path, page_for: Any
) -> None:
    listen = f"127.0.0.1:{free_port()}"
    d = start_daemon(
        procs, tmp_path, fake_gpu, two_configs(), default="good", proxy={"listen": listen}
    )
    d.wait_state("ready")
    page = page_for(d)
    facts = page.locator("#server-facts")
    expect(facts).to_contain_text(f"{listen} passing", timeout=UPDATE_MS)
    d.http.post("/stop")
    expect(facts).to_contain_text(f"{listen} rejecting", timeout=UPDATE_MS)
