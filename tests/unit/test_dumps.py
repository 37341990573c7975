"""vime.trainer.dumps: rollout dumps round-trip, and a replay rebuilds the same training batch."""

from __future__ import annotations

import json

import pytest
import torch

from vime.trainer.dumps import (
    FORMAT, FORMAT_VERSION, DumpFormatError, Sample, batch_differences, build_training_batch,
    dump_path, load_rollout, save_rollout,
)

ODD = "héllo → 世界 🙂\t\"quoted\" \\back\\ {braces} \r\n new\u2028line\u0000nul \ud800 end"


def make_samples() -> list[Sample]:
    # Two groups of prompts (3 + 2 samples), one sample with an odd text, logprobs that are not
    # round numbers in binary, a -inf logprob, different lengths (so padding happens).
    return [
        Sample("the quick brown fox", " jumps over", [5, 6, 7, 8], [9, 10], [-0.1, -2.3025850929940455],
               reward=1.0, engine="engine-0", finish_reason="length",
               timings={"sent": 1718000000.125, "first_token": 1718000000.5, "finished": 1718000001.0},
               weight_version=3, metadata={"idx": 0, "lang": "héllo → 世界 🙂"}),
        Sample("the quick brown fox", " sleeps", [5, 6, 7, 8], [11], [-1e-9], reward=0.0, engine="engine-1",
               finish_reason="stop", attempts=2, weight_version=3),
        Sample("the quick brown fox", ODD, [5, 6, 7, 8], [12, 13, 14], [-0.7, float("-inf"), -3.0],
               reward=0.25, engine="engine-0", metadata={"note": ODD, "nested": {"a": [1, 2.5, None]}}),
        Sample("one two", " three four five", [1, 2], [3, 4, 5, 6, 7], [-0.3, -0.2, -0.1, -0.05, -0.01],
               reward=1.0, engine="engine-1"),
        Sample("one two", " nine", [1, 2], [19], [-4.5], reward=0.0, engine="engine-0"),
    ]


def test_sample_dict_round_trip():
    for s in make_samples():
        d = s.to_dict()
        json.dumps(d)  # plain JSON types only
        assert Sample.from_dict(json.loads(json.dumps(d))) == s


def test_round_trip_equality(tmp_path):
    samples = make_samples()
    path = save_rollout(tmp_path / "dumps" / "rollout_{rollout_id}.jsonl", 7, samples, weight_version=3,
                        run="exp-1", seed=11)
    assert path == tmp_path / "dumps" / "rollout_7.jsonl"
    dump = load_rollout(path)
    assert dump.samples == samples
    assert (dump.rollout_id, dump.weight_version, dump.meta) == (7, 3, {"run": "exp-1", "seed": 11})
    assert len(dump) == 5 and list(dump) == samples
    # The -inf logprob and the odd texts survived exactly.
    assert dump.samples[2].logprobs[1] == float("-inf")
    assert dump.samples[2].response == ODD and dump.samples[2].metadata["note"] == ODD


def test_file_is_greppable_json_lines(tmp_path):
    samples = make_samples()
    path = save_rollout(str(tmp_path / "r_{rollout_id}.jsonl"), 12, samples, weight_version="v3")
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    lines = text.split("\n")[:-1]
    assert len(lines) == 1 + len(samples)
    header = json.loads(lines[0])
    assert header["format"] == FORMAT and header["version"] == FORMAT_VERSION
    assert header["rollout_id"] == 12 and header["weight_version"] == "v3"
    assert header["num_samples"] == 5 and isinstance(header["created"], float)
    assert json.loads(lines[1])["response"] == " jumps over"
    assert "héllo → 世界 🙂" in lines[1]  # non-ASCII text is written as itself, so grep finds it
    # The line whose text has a lone surrogate (not UTF-8 encodable) falls back to \u escapes.
    assert "\\ud800" in lines[3] and lines[3].isascii()
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left no temporary file


