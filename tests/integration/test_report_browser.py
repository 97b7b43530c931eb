"""`tensor-trace report` on a real traced run of the example (torchrun, 2 ranks, gloo), opened in
headless Chromium with networking disabled: the placement map has one row per layer coloured by
placement, a known point shows its verdict, and --compare frames the first divergence.

Chromium is Debian's `chromium` package; when it is missing the test installs it with apt-get
and is skipped, saying why, where that cannot be done."""

import html.parser
import os
import re
import shutil
import subprocess

import pytest

from tt_helpers import LAYERS, SMALL_MODEL, TORCHRUN, TP_LLAMA, record_distributed, tt

pytestmark = pytest.mark.timeout(900)
# A proxy that nobody answers: any request the page made would fail (and the page asks for none).
NO_NETWORK = ["--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>"]


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("chromium is not installed and apt-get cannot install it here (not Debian, or not root)")
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                               env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
        except subprocess.TimeoutExpired:
            pytest.skip(f"{' '.join(cmd)} took more than 600 s")
        if r.returncode != 0:
            pytest.skip(f"could not install chromium ({' '.join(cmd)}: {r.stderr.strip()[-300:]})")
    found = shutil.which("chromium")
    if not found:
        pytest.skip("apt-get installed chromium but it is not on PATH")
    return found


def headless(page, tmp_path, *mode) -> subprocess.CompletedProcess:
    """Run Chromium on ``page`` (a file) with networking disabled; ``mode``: --dump-dom or
    --screenshot=PATH. Its own profile folder, so that parallel runs do not share one."""
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", *NO_NETWORK,
           f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1400,1000", *mode,
           f"file://{page}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


class Dom(html.parser.HTMLParser):
    """The map's rows and every element carrying a point, from Chromium's DOM after the script ran."""

    def __init__(self):
        super().__init__()
        self.rows = []  # (stack, layer, [cell attrs])
        self.points = {}  # point -> attrs
        self.ids = set()
        self.body = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "body":
            self.body = a
        if tag == "tr" and "layer" in (a.get("class") or "").split():
            self.rows.append((a["data-stack"], int(a["data-layer"]), []))
        if tag == "td" and self.rows and "cell" in (a.get("class") or ""):
            self.rows[-1][2].append(a)
        if "data-point" in a:
            self.points[a["data-point"]] = a


def dom_of(page, tmp_path) -> Dom:
    dom = Dom()
    dom.feed(headless(page, tmp_path, "--dump-dom").stdout)
    assert dom.body.get("data-rendered") == "true", "the page's script did not finish"
    return dom


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("report")
    out = {}
    for name, extra in (("clean", []), ("double", ["--bug-double-reduce", "1"])):
        cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", TP_LLAMA, *SMALL_MODEL, "--steps", "3", *extra]
        record_distributed(d / name, cmd, timeout=240)
        out[name] = d / name
    return out


def test_report_renders_the_placement_map_offline(runs, tmp_path):
    page = tmp_path / "report.html"
    r = tt("report", "--trace", str(runs["clean"]), "-o", str(page))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"wrote {page} (") and f"{LAYERS} layers" in r.stdout
    assert r.stderr == ""  # not a terminal: no progress lines
    text = page.read_text()
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", text), "the page must fetch nothing"
    dom = dom_of(page, tmp_path)
    assert [(stack, layer) for stack, layer, _ in dom.rows] == [("model.layers", i) for i in range(LAYERS)]
    for _, layer, cells in dom.rows:
        by_point = {c["data-point"]: c for c in cells if "data-point" in c}
        qkv = by_point[f"model.layers.{layer}.self_attn.qkv_proj:output"]
        o_proj = by_point[f"model.layers.{layer}.self_attn.o_proj:output"]
        assert "pl-shard" in qkv["class"].split() and qkv["data-placement"] == "shard(2)"
        assert "pl-replicate" in o_proj["class"].split() and "post" in o_proj["class"].split()
        assert all(c["class"].split()[1].startswith("pl-") for c in cells if "data-point" in c)
    embed = dom.points["model.embed_tokens:output"]  # outside the layers
    assert (embed["data-placement"], embed["data-reduction"]) == ("replicate", "post-reduction")
    assert "equals the output of all_reduce(sum) #0" in embed["title"]
    assert not any("first-divergence" in a["class"].split() for a in dom.points.values())


def test_report_frames_the_first_divergence(runs, tmp_path):
    page = tmp_path / "compare.html"
    r = tt("report", "--trace", str(runs["clean"]), "--compare", str(runs["double"]), "-o", str(page), "--quiet")
    assert r.returncode == 0, r.stderr
    dom = dom_of(page, tmp_path)
    first = dom.points["model.layers.1.self_attn.o_proj:output"]
    assert "first-divergence" in first["class"].split() and "differs" in first["class"].split()
    assert "first-divergence" in dom.ids and "compare-section" in dom.ids
    assert not any("differs" in a["class"].split() for p, a in dom.points.items() if p.startswith("model.layers.0."))


def test_screenshot(runs, tmp_path):
    page = tmp_path / "report.html"
    assert tt("report", "--trace", str(runs["clean"]), "-o", str(page)).returncode == 0
    png = tmp_path / "report.png"
    headless(page, tmp_path, f"--screenshot={png}")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
