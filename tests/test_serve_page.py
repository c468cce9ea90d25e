"""The chat page (``GET /``) in a real headless browser: Debian's chromium driven by Playwright's Python API.

Skipped, with the reason shown in pytest's summary, when Playwright or the browser is missing or cannot start
(``.ci/run`` installs chromium). A screenshot is kept in tests/artifacts/serve_page.png.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import torch
from conftest import make_model
from serve_helpers import ThreadServer

from fullband.data.tokenizers import ByteTokenizer
from fullband.loading import load_model
from fullband.storage import load_pretrained

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).parent / "artifacts"
MODES = ("standard", "soft", "fused")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    executable = CHROMIUM if Path(CHROMIUM).is_file() else shutil.which("chromium")
    if executable is None:
        pytest.skip(f"no browser: {CHROMIUM} is missing (apt-get install -y chromium)")
    with sync_api.sync_playwright() as playwright:
        try:
            browser = playwright.chromium.launch(executable_path=executable, args=FLAGS, headless=True)
        except Exception as exc:  # Playwright reports a failed launch with its own error types
            pytest.skip(f"chromium could not be launched: {str(exc).splitlines()[0]}")
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server():
    tokenizer = ByteTokenizer(chat=True)
    model = make_model(seed=8, dtype=torch.float64, vocab_size=tokenizer.vocab_size, d_model=48, max_seq_len=256)
    srv = ThreadServer(model, tokenizer, "tiny")
    yield srv
    srv.close()


def api_text(server: ThreadServer, prompt: str, mode: str, max_tokens: int, passes: int | str = 1) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "decode_mode": mode,
            "fused_passes": passes}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]


def test_page_streams_three_modes_side_by_side(browser, server, single_thread):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(server.url + "/")
    page.wait_for_selector("body[data-state=ready]", timeout=30_000)
    assert "tiny" in page.inner_text("#model-info")

    prompt = "def add(a, b):"
    page.fill("#prompt", prompt)
    page.fill("#max-tokens", "40")
    page.click("#send")
    page.wait_for_selector("body[data-state=done]", timeout=60_000)
    for mode in MODES:
        column = page.locator(f"#col-{mode}")
        assert column.get_attribute("data-done") == "true", column.inner_text()
        # What the page shows is what the API answers for that mode (greedy).
        assert page.locator(f".answer[data-mode={mode}]").text_content() == api_text(server, prompt, mode, 40)
        stats = column.locator(".stats").inner_text()
        assert "tok/s" in stats and "finish:" in stats, stats

    # The fused column with the adaptive prefill: the page sends "auto" as the API takes it.
    page.fill("#fused-passes", "auto")
    page.click("#send")
    page.wait_for_selector("body[data-state=done]", timeout=60_000)
    auto = api_text(server, prompt, "fused", 40, "auto")
    assert auto != api_text(server, prompt, "fused", 40, 1)  # so a page that dropped "auto" would be caught
    assert page.locator(".answer[data-mode=fused]").text_content() == auto

    # Chat: each column keeps its own conversation.
    page.check("#kind-chat")
    page.fill("#prompt", "Say hi.")
    page.click("#send")
    page.wait_for_selector("body[data-state=done]", timeout=60_000)
    for mode in MODES:
        column = page.locator(f"#col-{mode}")
        assert column.get_attribute("data-done") == "true", column.inner_text()
        assert column.locator(".turn.user").count() == 1 and column.locator(".turn.assistant").count() == 1
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "serve_page.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")
    page.close()


# ---- what the modes mean: the model's default mode, and a note where the fusion was never trained ----------------


def trained_model(tmp_path: Path, schedule: str):
    """A tiny model and its tokenizer, trained for 2 steps with ``schedule``, loaded from its run as serve loads it."""
    from test_train import steps_of, tiny_config

    from fullband.train import train

    run = tmp_path / f"run-{schedule}"
    train(tiny_config(train={"tokens": steps_of(2), "schedule": schedule}), run)
    return load_model(run, "cpu")


def converted_model(tmp_path: Path):
    """A tiny random Llama converted by fullband convert: its fusion has never been trained."""
    transformers = pytest.importorskip("transformers", reason="converting needs the hf extra")
    from fullband.hf import convert_from_hf

    tokenizer = ByteTokenizer(chat=True)
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    llama.save_pretrained(tmp_path / "llama")
    return load_pretrained(convert_from_hf(tmp_path / "llama", tmp_path / "converted")).eval(), tokenizer


def column_marks(page) -> dict[str, tuple[bool, bool]]:
    """{mode: (marked as the model's default, shows the untrained-fusion note)}, as a person sees them."""
    return {mode: (page.locator(f"#col-{mode} .default-mark").is_visible(),
                   page.locator(f"#col-{mode} .mode-note").is_visible()) for mode in MODES}


@pytest.mark.parametrize("source, default, fusion_trained", [
    ("convert", "standard", False),
    ("standard", "standard", False),
    ("feedback-from-start", "soft", True),
    ("exact", "fused", True),
])
def test_page_says_what_the_modes_mean(browser, tmp_path, single_thread, source, default, fusion_trained):
    if source == "convert":
        model, tokenizer = converted_model(tmp_path)
    elif source == "exact":  # the exact schedule trains on isolated documents (prompt/answer records)
        from test_train import steps_of, tiny_config

        from fullband.train import train

        run = tmp_path / "run-exact"
        train(tiny_config(data={"source": "synthetic:parity", "format": "prompt_answer"},
                          train={"tokens": steps_of(2), "schedule": "exact"}), run)
        model, tokenizer = load_model(run, "cpu")
    else:
        model, tokenizer = trained_model(tmp_path, source)
    server = ThreadServer(model, tokenizer, f"tiny-{source}")
    try:
        health = server.health()
        assert (health["model_decode_mode"], health["fusion_trained"]) == (default, fusion_trained)
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(server.url + "/")
        page.wait_for_selector("body[data-state=ready]", timeout=30_000)
        marks = column_marks(page)
        assert {mode for mode, (marked, _) in marks.items() if marked} == {default}
        assert page.locator(f"#col-{default}").get_attribute("data-default") == "true"
        noted = {mode for mode, (_, note) in marks.items() if note}
        assert noted == (set() if fusion_trained else {"soft", "fused"})
        if not fusion_trained:
            note = page.locator("#col-soft .mode-note").inner_text()
            assert "not meaningful yet" in note.lower() and "never trained" in note, note
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / f"serve_page_{source}.png"), full_page=True)
        page.close()
    finally:
        server.close()