def test_replay_builds_the_same_training_batch(tmp_path):
    samples = make_samples()
    original = build_training_batch(samples)
    replay = build_training_batch(load_rollout(save_rollout(tmp_path / "{rollout_id}.jsonl", 1, samples)))
    assert set(original) == set(replay)
    for k in original:
        assert original[k].dtype == replay[k].dtype, k
        assert torch.equal(original[k], replay[k]), k
    assert batch_differences(original, replay) == []
    # ... and a replay of different data would be seen: one logprob off by 1e-6.
    changed = make_samples()
    changed[3].logprobs[2] += 1e-6
    assert batch_differences(original, build_training_batch(changed)) == ["old_logprobs"]
    changed = make_samples()
    changed[1].reward = 0.5
    assert batch_differences(original, build_training_batch(changed)) == ["advantages", "rewards"]


def test_training_batch_contents():
    b = build_training_batch(make_samples(), pad_id=99)
    assert b["input_ids"].shape == (5, 7) and b["input_ids"].dtype == torch.int64
    assert b["input_ids"][0].tolist() == [5, 6, 7, 8, 9, 10, 99]
    assert b["input_ids"][3].tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert b["input_ids"][4].tolist() == [1, 2, 19, 99, 99, 99, 99]
    assert b["attention_mask"][4].tolist() == [1, 1, 1, 0, 0, 0, 0]
    assert b["loss_mask"][0].tolist() == [0, 0, 0, 0, 1, 1, 0]
    assert b["loss_mask"][3].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert b["old_logprobs"].dtype == torch.float32
    assert b["old_logprobs"][0].tolist() == pytest.approx([0, 0, 0, 0, -0.1, -2.3025850929940455, 0])
    assert b["old_logprobs"][2, 5].item() == float("-inf")
    assert b["rewards"].tolist() == [1.0, 0.0, 0.25, 1.0, 0.0]
    # GRPO baseline per prompt: group 1 mean 1.25/3, group 2 mean 0.5.
    m = 1.25 / 3
    assert b["advantages"].tolist() == pytest.approx([1 - m, -m, 0.25 - m, 0.5, -0.5], abs=1e-6)
    assert b["prompt_lengths"].tolist() == [4, 4, 4, 2, 2]
    assert b["response_lengths"].tolist() == [2, 1, 3, 5, 1]
    # An explicit group key overrides the prompt.
    s = make_samples()
    for x in s:
        x.group = "all"
    assert build_training_batch(s)["advantages"].tolist() == pytest.approx(
        [r - 2.25 / 5 for r in [1.0, 0.0, 0.25, 1.0, 0.0]], abs=1e-6)


def test_training_batch_refuses_unusable_samples():
    s = make_samples()
    s[1].reward = None
    with pytest.raises(ValueError, match="sample 1 .* has no reward"):
        build_training_batch(s)
    s = make_samples()
    s[2].logprobs = s[2].logprobs[:2]
    with pytest.raises(ValueError, match="sample 2 .*3 output tokens but 2 logprobs"):
        build_training_batch(s)
    with pytest.raises(ValueError, match="no samples"):
        build_training_batch([])


def test_template_formatting(tmp_path):
    assert dump_path("dumps/rollout_{rollout_id}.jsonl", 412).as_posix() == "dumps/rollout_412.jsonl"
    assert dump_path("d/{rollout_id:06d}.jsonl", 7).as_posix() == "d/000007.jsonl"
    assert dump_path("d/{{literal}}_{rollout_id}.jsonl", 7).as_posix() == "d/{literal}_7.jsonl"
    with pytest.raises(ValueError, match=r"must contain \{rollout_id\}"):
        dump_path("dumps/rollout.jsonl", 1)
    with pytest.raises(ValueError, match=r"only \{rollout_id\} may be used"):
        dump_path("dumps/{step}_{rollout_id}.jsonl", 1)
    # Each round gets its own file.
    for rid in (1, 2):
        save_rollout(tmp_path / "r{rollout_id}.jsonl", rid, make_samples()[:rid])
    assert [len(load_rollout(tmp_path / f"r{rid}.jsonl")) for rid in (1, 2)] == [1, 2]


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"rollout dump .*nope_3\.jsonl does not exist"):
        load_rollout(tmp_path / "nope_3.jsonl")


def _saved(tmp_path) -> tuple:
    path = save_rollout(tmp_path / "r_{rollout_id}.jsonl", 5, make_samples())
    return path, path.read_text(encoding="utf-8")


