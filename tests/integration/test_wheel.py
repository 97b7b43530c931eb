"""The wheel holds every package under the tensor_trace namespace, and nothing else at top level."""

import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODULES = ["tensor_trace.schema", "tensor_trace.cli", "tensor_trace.cli.record", "tensor_trace.cli.query",
           "tensor_trace.cli.merge", "tensor_trace.tracer.core", "tensor_trace.tracer.collectives",
           "tensor_trace.tracer.launch", "tensor_trace.tracer.env_start", "tensor_trace.exporters.store.merge",
           "tensor_trace.exporters.analysis", "tensor_trace.exporters.analysis.lineage", "tensor_trace.exporters.query", "tensor_trace.exporters.formats.summary",
           "tensor_trace.exporters.formats.otlp", "tensor_trace.exporters.pipeline", "tensor_trace.format.points",
           "tensor_trace.tracer.integrations", "tensor_trace.tracer.live_otlp",
           "tensor_trace.api", "tensor_trace.progress", "tensor_trace.exporters.formats.report"]


def test_wheel_installs_and_imports(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), ROOT], check=True, timeout=300)
    (wheel,) = [f for f in os.listdir(dist) if f.endswith(".whl")]
    names = zipfile.ZipFile(dist / wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"tensor_trace"}, tops  # never a top-level "tracer" or "exporters"
    assert "tensor_trace/tracer/bootstrap/sitecustomize.py" in names
    assert "tensor_trace/exporters/formats/report.html" in names  # the report's page template
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(dist / wheel)], check=True, timeout=300)
    code = ("import importlib, sys\n"
            f"mods = {MODULES!r}\n"
            "for m in mods:\n"
            "    mod = importlib.import_module(m)\n"
            f"    assert mod.__file__.startswith({str(target)!r}), (m, mod.__file__)\n"
            "print('ok', len(mods))\n")
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr
    cli = subprocess.run([sys.executable, "-m", "tensor_trace", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and "record" in cli.stdout and "query" in cli.stdout
