"""Which run id ``record`` gives a run, and which folders it joins (the nodes of one multi-node run)."""

import json

import pytest

from tensor_trace.cli.record import launcher_run_id
from tensor_trace.errors import BadInput
from tensor_trace.tracer.launch import prepare_out_dir


@pytest.mark.parametrize("cmd, env, expected", [
    (["torchrun", "--rdzv-id", "job42", "x.py"], None, "job42"),
    (["torchrun", "--rdzv_id=job7", "x.py"], "exported", "job7"),
    (["torchrun", "x.py"], "exported", "exported"),
    (["torchrun", "--rdzv-id", "none", "x.py"], None, None),
    (["python", "x.py"], "none", None),
    (["python", "x.py"], None, None),
])
def test_launcher_run_id(monkeypatch, cmd, env, expected):
    if env is None:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    else:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", env)
    assert launcher_run_id(cmd) == expected


def test_a_folder_of_the_same_run_is_joined_another_refused(tmp_path):
    d = tmp_path / "t"
    prepare_out_dir(str(d), replace=False, run_id="job42")
    (d / "run.json").write_text(json.dumps(dict(run_id="job42")))
    (d / "ranks" / "node0-1.ttr").write_bytes(b"x")
    prepare_out_dir(str(d), replace=False, run_id="job42")
    assert (d / "ranks" / "node0-1.ttr").exists()
    for other in ("job7", None):
        with pytest.raises(BadInput, match="already holds a recorded run"):
            prepare_out_dir(str(d), replace=False, run_id=other)
    prepare_out_dir(str(d), replace=True, run_id="job42")
    assert not (d / "run.json").exists() and not list((d / "ranks").iterdir())


def test_an_unreadable_run_file_is_no_run_id_and_is_said(tmp_path):
    from tensor_trace import schema

    said = []
    assert schema.read_run_id(str(tmp_path), said.append) is None and said == []  # no file: nothing to say
    (tmp_path / "run.json").write_text("{not json")
    assert schema.read_run_id(str(tmp_path), said.append) is None
    assert len(said) == 1 and "run.json is unreadable" in said[0]
    (tmp_path / "run.json").write_text('{"run_id": "job7"}')
    assert schema.read_run_id(str(tmp_path)) == "job7"
