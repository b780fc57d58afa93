"""`diffusion-rl report` also writes report.html: its structure (read with html.parser) and one headless render."""

from __future__ import annotations

import base64
import io
import json
import logging
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
from PIL import Image

from diffusion_rl.cli import main
from diffusion_rl.evaluation.html_report import SECTIONS

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class Page(HTMLParser):
    """The parts of the page the tests look at: sections, nav links, images, table rows, text per section."""

    def __init__(self):
        super().__init__()
        self.sections: list[str] = []
        self.nav: list[str] = []
        self.images: list[dict[str, str]] = []  # attrs + the section they are in
        self.rows: dict[str, int] = {}  # section -> <tr> count
        self.text: dict[str, str] = {}
        self.external: list[str] = []  # any src/href that would need the network or another file
        self._section = ""
        self._in_nav = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self._section = attrs["id"]
            self.sections.append(self._section)
        if tag == "nav":
            self._in_nav = True
        if tag == "a" and self._in_nav:
            self.nav.append(attrs["href"])
        if tag == "img":
            self.images.append({**attrs, "section": self._section})
        if tag == "tr":
            self.rows[self._section] = self.rows.get(self._section, 0) + 1
        for key in ("src", "href"):
            value = attrs.get(key)
            if value and not (value.startswith("data:") or value.startswith("#")):
                self.external.append(value)
        if tag in ("link", "script"):
            self.external.append(tag)

    def handle_endtag(self, tag):
        if tag == "nav":
            self._in_nav = False

    def handle_data(self, data):
        self.text[self._section] = self.text.get(self._section, "") + data


def _parse(path) -> Page:
    page = Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def _png(data_uri: str) -> Image.Image:
    assert data_uri.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(data_uri.partition(",")[2])))


@pytest.fixture
def reported_run(trained_run, caplog):
    """A 2-step run validated at steps 0, 1, 2 with rollouts dumped every step, and its report."""
    run = trained_run("val.every=1", "val.before_train=true", "val.n=2", "log.rollout_every=1").run_dir
    with caplog.at_level(logging.INFO, logger="diffusion_rl"):
        assert main(["report", str(run)]) == 0
    assert f"wrote {run / 'report' / 'report.html'} (one page" in caplog.text  # the page a person opens, named
    return run


def test_report_html_is_one_self_contained_page_with_every_section(reported_run):
    page = _parse(reported_run / "report" / "report.html")
    assert page.sections == [anchor for anchor, _, _ in SECTIONS]
    assert page.nav == [f"#{anchor}" for anchor, _, _ in SECTIONS]
    assert page.external == []  # no server, no network, no sibling files
    for image in page.images:
        assert _png(image["src"]).size[0] > 0 and image["alt"]
    sections_with_plots = {i["section"] for i in page.images if i["class"] == "plot"}
    assert {"rewards", "guard", "policy", "timing"} <= sections_with_plots
    assert "run:" in page.text["config"] and "timing" in page.sections


def test_validation_images_of_each_prompt_sit_side_by_side_across_steps(reported_run):
    page = _parse(reported_run / "report" / "report.html")
    tiles = [i for i in page.images if i["section"] == "validation"]
    n_prompts = len(json.loads((reported_run / "samples" / "step_000000" / "index.json").read_text())) // 2
    assert page.rows["validation"] == 1 + n_prompts  # header + one row per prompt
    assert len(tiles) == n_prompts * 3 * 2  # 3 validated steps × val.n = 2
    assert [t["alt"] for t in tiles[:6]] == [f"step {s}, sample {k}" for s in (0, 1, 2) for k in (0, 1)]
    assert "step 0" in page.text["validation"] and "step 2" in page.text["validation"]


def test_rollouts_show_reward_and_advantage_as_text(reported_run):
    page = _parse(reported_run / "report" / "report.html")
    rows = [
        json.loads(x) for x in (reported_run / "rollouts" / "step_000002" / "rollout.jsonl").read_text().splitlines()
    ]
    text = page.text["rollouts"]
    assert "Step 1" in text and "Step 2" in text
    for row in rows:
        assert f"A {row['advantage']:+.2f}" in text


def test_guard_alerts_appear_in_the_page_and_in_report_md(reported_run):
    # an alert as the guard writes it (the real run in tests/trainer/test_guard_hacking.py makes one for real)
    alert = {"step": 2, "stat": "brightness", "value": 0.1, "baseline": 0.4, "rule": "relative_change",
             "threshold": 0.22, "message": "guard: brightness at step 2 is 0.1", "act": True}  # fmt: skip
    (reported_run / "guard" / "alerts.jsonl").write_text(json.dumps(alert) + "\n")
    assert main(["report", str(reported_run)]) == 0
    page = _parse(reported_run / "report" / "report.html")
    assert "first: brightness at step 2" in page.text["summary"]
    assert page.rows["guard"] >= 2 and "relative_change" in page.text["guard"]
    md = (reported_run / "report" / "report.md").read_text()
    assert "## Guard alerts" in md and re.search(r"\| brightness +\| 1 +\| 2 +\| 2 ", md)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (Debian: apt-get install chromium)")
def test_report_renders_in_headless_chromium(reported_run, tmp_path):
    shot = tmp_path / "report.png"
    html = reported_run / "report" / "report.html"
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1280,2400",
               f"--screenshot={shot}", html.as_uri()]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=180)
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 2400)
    colours = image.resize((64, 120)).getcolors(64 * 120)
    assert colours is not None and len(colours) > 50  # plots and images drawn, not a blank page


def test_alert_summary_groups_alerts_by_statistic():
    from diffusion_rl.evaluation.html_report import alert_summary

    alerts = [
        {"step": 5, "stat": "brightness", "value": 0.2, "baseline": 0.4, "rule": "relative_change"},
        {"step": 6, "stat": "val_drift", "value": 0.3, "baseline": None, "rule": "max"},
        {"step": 7, "stat": "brightness", "value": 0.05, "baseline": 0.4, "rule": "relative_change"},
        {"step": 9, "stat": "brightness", "value": 0.1, "baseline": 0.4, "rule": "relative_change"},
    ]
    summary = alert_summary(alerts)
    assert [(r["stat"], r["alerts"], r["first"], r["last"], r["furthest"]) for r in summary] == [
        ("brightness", 3, 5, 9, 0.05),
        ("val_drift", 1, 6, 6, 0.3),
    ]


def test_a_damaged_alert_or_rollout_line_is_skipped_with_a_warning(tmp_path, caplog):
    from diffusion_rl.evaluation.html_report import load_guard_files
    from diffusion_rl.utils.json_input import json_lines

    (tmp_path / "guard").mkdir()
    good = {"step": 3, "stat": "brightness", "value": 0.1, "baseline": 0.5, "rule": "relative", "threshold": 0.2}
    (tmp_path / "guard" / "alerts.jsonl").write_text(json.dumps(good) + '\n{"step": [[[\n{"stat": "x"}\n')
    with caplog.at_level(logging.WARNING):
        assert load_guard_files(tmp_path) == (None, [good])
    assert "alerts.jsonl:2 and 1 more: not a JSON object with step, stat, value, baseline, rule" in caplog.text
    (tmp_path / "rollout.jsonl").write_bytes(b'{"group": 0}\n\xff\n')
    assert [row for _, row in json_lines(tmp_path / "rollout.jsonl", ("group",))] == [{"group": 0}, None]