def test_bad_version(tmp_path):
    path, text = _saved(tmp_path)
    header, rest = text.split("\n", 1)
    h = json.loads(header)
    h["version"] = 3
    path.write_text(json.dumps(h) + "\n" + rest, encoding="utf-8")
    with pytest.raises(DumpFormatError, match=r"r_5\.jsonl:1: dump format version 3 is not supported "
                                              r"\(this code reads versions 1, 2\)"):
        load_rollout(path)
    h["version"], h["format"] = 1, "something-else"
    path.write_text(json.dumps(h) + "\n" + rest, encoding="utf-8")
    with pytest.raises(DumpFormatError, match="not a rollout dump: the header's format is 'something-else'"):
        load_rollout(path)
    path.write_text('[1, 2]\n' + rest, encoding="utf-8")
    with pytest.raises(DumpFormatError, match="not a rollout dump"):
        load_rollout(path)


def test_truncated_files(tmp_path):
    path, text = _saved(tmp_path)
    lines = text.split("\n")
    # Cut inside the last sample line.
    path.write_text(text[:-40], encoding="utf-8")
    with pytest.raises(DumpFormatError,
                       match=r":6: truncated: the last line is cut off .*announces 5 samples, 4 are complete"):
        load_rollout(path)
    # Cut at a line boundary: two whole samples missing.
    path.write_text("\n".join(lines[:4]) + "\n", encoding="utf-8")
    with pytest.raises(DumpFormatError, match="truncated: the header announces 5 samples, the file holds 3"):
        load_rollout(path)
    # Cut exactly before the final newline.
    path.write_text(text[:-1], encoding="utf-8")
    with pytest.raises(DumpFormatError, match="truncated: the last line has no newline"):
        load_rollout(path)
    # Cut inside the header.
    path.write_text(text[:30], encoding="utf-8")
    with pytest.raises(DumpFormatError, match=r":1: the header line is not JSON"):
        load_rollout(path)
    path.write_text("", encoding="utf-8")
    with pytest.raises(DumpFormatError, match="empty file"):
        load_rollout(path)
    # A corrupt line in the middle is not called truncated.
    bad = lines[:]
    bad[2] = bad[2][:-1]
    path.write_text("\n".join(bad), encoding="utf-8")
    with pytest.raises(DumpFormatError, match=r":3: not JSON"):
        load_rollout(path)
    # A sample line with an unknown field.
    bad = lines[:]
    d = json.loads(bad[1])
    d["surprise"] = 1
    bad[1] = json.dumps(d)
    path.write_text("\n".join(bad), encoding="utf-8")
    with pytest.raises(DumpFormatError, match=r":2: bad sample: unknown sample field\(s\) \['surprise'\]"):
        load_rollout(path)


def test_odd_text_survives(tmp_path):
    weird = ["", " ", "\n\n", "\u2028\u2029\x85", "a\x00b", "\ud83d", "\udfff x", "🙂" * 100, "\\u0041",
             '{"format": "vime-rollout-dump"}', "NaN", "-Infinity"]
    samples = [Sample(w, w[::-1], [1], [2], [-0.5], reward=0.0, engine=w, metadata={w: w}) for w in weird]
    dump = load_rollout(save_rollout(tmp_path / "{rollout_id}.jsonl", "odd/id ü", samples, note=weird))
    assert dump.samples == samples
    assert dump.rollout_id == "odd/id ü" and dump.meta == {"note": weird}
    assert [s.prompt for s in dump.samples] == weird


def test_from_rollout_duck_types_results():
    from types import SimpleNamespace

    result = {"text": " jumps", "token_ids": [9, 10], "logprobs": [-0.1, -0.2], "finish_reason": "length",
              "engine": "engine-1", "attempts": 2,
              "timings": {"sent": 10.0, "first_token": 10.5, "finished": 11.0}}
    s = Sample.from_rollout(result, prompt="the fox", prompt_token_ids=[5, 6], reward=1, weight_version=4, idx=3)
    assert s == Sample("the fox", " jumps", [5, 6], [9, 10], [-0.1, -0.2], reward=1.0, engine="engine-1",
                       finish_reason="length", attempts=2,
                       timings={"sent": 10.0, "first_token": 10.5, "finished": 11.0}, weight_version=4,
                       metadata={"idx": 3})
    obj = SimpleNamespace(text="x", token_ids=(1,), logprobs=(-1.0,), finish_reason="stop", engine="e",
                          attempts=[object(), object(), object()], sent=1.0, first_token=2.0, finished=3.0,
                          prompt_token_ids=[4])
    s = Sample.from_rollout(obj, prompt="p")
    assert (s.prompt_token_ids, s.output_token_ids, s.attempts, s.timings) == (
        [4], [1], 3, {"sent": 1.0, "first_token": 2.0, "finished": 3.0})
    with pytest.raises(ValueError, match="pass prompt_token_ids"):
        Sample.from_rollout({"text": "x", "token_ids": [1]}, prompt="p")


