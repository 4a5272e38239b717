"""The console in a real browser (Debian's chromium through Playwright) against the whole stack:
log in, pull a model, deploy it, chat in the playground, see the dashboard notice a node
stopping. Screenshots land in var/test/screenshots/ for a person to look at."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import CHAT, ROOT

pytestmark = pytest.mark.e2e

CHROMIUM = "/usr/bin/chromium"
SHOTS = ROOT / "var/test/screenshots"
PASSWORD = "e2e-console-password-1"


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if not os.path.exists(CHROMIUM):
        pytest.fail(
            f"{CHROMIUM} is missing: `apt-get install chromium` (make test does it as root)"
        )
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def operator(stack):
    """A staff login on the stack."""
    secrets = dict(
        line.split("=", 1) for line in (stack["var"] / "env").read_text().splitlines() if line
    )
    env = stack["env"] | secrets | {"DJANGO_SUPERUSER_PASSWORD": PASSWORD}
    subprocess.run(
        [sys.executable, "manage.py", "createsuperuser", "--noinput", "--username", "operator",
         "--email", "operator@example.com"],
        cwd=ROOT, env=env, check=True, capture_output=True,
    )  # fmt: skip
    return "operator"


def shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_an_operator_runs_the_fleet_from_the_browser(
    stack, operator, browser, smollm2_path, reference_text, tmp_path
):
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1440, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    # Log in: the console sends us to its login page first.
    page.goto(stack["url"] + "/console/")
    expect(page).to_have_url(stack["url"] + "/console/login/?next=/console/")
    page.fill("input[name=username]", operator)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    expect(page.locator("#live")).to_contain_text("Live")
    node_row = page.locator("#nodes tbody tr").first
    expect(node_row.locator("td.state")).to_have_text("ready")
    expect(
        page.locator("#deployments tbody tr[data-deployment=smollm2-135m-instruct]")
    ).to_contain_text("ready")
    shot(page, "1-dashboard")

    # Pull a model (here: import the same GGUF under another name) and watch it arrive.
    page.fill("#pull-form input[name=name]", "smollm2-copy")
    page.fill("#pull-form input[name=local_path]", str(smollm2_path))
    page.click("#pull-form button")
    expect(page.locator("#result")).to_contain_text("Pulling smollm2-copy")
    model_row = page.locator("#models tbody tr[data-model=smollm2-copy]")
    expect(model_row.locator("td.state")).to_have_text("ready", timeout=60_000)
    expect(model_row).to_contain_text("llama")  # GGUF facts: the architecture
    shot(page, "2-pulled")

    # Quantize an F16 model (SmolLM2 dequantized) to Q4_K_M: the variant appears under its
    # source with its quality and speed measured against it.
    from tests.ggufs import rewrite

    f16 = rewrite(smollm2_path, tmp_path / "smol-f16.gguf", f16=True)[0]
    page.fill("#pull-form input[name=name]", "smol-f16")
    page.fill("#pull-form input[name=local_path]", str(f16))
    page.click("#pull-form button")
    source_row = page.locator("#models tbody tr[data-model=smol-f16]")
    expect(source_row.locator("td.state")).to_have_text("ready", timeout=60_000)
    source_row.locator(".quantize select").select_option("Q4_K_M")
    source_row.locator(".quantize button").click()
    expect(page.locator("#result")).to_contain_text("Making smol-f16-q4_k_m")
    variant = page.locator("#models tbody tr[data-model=smol-f16-q4_k_m]")
    expect(variant.locator("td.state")).to_have_text("ready", timeout=180_000)
    expect(variant).to_have_attribute("data-depth", "1")
    expect(variant).to_contain_text("made from smol-f16")
    expect(variant.locator("td.quant")).to_have_text("Q4_K_M")
    expect(variant.locator(".quality")).to_contain_text("NLL +")
    expect(variant).to_contain_text("tok/s")
    # Grouped: the variant's row comes right after its source's.
    names = page.locator("#models tbody tr").evaluate_all("rows => rows.map(r => r.dataset.model)")
    assert names.index("smol-f16-q4_k_m") == names.index("smol-f16") + 1
    shot(page, "2b-quantized")

    # Preview the plan, then deploy it with 2 slots of 512 tokens; the table follows it to
    # ready and draws where it runs.
    page.select_option("#deploy-model", "smollm2-copy")
    page.fill("#deploy-form input[name=context_length]", "512")
    page.fill("#deploy-form input[name=parallel]", "2")
    page.click("#preview-plan")
    preview = page.locator("#plan-preview .plan[data-plan-kind=replicas]")
    expect(preview).to_contain_text("replicas on")
    expect(page.locator("#plan-preview .reasons")).to_contain_text("no split")
    page.click("#deploy-form button[type=submit]")
    dep_row = page.locator("#deployments tbody tr[data-deployment=smollm2-copy]")
    expect(dep_row.locator("td.state")).to_have_text("ready", timeout=120_000)
    expect(dep_row.locator(".plan[data-plan-kind=replicas]")).to_contain_text("replicas on")
    shot(page, "3-deployed")

    # Chat in the playground: streamed text, the same as llama-cpp-python's, and its figures.
    page.goto(stack["url"] + "/console/playground/")
    page.select_option("#model", "smollm2-copy")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "48")
    page.fill("#prompt", CHAT[0]["content"])
    page.click("#send")
    answer = page.locator(".bubble.assistant").last
    expect(answer.locator(".stats")).to_contain_text("tokens/s", timeout=60_000)
    assert answer.locator(".text").inner_text() == reference_text(CHAT, 48)
    expect(answer.locator(".stats")).to_contain_text("replica")
    # Output and input are text, never markup.
    page.fill("#prompt", "Repeat exactly: <img src=x onerror=alert(1)><b>bold</b>")
    page.click("#send")
    expect(page.locator(".bubble.assistant").last.locator(".stats")).to_contain_text(
        "tokens", timeout=60_000
    )
    assert page.locator(".bubble img, .bubble b").count() == 0
    # Stop a long answer.
    page.fill("#max_tokens", "1000")
    page.fill("#prompt", "Write a very long story about a lighthouse.")
    page.click("#send")
    expect(page.locator(".bubble.assistant").last.locator(".text")).not_to_be_empty(timeout=30_000)
    page.click("#stop")
    expect(page.locator(".bubble.assistant").last.locator(".stats")).to_contain_text("stopped")
    # A second conversation starts empty; the first is kept.
    page.click("#new-conversation")
    expect(page.locator(".bubble")).to_have_count(0)
    page.locator("#conversations a").first.click()
    expect(page.locator(".bubble.user")).to_have_count(3)
    shot(page, "4-playground")

    # Stop the node's agent: the open dashboard shows it unreachable without a reload.
    page.goto(stack["url"] + "/console/")
    expect(page.locator("#live")).to_contain_text("Live")
    agent_pid = int((stack["var"] / "run" / "agent.pid").read_text())
    os.kill(agent_pid, signal.SIGKILL)
    expect(page.locator("#nodes tbody tr").first.locator("td.state")).to_have_text(
        "unreachable", timeout=30_000
    )
    shot(page, "5-node-stopped")
    assert errors == []
