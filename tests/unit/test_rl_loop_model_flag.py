"""trainer/rl_loop.py's --model check: refused in one line (exit 2) with what to pass, before
anything is loaded or any daemon is asked. The daemon's mode check: tests/daemon/test_rl_loop_mode_refusal.py."""

from __future__ import annotations

import pytest

from vime.trainer import rl_loop


@pytest.mark.parametrize("name, says", [
    ("nonexistent", "no such directory"),
    ("a-file", "not a directory"),
    ("", "not a model directory (no config.json in it)"),
])
def test_a_model_that_is_not_a_model_directory_is_refused_in_one_line(tmp_path, capsys, name, says):
    (tmp_path / "a-file").write_text("x")
    model = tmp_path / name if name else tmp_path
    # No daemon at this socket: the model is refused before any daemon is asked.
    rc = rl_loop.main(["--model", str(model), "--socket", str(tmp_path / "none.sock"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err == (f"rl_loop: --model {model}: {says}; pass the policy's model directory, a Hugging Face "
                   "save_pretrained folder (python -m vime.trainer.tiny_model DIR builds a tiny one)\n")


def test_a_folder_with_a_config_json_passes(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert rl_loop.check_model(str(tmp_path)) is None
