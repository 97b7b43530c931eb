import pytest

from tensor_trace.tracer.config import TraceConfig, parse_steps


def test_parse_steps():
    assert parse_steps("2:10") == (2, 10)
    assert parse_steps(":5") == (0, 5)
    assert parse_steps("3:") == (3, None)
    assert parse_steps(None) == (0, None)
    for bad in ("x", "5:2", "1:1", "1-2"):
        with pytest.raises(ValueError):
            parse_steps(bad)


def test_env_round_trip(tmp_path):
    cfg = TraceConfig(out_dir=str(tmp_path), run_id="abc", modules=["model.*"], exclude=["*.act_fn"],
                      steps=(1, 4), fingerprint=False, lineage_every=5)
    back = TraceConfig.from_env(cfg.to_env())
    assert back.run_id == "abc" and back.steps == (1, 4) and not back.fingerprint
    assert back.lineage_every == 5 and TraceConfig().lineage_every == 128
    assert back.modules == ["model.*"] and back.exclude == ["*.act_fn"]
    assert [back.in_window(s) for s in range(6)] == [False, True, True, True, False, False]
    sel = back.module_selector()
    assert sel("model.layers.0") and not sel("model.layers.0.mlp.act_fn") and not sel("lm_head")


def test_tracer_never_imports_exporters():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "tracer"
    files = list(root.rglob("*.py"))
    assert len(files) > 5
    for f in files:
        assert not re.search(r"^\s*(from|import)\s+\S*exporters", f.read_text(), re.M), f


def test_record_lineage_every_option(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from tensor_trace.cli import main
    from tensor_trace.tracer import launch

    got = {}
    monkeypatch.setattr(launch, "run_traced", lambda cmd, config: got.setdefault("cfg", config) and 0)
    out = str(tmp_path / "t")
    r = CliRunner().invoke(main, ["record", "-o", out, "--lineage-every", "4", "--", "true"])
    assert got["cfg"].lineage_every == 4, r.output
    r = CliRunner().invoke(main, ["record", "-o", out, "--replace", "--lineage-every", "0", "--", "true"])
    assert r.exit_code == 2 and "lineage-every" in r.output
    assert got["cfg"].intercept == "call"  # the default
    got.clear()
    r = CliRunner().invoke(main, ["record", "-o", out, "--replace", "--intercept", "hooks", "--", "true"])
    assert got["cfg"].intercept == "hooks", r.output
    assert TraceConfig.from_env(got["cfg"].to_env()).intercept == "hooks"


def test_record_fingerprint_every_option(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from tensor_trace.cli import main
    from tensor_trace.tracer import launch

    got = {}
    monkeypatch.setattr(launch, "run_traced", lambda cmd, config: got.setdefault("cfg", config) and 0)
    out = str(tmp_path / "t")
    r = CliRunner().invoke(main, ["record", "-o", out, "--", "true"])
    assert got["cfg"].fingerprint_every == TraceConfig().fingerprint_every == 8, r.output
    got.clear()
    r = CliRunner().invoke(main, ["record", "-o", out, "--replace", "--fingerprint-every", "1", "--", "true"])
    assert got["cfg"].fingerprint_every == 1, r.output
    assert TraceConfig.from_env(got["cfg"].to_env()).fingerprint_every == 1
    r = CliRunner().invoke(main, ["record", "-o", out, "--replace", "--fingerprint-every", "0", "--", "true"])
    assert r.exit_code == 2 and "fingerprint-every" in r.output
