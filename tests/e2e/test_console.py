"""The console in a real browser (Debian's chromium through Playwright) against the whole stack:
log in, pull a model, deploy it, watch the charts and the plan pictures, chat in the
playground (markdown, regenerate, edit, compare, reload), see the dashboard notice a node
stopping; the same pages at a phone's width, and axe-core's accessibility check on each.
Screenshots land in var/test/screenshots/ for a person to look at."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import CHAT, ROOT

pytestmark = pytest.mark.e2e

CHROMIUM = "/usr/bin/chromium"
AXE = ROOT / "tests/vendor/axe.min.js"  # axe-core from npm (MPL-2.0), vendored
STORE = "llamafleet.playground.v1"
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


def accessible(page, name: str) -> None:
    """axe-core's WCAG 2 A/AA rules on the page as it is: no serious or critical violation."""
    page.add_script_tag(path=str(AXE))
    result = page.evaluate(
        "() => axe.run(document, {runOnly: {type: 'tag', values: ['wcag2a', 'wcag2aa']}})"
    )
    bad = [
        f"{v['id']} ({v['impact']}): {v['help']} at {[n['target'] for n in v['nodes'][:3]]}"
        for v in result["violations"]
        if v["impact"] in ("serious", "critical")
    ]
    assert bad == [], f"{name}: {bad}"


def log_in(page, url: str, user: str) -> None:
    page.goto(url + "/console/")
    page.fill("input[name=username]", user)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")


def stored(page) -> dict:
    return page.evaluate(f"() => JSON.parse(localStorage.getItem('{STORE}'))")


def test_the_console_at_a_phones_width(stack, operator, browser):
    """Every page fits a 390 px screen (wide tables scroll inside their section), a chat
    works by touch and keyboard, and axe-core finds nothing serious."""
    from playwright.sync_api import expect

    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    wide = "() => document.documentElement.scrollWidth"
    log_in(page, stack["url"], operator)
    expect(page.locator("#live")).to_contain_text("Live")
    expect(
        page.locator("#deployments tbody tr[data-deployment=smollm2-135m-instruct] td.state")
    ).to_have_text("ready", timeout=60_000)
    assert page.evaluate(wide) <= 390
    accessible(page, "dashboard at 390 px")
    shot(page, "narrow-1-dashboard")

    page.goto(stack["url"] + "/console/playground/")
    page.fill("#max_tokens", "16")
    page.fill("#prompt", "Say hello.")
    page.press("#prompt", "Enter")
    answer = page.locator(".bubble.assistant").last
    expect(answer.locator(".stats")).to_contain_text("tokens/s", timeout=60_000)
    expect(page.locator("#send")).to_be_in_viewport()
    assert page.evaluate(wide) <= 390
    accessible(page, "playground at 390 px")
    shot(page, "narrow-2-playground")

    page.goto(stack["url"] + "/console/reports/")
    assert page.evaluate(wide) <= 390
    accessible(page, "reports at 390 px")
    shot(page, "narrow-3-reports")
    context.close()
    assert errors == []


