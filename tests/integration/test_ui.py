"""``rmqtx ui`` in a real browser: the suite fills a store, starts ``rmqtx ui`` on it as a
process, and opens each page in headless Chromium (Debian's ``chromium``; ``make browser``
installs it, and under ``make test`` a missing one is an error, not a skip) through Playwright.
It checks what a person would see: the numbers of each page against the store's own views, a
chart drawn with data, and a pending transaction that appears, then disappears after a
check-back round while the page refreshes itself. Screenshots of every page are kept in
``test-artifacts/ui/``.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from rmq_spark import LocalTransactionState, Message, Store
from rmq_spark.checkback.checkers import CallableChecker
from rmq_spark.checkback.job import CheckBackJob
from rmq_spark.model.config import RetentionSettings, TransactionSettings
from rmq_spark.model.schema import HALF_SCHEMA
from rmq_spark.ops.status import store_status
from rmq_spark.ops.views import groups_view, topics_view
from tests.integration.test_status_cli import build
from tests.lifetime import die_with_parent

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path(os.environ.get("RMQ_SPARK_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = REPO / "test-artifacts" / "ui"
#: Chromium as root in a container with no network: no sandbox, no GPU, no calls home.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PAGES = ("overview", "groups", "transactions", "topics", "store")


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if not CHROMIUM.exists():
        reason = f"no Chromium at {CHROMIUM}; run 'make browser'"
        if os.environ.get("RMQ_SPARK_BROWSER") == "required":
            pytest.fail(reason)
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        yield chromium
        chromium.close()


@pytest.fixture
def ui(store: Store) -> Iterator[str]:
    """``rmqtx ui`` on ``store``, as a process on a free port; yields its URL."""
    child = subprocess.Popen(
        [sys.executable, "-m", "rmq_spark.ops.cli", "--path", store.root, "ui", "--port", "0",
         "--sample-interval", "1s"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=die_with_parent,
    )  # fmt: skip
    try:
        first = child.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/", first)
        assert url, f"no URL in {first!r}: {child.stderr.read() if child.poll() else ''}"
        yield url.group(0)
    finally:
        child.terminate()
        child.wait(30)


def open_page(browser, url: str, name: str):
    page = browser.new_page(viewport={"width": 1366, "height": 860})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(f"{url}#{name}")
    page.wait_for_function(f"document.body.dataset.rendered === '{name}'")
    page.errors = errors
    return page


def cells(page, row_text: str) -> list[str]:
    """The cells of the first table row holding ``row_text``."""
    row = page.locator("table.data tbody tr", has_text=row_text).first
    return [c.strip() for c in row.locator("td").all_inner_texts()]


def chart_has_data(page, title: str) -> bool:
    """A chart was drawn (uPlot's canvas) from data points, not the "no data yet" box."""
    box = page.locator(f'.chart[data-chart^="{title}"]')
    return box.locator("canvas").count() == 1 and int(box.get_attribute("data-points") or 0) > 0


def shoot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_each_page_shows_the_store(spark, store: Store, ui: str, browser) -> None:
    build(spark, store)  # Orders, Payments, a pending and a discarded transaction, billing
    retention = RetentionSettings()
    status = store_status(store)

    overview = open_page(browser, ui, "overview")
    card = {
        c.get_attribute("data-card"): c.locator(".value").inner_text()
        for c in overview.locator(".card").all()
    }
    pending = sum(g["pending_transactions"] for g in status["producer_groups"])
    assert card["pending transactions"] == str(pending) == "1"
    assert card["topics"] == str(len(status["topics"]))
    assert card["discards not re-driven"] == "1"
    assert card["last check-back"].startswith("finished")
    assert chart_has_data(overview, "messages stored per minute")
    shoot(overview, "overview")

    groups = open_page(browser, ui, "groups")
    (billing,) = groups_view(store, retention)["groups"]
    rows = [
        [c.strip() for c in r.locator("td").all_inner_texts()]
        for r in groups.locator("table.data tbody tr").all()
    ]
    assert [(r[0], r[1], r[2], int(r[3]), r[5], r[6]) for r in rows] == [
        ("billing", "spark", "Orders", q["queue_id"], f"{q['end_offset']:,}", f"{q['lag']:,}")
        for q in billing["queues"]
    ]
    groups.wait_for_function(  # the lag sampler's points come in as the page refreshes
        "Number(document.querySelector('.chart')?.dataset.points || 0) >= 2", timeout=20_000
    )
    shoot(groups, "groups")

    topics = open_page(browser, ui, "topics")
    for topic in topics_view(store, retention)["topics"]:
        row = cells(topics, topic["topic"])
        assert row[:2] == [topic["topic"], f"{topic['messages']:,}"]
        assert row[4] == f"{topic['last_hour']:,}"
    assert chart_has_data(topics, "messages stored per minute")
    shoot(topics, "topics")

    store_page = open_page(browser, ui, "store")
    assert cells(store_page, "commitlog")[1:3] == [
        "commitlog",
        str(store.table("commitlog").version()),
    ]
    shoot(store_page, "store")
    for page in (overview, groups, topics, store_page):
        assert page.errors == [], page.errors


def test_a_pending_transaction_appears_then_goes_after_check_back(
    spark, store: Store, ui: str, browser
) -> None:
    store.send([Message("Orders", "seed")], "shop")
    (held,) = store.prepare([Message("Orders", "o-1", keys="o-1")], "shop")
    page = open_page(browser, ui, "transactions")
    assert cells(page, "shop")[1] == "1"  # pending
    assert cells(page, "shop")[4] == "1"  # under a minute old
    assert chart_has_data(page, "pending transactions by age")
    shoot(page, "transactions")

    def commit(msg):
        return LocalTransactionState.COMMIT

    job = CheckBackJob(
        spark, store, {"shop": CallableChecker(commit)}, TransactionSettings(transaction_timeout=0)
    )
    assert job.run_once().summary.committed == 1
    # The page refreshes itself: the pending transaction goes, the run and its commit come;
    # checked in one look at one rendering (the page is replaced at every refresh).
    page.wait_for_function(
        "(() => { const rows = [...document.querySelectorAll('table.data tbody tr')]"
        ".map(r => [...r.cells].map(c => c.innerText));"
        " return rows.some(r => r[0] === 'shop' && r[1] === '0')"
        " && rows.some(r => r[1] === 'finished' && r[3] === '1' && r[4] === '1'); })()",
        timeout=20_000,
    )
    assert chart_has_data(page, "check-back runs")
    shoot(page, "transactions-after-check-back")
    assert store.decisions([held.transaction_id])
    assert page.errors == []


def test_the_pages_escape_what_the_store_holds(store: Store, ui: str, browser) -> None:
    """Names are validated when written through rmq-spark, but another Delta writer can put
    anything in the tables: a producer group named like HTML shows as text."""
    store.prepare([Message("Orders", "y")], "shop")
    (row,) = store.read("half").to_pylist()
    row |= {"transaction_id": "foreign-1", "msg_id": "foreign-1", "producer_group": "<b>x</b>"}
    write_deltalake(
        store.table_uri("half"), pa.Table.from_pylist([row], HALF_SCHEMA), mode="append"
    )
    page = open_page(browser, ui, "transactions")
    assert page.locator("table.data b").count() == 0
    assert cells(page, "<b>x</b>")[0] == "<b>x</b>"
    assert page.errors == []


def test_ui_serves_no_file_outside_its_own(ui: str) -> None:
    curl = shutil.which("curl")
    assert curl
    for path in ("/../../setup.py", "/%2e%2e/%2e%2e/setup.py", "/api/../../setup.py"):
        got = subprocess.run(
            [curl, "-s", "--path-as-is", "-o", "/dev/null", "-w", "%{http_code}",
             ui.rstrip("/") + path],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert got.stdout == "404", (path, got.stdout)


def test_beyond_loopback_only_dashboard_accounts_over_https(store: Store, tmp_path: Path) -> None:
    """Bound wider, the pages (the whole store) need the same accounts as rmqtx serve, with
    dashboard = true: HTTP Basic over TLS; nobody else, and never in plaintext (#49)."""
    refused = subprocess.run(
        [sys.executable, "-m", "rmq_spark.ops.cli", "--path", store.root, "ui", "--host",
         "0.0.0.0"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode == 2 and "dashboard = true" in refused.stderr
    assert "ssh -L" in refused.stderr
    conf = tmp_path / "ui.toml"
    conf.write_text(
        '[serve.accounts.ops]\nsecret_key = "0ps-s3cret"\ntopics = []\ndashboard = true\n'
        '[serve.accounts.orders]\nsecret_key = "0rders"\ntopics = ["*"]\n'
    )
    child = subprocess.Popen(
        [sys.executable, "-m", "rmq_spark.ops.cli", "--conf", str(conf), "--path", store.root,
         "ui", "--host", "0.0.0.0", "--port", "0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=die_with_parent,
    )  # fmt: skip
    try:
        port = re.search(r"https://0\.0\.0\.0:(\d+)/", child.stdout.readline()).group(1)
        url = f"https://127.0.0.1:{port}/api/store"
        insecure = ssl.create_default_context()
        insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE  # self-signed

        def status(credentials: str | None) -> int:
            request = urllib.request.Request(url)
            if credentials is not None:
                token = base64.b64encode(credentials.encode()).decode()
                request.add_header("Authorization", f"Basic {token}")
            try:
                with urllib.request.urlopen(request, context=insecure, timeout=30) as response:
                    assert json.load(response)["store"] == store.root
                    return response.status
            except urllib.error.HTTPError as error:
                return error.code

        assert status(None) == 401
        assert status("ops:wrong") == 401
        assert status("orders:0rders") == 401  # a serve account, without dashboard = true
        assert status("nobody:0ps-s3cret") == 401
        assert status("ops:0ps-s3cret") == 200
        with pytest.raises(OSError):  # no plaintext: refused or dropped
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/store", timeout=30)
        assert status("ops:0ps-s3cret") == 200  # and the server is still there
    finally:
        child.terminate()
        child.wait(30)
    assert "Traceback" not in child.stderr.read()
