"""trainer/rl_loop.py's --load-debug-rollout-data check: a dump missing, unreadable, empty or
with a header load_rollout refuses, for any round, is refused in one line (exit 2) with what to
pass, before the model is loaded or any daemon is asked; so is a --save-debug-rollout-data
template the first save would refuse. Called through main(argv), as the --model refusals are
(test_rl_loop_model_flag.py): a subprocess would spend its seconds importing torch."""

from __future__ import annotations

import os

import pytest

from vime.trainer import rl_loop
from vime.trainer.dumps import DumpFormatError, load_rollout, save_rollout

WHAT_TO_DO = ("; pass the template --save-debug-rollout-data wrote ({rollout_id} is the round, 1 to "
              "--num-rollout), or lower --num-rollout to the rounds saved\n")


def run(tmp_path, capsys, template: str, *flags: str) -> tuple[int, str]:
    # config.json "{}" passes --model's check but is no model: had the loop gone on to load it,
    # the error would be another one than the dump's.
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    rc = rl_loop.main(["--model", str(model), "--load-debug-rollout-data", template,
                       "--out", str(tmp_path / "o"), *flags])
    return rc, capsys.readouterr().err


def test_a_dump_folder_that_does_not_exist_is_refused_before_the_model_loads(tmp_path, capsys):
    template = str(tmp_path / "nowhere" / "r_{rollout_id}.jsonl")
    rc, err = run(tmp_path, capsys, template, "--debug-train-only", "--num-rollout", "3")
    assert rc == 2, err
    assert err == (f"rl_loop: --load-debug-rollout-data {template}: {tmp_path}/nowhere/r_1.jsonl: "
                   f"no folder {tmp_path}/nowhere (round 1 of 3; later rounds not checked)" + WHAT_TO_DO)
    assert not (tmp_path / "o" / "summary.json").exists()


def test_the_first_missing_round_is_named_and_comes_before_the_daemon_is_asked(tmp_path, capsys):
    template = str(tmp_path / "r_{rollout_id}.jsonl")
    save_rollout(template, 1, [])
    save_rollout(template, 3, [])
    # Replay with live engines: no daemon at --socket, and the dump is what is refused.
    rc, err = run(tmp_path, capsys, template, "--num-rollout", "3", "--socket", str(tmp_path / "none.sock"))
    assert rc == 2, err
    assert err == (f"rl_loop: --load-debug-rollout-data {template}: {tmp_path}/r_2.jsonl: no such file "
                   f"(round 2 of 3; later rounds not checked)" + WHAT_TO_DO)


def test_a_folder_where_a_dump_should_be_is_refused(tmp_path, capsys):
    (tmp_path / "r_1.jsonl").mkdir()
    template = str(tmp_path / "r_{rollout_id}.jsonl")
    rc, err = run(tmp_path, capsys, template, "--debug-train-only", "--num-rollout", "1")
    assert rc == 2, err
    assert err == f"rl_loop: --load-debug-rollout-data {template}: {tmp_path}/r_1.jsonl: not a file" + WHAT_TO_DO


def test_a_template_without_rollout_id_is_refused_before_the_model_loads(tmp_path, capsys):
    template = str(tmp_path / "r.jsonl")
    rc, err = run(tmp_path, capsys, template, "--debug-train-only")
    assert rc == 2, err
    assert err == (f"rl_loop: --load-debug-rollout-data {template}: dump path template {template!r} must contain "
                   "{rollout_id} (e.g. 'dumps/rollout_{rollout_id}.jsonl'), each round reads its own dump\n")


@pytest.mark.parametrize("content", ["", "\n\n", "not json\n", '{"format": "other"}\n'])
def test_an_empty_or_corrupt_dump_is_refused_with_load_rollouts_words_before_the_model_loads(tmp_path, capsys,
                                                                                              content):
    template = str(tmp_path / "r_{rollout_id}.jsonl")
    save_rollout(template, 1, [])
    (tmp_path / "r_2.jsonl").write_text(content)
    save_rollout(template, 3, [])
    with pytest.raises(DumpFormatError) as loading:
        load_rollout(tmp_path / "r_2.jsonl")
    rc, err = run(tmp_path, capsys, template, "--debug-train-only", "--num-rollout", "3")
    assert rc == 2, err
    assert err == (f"rl_loop: --load-debug-rollout-data {template}: {loading.value} "
                   f"(round 2 of 3; later rounds not checked)" + WHAT_TO_DO)


@pytest.mark.parametrize("save, found", [
    ("s.jsonl", "must contain {rollout_id} (e.g. 'dumps/rollout_{rollout_id}.jsonl'), or every round overwrites the last"),
    ("s_{rollout_id}_{}.jsonl", ": only {rollout_id} may be used (not {}); write a literal brace as '{{' or '}}'"),
    ("s_{rollout_id}_{step}.jsonl", ": only {rollout_id} may be used (not {step}); write a literal brace as '{{' or '}}'"),
    ("s_{rollout_id}_}.jsonl", ": only {rollout_id} may be used (Single '}' encountered in format string); "
                               "write a literal brace as '{{' or '}}'"),
])
def test_a_save_template_the_first_save_would_refuse_is_refused_before_the_model_loads(tmp_path, capsys, save, found):
    template = str(tmp_path / "r_{rollout_id}.jsonl")
    save_rollout(template, 1, [])
    save = str(tmp_path / save)
    rc, err = run(tmp_path, capsys, template, "--num-rollout", "1", "--save-debug-rollout-data", save,
                  "--socket", str(tmp_path / "none.sock"))
    assert rc == 2, err
    assert err.startswith(f"rl_loop: --save-debug-rollout-data {save}: dump path template {save!r}")
    assert err.endswith(found + "\n") and err.count("\n") == 1
    with pytest.raises(ValueError) as saving:  # the first save's own refusal, word for word
        save_rollout(save, 1, [])
    assert err == f"rl_loop: --save-debug-rollout-data {save}: {saving.value}\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_an_unreadable_dump_is_refused(tmp_path):
    (tmp_path / "r_1.jsonl").write_text("")
    (tmp_path / "r_1.jsonl").chmod(0)
    why = rl_loop.check_dumps(str(tmp_path / "r_{rollout_id}.jsonl"), 1)
    assert why is not None and f"{tmp_path}/r_1.jsonl: not readable (permissions);" in why


def test_every_round_readable_passes(tmp_path):
    for step in (1, 2):
        save_rollout(tmp_path / "r_{rollout_id}.jsonl", step, [])
    assert rl_loop.check_dumps(str(tmp_path / "r_{rollout_id}.jsonl"), 2) is None