# -- issue 17: a continued sample's splits, and dumps written before them -------------------


def _continued_result():
    from vime.trainer.rollout import DIED, OK, SPAN_BRACKET, SPAN_SENT, Attempt, RolloutResult, Split, StartOver

    return RolloutResult(
        request_id="r1", text=" a b c", finish_reason="length", engine="B", url="http://b", token_ids=[9, 10, 11],
        logprobs=[-0.1, -0.2, -0.3], prompt_token_ids=[5, 6], n_tokens=3,
        attempts=[Attempt("A", "abort"), Attempt("A", DIED), Attempt("B", OK)], sent=1.0, attempt_sent=2.0,
        first_token=2.5, finished=3.0, epoch=1, weight_version=4,
        splits=[Split("A", 4, 0, 2, DIED, 7, span=SPAN_SENT),
                Split("B", 5, 2, 1, OK, 99, span=SPAN_BRACKET, weight_version_end=6)],
        started_over=[StartOver("A", 3, 5, "the weight version changed")])


def test_continued_sample_round_trips_its_splits(tmp_path):
    s = Sample.from_rollout(_continued_result(), prompt="p", reward=1.0)
    assert s.splits == [{"engine": "A", "weight_version": 4, "offset": 0, "tokens": 2, "outcome": "died", "seed": 7,
                         "dropped": 0, "span": "sent", "weight_version_end": None, "kv_version": None},
                        {"engine": "B", "weight_version": 5, "offset": 2, "tokens": 1, "outcome": "ok", "seed": 99,
                         "dropped": 0, "span": "bracket", "weight_version_end": 6, "kv_version": None}]
    assert s.started_over == [{"engine": "A", "weight_version": 3, "tokens": 5,
                               "reason": "the weight version changed"}]
    path = save_rollout(tmp_path / "r_{rollout_id}.jsonl", 1, [s] + make_samples())
    line = json.loads(path.read_text(encoding="utf-8").split("\n")[1])
    assert [x["offset"] for x in line["splits"]] == [0, 2]  # greppable: jq '.splits'
    dump = load_rollout(path)
    assert dump.version == FORMAT_VERSION == 2 and dump.samples[0] == s
    # Each piece's version, and how it is known, survive the replay: per output token too.
    assert [(x["weight_version"], x["span"], x["weight_version_end"]) for x in dump.samples[0].splits] == [
        (4, "sent", None), (5, "bracket", 6)]
    assert dump.samples[0].token_versions() == [4, 4, 5]
    assert all(x.splits == [] and x.started_over == [] for x in dump.samples[1:])
    # The training batch does not depend on how a sample was made.
    assert batch_differences(build_training_batch(dump.samples),
                             build_training_batch([Sample.from_dict({**s.to_dict(), "splits": [], "started_over": []})]
                                                  + make_samples())) == []
    with pytest.raises(ValueError, match=r"splits entry .* lacks \['offset'\]"):
        Sample.from_dict({**s.to_dict(), "splits": [{"engine": "A", "tokens": 1}]})


def test_version_1_dump_still_loads(tmp_path):
    """A dump written before splits existed (version 1: samples without the two fields)."""
    rows = [{k: v for k, v in x.to_dict().items() if k not in ("splits", "started_over")} for x in make_samples()]
    header = {"format": FORMAT, "version": 1, "rollout_id": 3, "weight_version": 2, "created": 1.0,
              "created_iso": "1970-01-01T00:00:01+00:00", "num_samples": len(rows), "meta": {}}
    path = tmp_path / "old.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [header] + rows) + "\n", encoding="utf-8")
    dump = load_rollout(path)
    assert dump.version == 1 and dump.samples == make_samples()
    assert all(x.splits == [] and x.started_over == [] for x in dump.samples)
