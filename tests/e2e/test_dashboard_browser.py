"""The dashboard in a real headless browser (Debian's chromium, driven by selenium)
against a real `dstack serve` under a little load: every served model is shown, the cycle
has bars, the numbers move between two looks, and the page logs no error (a blocked
asset or script would). A screenshot is saved in the test's temp dir.

`make test` installs chromium and chromedriver where it can (`make browser`: root with
apt-get); elsewhere this test is skipped and says so."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from server import codec
from tests.e2e.conftest import ROOT
from tests.e2e.server_process import ServerProcess

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
CHROMIUM = shutil.which("chromium")
DRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                       reason="no chromium/chromedriver: `make browser` installs them as root"),
]
MODELS = ("tiny_cnn", "mobilenet_v3_small")


def send_load(url: str, stop: threading.Event) -> None:
    """A few requests a second to each model, until `stop` (bounded by the test)."""
    with httpx.Client(base_url=f"http://{url}", timeout=10) as http:
        bodies = []
        for m in MODELS:
            inp = http.get(f"/v2/models/{m}").json()["inputs"][0]
            x = np.zeros([1, *inp["shape"][1:]], np.float32)
            body, hlen = codec.encode_request({inp["name"]: x})
            bodies.append((m, body, {codec.HEADER_LENGTH: str(hlen)}))
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            for m, body, headers in bodies:
                http.post(f"/v2/models/{m}/infer", content=body, headers=headers)
            stop.wait(0.15)


def look(driver: webdriver.Chrome) -> dict[str, str]:
    """Each model's row of the table, as text, read in one script: the page redraws the
    table on every poll, so an element found in one call may be gone by the next."""
    rows = driver.execute_script(
        "return [...document.querySelectorAll('#table tbody tr')]"
        ".map(r => [r.cells[0].innerText, r.innerText])")
    return {name.strip(): text for name, text in rows}


def status(driver: webdriver.Chrome) -> str:
    el = "document.getElementById('status')"
    return str(driver.execute_script(f"return {el} ? {el}.innerText : ''"))


def wait_for(cond, timeout_s: float = 30) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the page")
        time.sleep(0.25)


def server_config(tmp_path: Path) -> dict:
    """This module's server (tests/e2e/conftest.py `module_server`)."""
    return {
        "device": "cpu", "policy": "dstack", "profiles": str(ROOT / "profiles" / "cpu"),
        "adapt": {"enabled": False},
        "models": [{"name": "tiny_cnn", "slo_ms": 2000, "max_batch_size": 4, "rate_rps": 5},
                   {"name": "mobilenet_v3_small", "slo_ms": 2000, "max_batch_size": 4,
                    "rate_rps": 5}],
    }


def test_dashboard_in_a_browser(module_server: ServerProcess, tmp_path: Path) -> None:
    srv = module_server
    stop = threading.Event()
    load = threading.Thread(target=send_load, args=(srv.url, stop), daemon=True)
    load.start()
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1400,1100"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(str(DRIVER)))
    try:
        driver.get(f"http://{srv.url}/dashboard")
        wait_for(lambda: set(look(driver)) == set(MODELS))
        wait_for(lambda: status(driver) == "live")
        bars = driver.find_elements("css selector", "#schedule svg rect")
        assert len(bars) >= len(MODELS)  # one slot per model in the cycle
        assert len(driver.find_elements("css selector", "#charts svg.chart")) == 6
        first = look(driver)
        wait_for(lambda: all(look(driver)[m] != first[m] for m in MODELS))
        wait_for(lambda: driver.find_elements("css selector", "#charts path.line"))
        driver.save_screenshot(str(tmp_path / "dashboard.png"))
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
    finally:
        driver.quit()
        stop.set()
        load.join(15)
