"""harness/chaos.py's command line: its parser is rl_loop's, so it lists --async and
--serving-fraction, but ChaosLoop runs rounds (sync mode) only: both are refused with
argparse's exit status 2 and what to do, before any daemon or engine is started."""

from __future__ import annotations

import pytest

from vime.harness import chaos

BASE = ["--model", "m", "--socket", "s"]


@pytest.mark.parametrize("flags, says", [
    (["--async"], "--async: the chaos loop injects its faults around rounds (sync mode) only"),
    (["--serving-fraction", "0.5"], "--serving-fraction sets the waves of --async"),
    (["--async", "--serving-fraction", "0.5"], "--async: the chaos loop"),
])
def test_async_flags_are_refused_with_exit_status_2(flags, says, capsys):
    with pytest.raises(SystemExit) as e:
        chaos.main(BASE + ["--kill-at", "2"] + flags)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_a_sync_command_line_passes_the_checks():
    ap = chaos.build_parser()
    args = ap.parse_args(BASE + ["--kill-at", "2", "--serving-fraction", "0"])
    chaos.check_args(ap, args)  # raises SystemExit on a refusal
    assert not args.async_ and args.serving_fraction == 0
