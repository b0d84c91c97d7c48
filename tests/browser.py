"""What a person sees: the Dagster and MLflow web UIs on a materialized home, in headless Chromium.

Servers are started the way a user starts them (``dagster-webserver -w workspace.yaml``, ``mlflow
server``) and driven with selenium through Debian's ``chromium`` and ``chromium-driver`` (.ci/run
installs them). Without them the browser tests skip, unless TRAINYARD_REQUIRE_BROWSER=1 (CI) makes
the absence a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def require_browser() -> None:
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not Path(path).exists()]
    if missing:
        message = f"headless Chromium needs {missing} (apt-get install chromium chromium-driver)"
        if os.environ.get("TRAINYARD_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_http(url: str, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{url}: the server exited with {process.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except (urllib.error.URLError, OSError):
            time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {timeout_s} s: {log.read_text()[-3000:]}")


@contextlib.contextmanager
def server(command: list[str], *, ready_url: str, env: dict, log: Path, timeout_s: float = 120) -> Iterator[None]:
    """Run ``command`` until the block ends; it must answer ``ready_url`` first."""
    with open(log, "w") as output:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        _wait_http(ready_url, process, log, timeout_s)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 15)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()


@contextlib.contextmanager
def chromium(screenshots: Path) -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1600,1100", "--no-first-run", "--disable-extensions"):
        options.add_argument(argument)
    screenshots.mkdir(parents=True, exist_ok=True)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def page_text(driver, url: str, *, until: list[str], ready=None, timeout_s: float = 60,
              screenshot: Path | None = None) -> str:
    """The page's visible text once every string of ``until`` is in it and ``ready(text)`` holds (the
    apps render client-side: names come before the statuses they load)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def loaded(d) -> bool:
        text = d.find_element(By.TAG_NAME, "body").text
        return all(item in text for item in until) and "Loading..." not in text and (ready is None or ready(text))

    driver.get(url)
    try:
        WebDriverWait(driver, timeout_s, poll_frequency=0.5).until(loaded)
    finally:
        if screenshot is not None:
            driver.save_screenshot(str(screenshot))
    return driver.find_element(By.TAG_NAME, "body").text


def show_markdown(driver, key: str, *, timeout_s: float = 20, screenshot: Path | None = None) -> list[int]:
    """Open the Markdown value of metadata ``key`` on an asset page; the widths of the images it draws."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    button = driver.find_element(By.XPATH, f"//tr[.//*[text()='{key}']]//*[contains(text(), 'Show Markdown')]")
    driver.execute_script("arguments[0].scrollIntoView(); arguments[0].click();", button)
    script = "return [...document.querySelectorAll(\"img[src^='data:image/png']\")].map(i => i.naturalWidth)"
    try:
        WebDriverWait(driver, timeout_s, poll_frequency=0.5).until(lambda d: any(d.execute_script(script)))
        time.sleep(0.5)  # the dialog fades in: a screenshot a person can read
    finally:
        if screenshot is not None:
            driver.save_screenshot(str(screenshot))
    return driver.execute_script(script)
