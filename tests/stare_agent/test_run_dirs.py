"""Run directories: a second process is refused while the first holds one, a result is never replaced
without --overwrite, and --overwrite deletes exactly what the command writes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stare_agent import run_dirs
from stare_agent.run_dirs import (
    RunDirError,
    check_evaluation,
    check_quickstart,
    check_sft,
    check_training,
    last_logged_step,
    locked,
)

HOLD = """
import sys
from stare_agent.run_dirs import locked
with locked(sys.argv[1], "trainer.run_dir"):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_second_process_is_refused_while_the_first_holds_the_directory(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(RunDirError) as refused, locked(run, "trainer.run_dir"):
            pass
        assert str(refused.value) == (
            f"trainer.run_dir={run} is in use by process {holder.pid} (a command running there now): wait "
            "for it to end, or pick another trainer.run_dir"
        )
    finally:
        holder.communicate("", timeout=30)
    with (
        locked(run, "trainer.run_dir"),
        locked(run, "trainer.run_dir"),
    ):  # free again; re-entrant in a process
        pass


def _finished_run(run):
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "checkpoints" / "step-000002" / "trainer.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "cut')
    (run / "config.yaml").write_text("trainer: {}\n")
    (run / "tensorboard" / "rl").mkdir(parents=True)
    (run / "tensorboard" / "rl" / "events").write_text("x")
    # the user's and the SFT's, which a training's --overwrite must leave alone
    (run / "notes.txt").write_text("mine")
    (run / "sft_log.jsonl").write_text('{"step": 1}\n')
    (run / "tensorboard" / "sft").mkdir()
    (run / "tensorboard" / "sft" / "events").write_text("x")


def test_a_run_is_refused_resumed_or_overwritten_and_only_its_files_go(tmp_path, capsys):
    run = tmp_path / "run"
    _finished_run(run)
    assert last_logged_step(run / "metrics.jsonl") == 2  # the cut last line does not count
    with pytest.raises(
        RunDirError, match=r"holds a run \(steps logged up to 2, a checkpoint of step 2\)"
    ) as held:
        check_training(run, resume=False, overwrite=False, steps=5)
    # the Python API's words beside the CLI's: Trainer(config, resume=True) / overwrite=True
    assert "(in Python: Trainer(..., resume=True) or overwrite=True)" in str(held.value)
    check_training(run, resume=True, overwrite=False, steps=5)  # 3 steps to go: resumed
    with pytest.raises(RunDirError, match="finished at step 2 \\(trainer.steps=2\\): raise trainer.steps"):
        check_training(run, resume=True, overwrite=False, steps=2)
    assert (run / "checkpoints" / "step-000002").is_dir()  # nothing was deleted by any of those
    check_training(run, resume=False, overwrite=True, steps=2)
    assert (
        "--overwrite: deleted config.yaml, metrics.jsonl, checkpoints/, tensorboard/rl/"
        in capsys.readouterr().out
    )
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == [
        "notes.txt",
        "sft_log.jsonl",
        "tensorboard",
        "tensorboard/sft",
        "tensorboard/sft/events",
    ]
    check_training(run, resume=False, overwrite=False, steps=2)  # an SFT's directory takes a new run


def test_an_sft_is_refused_or_overwritten_and_a_foreign_output_dir_never_deleted(tmp_path):
    run, model = tmp_path / "run", tmp_path / "run" / "sft_model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (run / "sft_log.jsonl").write_text('{"step": 1}\n')
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # an RL run beside it stays
    with pytest.raises(RunDirError, match=r"holds an SFT \(.*sft_log.jsonl, .*sft_model/\): pick another"):
        check_sft(run, model, overwrite=False)
    check_sft(run, model, overwrite=True)
    assert not model.exists() and sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    with pytest.raises(RunDirError, match="holds files that are not a model: pick another sft.output_dir"):
        check_sft(run, home, overwrite=True)
    assert (home / "thesis.tex").read_text() == "years of work"


def test_an_evaluation_is_refused_resumed_or_overwritten(tmp_path):
    out = tmp_path / "eval"
    out.mkdir()
    (out / "results.jsonl").write_text("{}\n")
    (out / "summary.json").write_text("{}")
    (out / "mine.txt").write_text("x")
    with pytest.raises(RunDirError, match=r"holds an evaluation \(results.jsonl, summary.json\)"):
        check_evaluation(out, resume=False, overwrite=False)
    check_evaluation(out, resume=True, overwrite=False)
    check_evaluation(out, resume=False, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]


def test_a_quickstart_is_refused_or_overwritten_whole(tmp_path):
    run = tmp_path / "quickstart"
    (run / "eval_before").mkdir(parents=True)
    (run / "eval_before" / "results.jsonl").write_text("{}\n")
    (run / "eval_sft").mkdir()  # a quickstart stopped during RL left its SFT evaluation behind
    (run / "eval_sft" / "results.jsonl").write_text("{}\n")
    (run / "quickstart.json").write_text("{}")
    (run / "sft_model").mkdir()
    (run / "sft_model" / "config.json").write_text("{}")
    _finished_run(run)
    with pytest.raises(RunDirError, match=r"make quickstart ARGS=--overwrite"):
        check_quickstart(run, run / "sft_model", overwrite=False)
    check_quickstart(run, run / "sft_model", overwrite=True)
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == ["notes.txt", "tensorboard"]


def test_a_command_that_fails_before_writing_leaves_no_trace(tmp_path):
    """A failed command left a directory holding only `.lock`; a directory that was there keeps all
    but the lock; a written file keeps the directory and the lock."""
    fresh = tmp_path / "runs" / "new"
    with pytest.raises(RuntimeError), run_dirs.locked(fresh, "trainer.run_dir"):
        raise RuntimeError("failed before writing")
    assert not fresh.exists() and (tmp_path / "runs").is_dir()
    mine = tmp_path / "mine"
    mine.mkdir()
    with run_dirs.locked(mine, "--out"):
        pass
    assert mine.is_dir() and list(mine.iterdir()) == []
    with run_dirs.locked(mine, "--out"):
        (mine / "results.jsonl").write_text("{}\n")
    assert sorted(p.name for p in mine.iterdir()) == [run_dirs.LOCK_FILENAME, "results.jsonl"]


def test_a_summary_that_cannot_be_written_leaves_no_half_file(tmp_path, monkeypatch):
    from stare_agent import eval_files

    target = tmp_path / "summary.json"

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(target), "write_text", full)
    with pytest.raises(OSError):
        eval_files.replace_file(target, "{}")
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