def test_split_and_refused_plans_are_drawn(stack, operator, browser):
    """The planner's own answers for a made-up cluster (one stack has one node), drawn by the
    console: a column per node, the head marked, links labelled and the slow one marked; a
    refusal shows each node's room against what one copy needs."""
    from playwright.sync_api import expect

    from apps.deployments import planner as P

    gib = 2**30
    model = P.ModelFacts(
        name="big", n_layers=30, bytes_per_layer=tuple([10 * gib // 30] * 30),
        bytes_embeddings=gib, bytes_output=gib, file_bytes=12 * gib, n_heads=32,
        n_kv_heads=8, head_dim=128, n_embd=4096, n_vocab=32000, n_ff=14336,
    )  # fmt: skip
    cluster = [P.NodeState(f"n{i}", 6 * gib) for i in range(3)]
    links = {("n0", "n1"): P.Link(0.3, 9400.0), ("n0", "n2"): P.Link(6.0, 400.0)}
    pinned = P.Request(4096, 2, split_mode="layer", pin_nodes=("n0", "n1", "n2"))
    split = P.plan(model, pinned, cluster, links).as_dict()
    refused = P.plan(model, P.Request(4096, 2, split_mode="none"), cluster, links).as_dict()
    assert split["kind"] == "split" and refused["kind"] == "refused"
    drawn_nodes = [
        {"name": n.name, "free_bytes": n.free_bytes, "memory_total_bytes": 8 * gib} for n in cluster
    ]
    drawn_links = [
        {"source": a, "target": b, "rtt_ms": lk.rtt_ms, "mbit_s": lk.mbit_s, "slow": P.is_slow(lk)}
        for (a, b), lk in links.items()
    ]

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    log_in(page, stack["url"], operator)
    expect(page.locator("#live")).to_contain_text("Live")
    page.evaluate(
        """([split, refused, nodes, links]) => {
          const out = document.createElement('section');
          out.id = 'drawn';
          for (const p of [split, refused]) {
            const box = LFPlans.picture(p, nodes, links);
            box.dataset.kind = p.kind;
            out.append(box);
          }
          document.querySelector('main').prepend(out);
        }""",
        [split, refused, drawn_nodes, drawn_links],
    )
    picture = page.locator("#drawn [data-kind=split] svg")
    expect(picture.locator(".column")).to_have_count(3)
    expect(picture.locator(".column[data-role=head]")).to_contain_text("★ head")
    head = picture.locator(".column[data-role=head]").get_attribute("data-node")
    assert head == "n0"
    for stage in ("n1", "n2"):  # layers, and bytes stacked per part
        column = picture.locator(f".column[data-node={stage}]")
        expect(column).to_contain_text("layers ")
        expect(column.locator("rect.weights")).to_have_count(1)
    expect(picture.locator("path.link")).to_have_count(2)
    expect(picture.locator("path.link.slow")).to_have_count(1)
    assert picture.locator("path.link.slow").get_attribute("data-link") == "n0-n2"
    expect(picture.locator("text.link-label.slow")).to_have_text("6.00 ms · 400 Mbit/s · slow")
    expect(picture.locator("text.link-label:not(.slow)")).to_have_text("0.30 ms · 9400 Mbit/s")
    no = page.locator("#drawn [data-kind=refused] svg")
    expect(no.locator(".column")).to_have_count(3)
    expect(no.locator("text.short-label")).to_have_count(3)  # each node is short
    assert "Refused plan" in no.get_attribute("aria-label")
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.locator("#drawn").screenshot(path=str(SHOTS / "plans-drawn.png"))


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
    accessible(page, "login")
    page.fill("input[name=username]", operator)
    page.fill("input[name=password]", PASSWORD)
    page.click("button[type=submit]")
    expect(page.locator("#live")).to_contain_text("Live")
    node_row = page.locator("#nodes tbody tr").first
    expect(node_row.locator("td.state")).to_have_text("ready")
    expect(
        page.locator("#deployments tbody tr[data-deployment=smollm2-135m-instruct]")
    ).to_contain_text("ready")
    # Memory stacked by what each deployment holds, in the charts' colours.
    expect(node_row.locator(".stacked .part[data-deployment=smollm2-135m-instruct]")).to_have_count(
        1
    )
    # The charts fill from beat's points (one every 10 s), pushed over the console socket.
    page.wait_for_function(
        "() => LFCharts.points().some(p => p.deployments['smollm2-135m-instruct'])",
        timeout=30_000,
    )
    assert page.evaluate("() => Chart.getChart('chart-replicas').data.datasets.length") >= 1
    accessible(page, "dashboard")
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
    # Drawn: the node's column with the plan's bytes stacked against its free memory.
    column = preview.locator(".plan-svg .column").first
    expect(column.locator("rect.weights")).to_have_count(1)
    expect(column.locator("rect.kv")).to_have_count(1)
    expect(column.locator("rect.free")).to_have_count(1)
    expect(page.locator("#plan-preview .reasons")).to_contain_text("no split")
    page.click("#deploy-form button[type=submit]")
    dep_row = page.locator("#deployments tbody tr[data-deployment=smollm2-copy]")
    expect(dep_row.locator("td.state")).to_have_text("ready", timeout=120_000)
    expect(dep_row.locator(".plan[data-plan-kind=replicas]")).to_contain_text("replicas on")
    expect(dep_row.locator(".plan-svg .column")).to_have_count(1)
    shot(page, "3-deployed")

    # Chat in the playground: Enter sends (Shift+Enter adds a line); the streamed text is the
    # same as llama-cpp-python's, and the answer shows its figures and where it ran.
    page.goto(stack["url"] + "/console/playground/")
    page.evaluate(f"() => localStorage.removeItem('{STORE}')")
    page.reload()
    page.select_option("#model", "smollm2-copy")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "48")
    page.fill("#prompt", "first line")
    page.press("#prompt", "Shift+Enter")
    assert page.input_value("#prompt") == "first line\n" and page.locator(".bubble").count() == 0
    page.fill("#prompt", CHAT[0]["content"])
    page.press("#prompt", "Enter")
    answer = page.locator(".bubble.assistant").last
    expect(answer.locator(".stats")).to_contain_text("tokens/s", timeout=60_000)
    conversation = stored(page)["conversations"][0]
    assert conversation["messages"][1]["content"] == reference_text(CHAT, 48)
    assert answer.locator(".text").inner_text().strip() != ""
    expect(answer.locator(".stats")).to_contain_text("replica")
    expect(answer.locator(".stats")).to_contain_text("prompt tokens cached")
    # Regenerate: the last answer again (greedy: the same text), in place.
    answer.locator("button.regenerate").click()
    expect(page.locator(".bubble.assistant")).to_have_count(1)
    expect(page.locator(".bubble.assistant .stats")).to_contain_text("tokens/s", timeout=60_000)
    assert stored(page)["conversations"][0]["messages"][1]["content"] == reference_text(CHAT, 48)
    # The history is resent each turn: the second turn reuses the first's prompt cache.
    page.fill("#prompt", "And of Italy?")
    page.press("#prompt", "Enter")
    expect(page.locator(".bubble.assistant").last.locator(".stats")).to_contain_text(
        "tokens/s", timeout=60_000
    )
    cached = page.locator(".bubble.assistant").last.locator(".stats").inner_text()
    assert not cached.split(" · ")[3].startswith("0 of"), cached
    # Edit and resend: the question comes back to the box, and what followed it goes.
    page.locator(".bubble.user").last.locator("button.edit").click()
    assert page.input_value("#prompt") == "And of Italy?"
    expect(page.locator(".bubble")).to_have_count(2)
    page.fill("#prompt", "And of Spain?")
    page.press("#prompt", "Enter")
    expect(page.locator(".bubble.user").last).to_have_text("And of Spain?")
    expect(page.locator(".bubble.assistant").last.locator(".stats")).to_contain_text(
        "tokens/s", timeout=60_000
    )
    # Output and input are text, never markup.
    page.fill("#prompt", "Repeat exactly: <img src=x onerror=alert(1)><b>bold</b>")
    page.press("#prompt", "Enter")
    expect(page.locator(".bubble.assistant").last.locator(".stats")).to_contain_text(
        "tokens", timeout=60_000
    )
    assert page.locator(".bubble img, .bubble b").count() == 0
    # Model output with a script and HTML in it (forced by a JSON schema's const): shown as
    # text, and nothing runs.
    page.click("#new-conversation")
    html = "<script>window.xss=1</script><img src=x onerror='window.xss=2'><b>b</b>"
    schema = {"type": "object", "properties": {"html": {"const": html}}, "required": ["html"]}
    page.fill("#schema", json.dumps(schema))
    page.fill("#prompt", "Some HTML, please.")
    page.press("#prompt", "Enter")
    out = page.locator(".bubble.assistant").last
    expect(out.locator(".stats")).to_contain_text("tokens", timeout=60_000)
    assert html in out.locator(".text").inner_text()
    assert page.evaluate("() => window.xss") is None
    assert page.locator(".bubble script, .bubble img, .bubble b").count() == 0
    page.fill("#schema", "")
    page.dispatch_event("#schema", "change")
    # Compare two deployments on the same question, side by side.
    page.select_option("#compare", "smollm2-135m-instruct")
    page.fill("#prompt", CHAT[0]["content"])
    page.press("#prompt", "Enter")
    pair = page.locator(".compare").last
    expect(pair.locator(".bubble.assistant")).to_have_count(2)
    for side in pair.locator(".bubble.assistant").all():
        expect(side.locator(".stats")).to_contain_text("tokens/s", timeout=60_000)
    assert pair.locator(".model").all_inner_texts() == ["smollm2-copy", "smollm2-135m-instruct"]
    shot(page, "4a-compare")
    page.select_option("#compare", "")
    # Stop a long answer.
    page.fill("#max_tokens", "1000")
    page.fill("#prompt", "Write a very long story about a lighthouse.")
    page.press("#prompt", "Enter")
    expect(page.locator(".bubble.assistant").last.locator(".text")).not_to_be_empty(timeout=30_000)
    page.click("#stop")
    expect(page.locator(".bubble.assistant").last.locator(".stats")).to_contain_text("stopped")
    # Conversations survive a reload; markdown from storage renders, with code copied by a
    # button, and a script there does not run either.
    markdown = {
        "title": "markdown",
        "messages": [
            {"role": "user", "content": "code?"},
            {
                "role": "assistant",
                "content": "**Sure**:\n\n```python\nprint(42)\n```\n<script>window.xss=3</script>",
            },
        ],
    }
    page.evaluate(
        "([key, c]) => { const s = JSON.parse(localStorage.getItem(key));"
        " s.conversations.push(c); localStorage.setItem(key, JSON.stringify(s)); }",
        [STORE, markdown],
    )
    page.reload()
    expect(page.locator("#conversations li")).to_have_count(3)
    expect(page.locator(".bubble.user")).to_have_count(3)  # the one open before the reload
    page.locator("#conversations a", has_text="markdown").click()
    code = page.locator(".bubble.assistant pre code")
    expect(code).to_contain_text("print(42)")
    expect(page.locator(".bubble.assistant strong")).to_have_text("Sure")
    page.locator(".bubble.assistant pre button.copy").click()
    expect(page.locator(".bubble.assistant pre button.copy")).to_have_text("Copied")
    assert page.evaluate("() => window.xss") is None
    accessible(page, "playground")
    shot(page, "4-playground")
    # A new conversation starts empty; the others are kept.
    page.click("#new-conversation")
    expect(page.locator(".bubble")).to_have_count(0)
    page.locator("#conversations a").first.click()
    expect(page.locator(".bubble.user")).to_have_count(3)

    # The charts show the traffic: tokens per second above zero for the deployment.
    page.goto(stack["url"] + "/console/")
    page.wait_for_function(
        "() => LFCharts.points().some(p => (p.deployments['smollm2-copy'] || {}).tokens_per_s > 0)",
        timeout=30_000,
    )
    page.wait_for_function(
        "() => LFCharts.points().some(p => (p.deployments['smollm2-copy'] || {}).ttft_p50_ms > 0)",
        timeout=30_000,
    )
    # Applications: the console's own usage (no key) shows with its day of tokens.
    console_use = page.locator("#keys tr[data-key='']")
    expect(console_use).to_contain_text("console, no key")
    expect(console_use.locator(".usage .hint")).not_to_have_text(re.compile(r"^0 tokens"))
    shot(page, "4b-charts")

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
