"""Run directories: one live process in each, and no result in one replaced without a flag that says so.

Every command that writes a directory (``train``, ``sft`` and ``quickstart`` their ``trainer.run_dir``,
``eval`` its ``--out``) first claims it, before any model loads:

- the directory is locked (:func:`locked`: ``flock`` on ``.lock``, held until the command ends): a
  second process is refused with one line naming the first one's pid;
- a directory holding what the command would write (a run's metrics and checkpoints, a fine-tuned model,
  an evaluation's results) is refused with one line naming the way to continue it (``--resume``), to
  write elsewhere, or ``--overwrite``, which deletes exactly those files (never anything else) first
  (:func:`check_training`, :func:`check_sft`, :func:`check_quickstart`, :func:`check_evaluation`).

Claims are re-entrant within a process: the quickstart holds its run directory while its SFT, training
and evaluations claim it again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from stare_agent.config import ConfigError

LOCK_FILENAME = ".lock"

RL_ARTIFACTS = (
    "config.yaml",
    "metrics.jsonl",
    "run.json",
    "checkpoints",
    "rollouts",
    "plots",
    "tensorboard/rl",
)
"""What ``train`` writes into ``trainer.run_dir`` (``--overwrite`` deletes these)."""
SFT_ARTIFACTS = ("sft_config.yaml", "sft_log.jsonl", "tensorboard/sft")
"""What ``sft`` writes into ``trainer.run_dir``, beside its model (``sft.output_dir``)."""
EVAL_ARTIFACTS = ("results.jsonl", "summary.json", "episodes.jsonl", "run.json")
"""What an evaluation writes into its ``--out``."""
QUICKSTART_ARTIFACTS = ("quickstart.json", "eval_before", "eval_sft", "eval_after")
"""What the quickstart writes into ``trainer.run_dir`` besides an SFT's and a training's."""


class RunDirError(ConfigError):
    """A directory a command cannot write: in use, holding a result, not writable. One line."""


_held: dict[str, list[int]] = {}  # real path -> [lock descriptor, claims]
_held_lock = threading.Lock()


@contextmanager
def locked(directory: str | os.PathLike[str], what: str) -> Iterator[Path]:
    """Hold ``directory`` (created if missing) for this process while the block runs. A directory the
    block left holding nothing but the lock (a command that failed before writing) is removed again, the
    lock file from a directory that was there before: a failed command leaves no trace.

    Raises:
        RunDirError: another process holds it (the line names its pid), or it cannot be created or
            written (``what`` names the setting, e.g. ``trainer.run_dir``).
    """
    existed = os.path.isdir(directory)
    path = writable_dir(directory, what)
    key = os.path.realpath(path)
    with _held_lock:
        held = _held.get(key)
        if held is not None:
            held[1] += 1
        else:
            _held[key] = [_acquire(path, what), 1]
    try:
        yield path
    finally:
        with _held_lock:
            held = _held[key]
            held[1] -= 1
            if held[1] == 0:
                del _held[key]
                with contextlib.suppress(OSError):  # gone or unreadable: nothing to tidy
                    if [p.name for p in path.iterdir()] == [LOCK_FILENAME]:  # nothing was written
                        (path / LOCK_FILENAME).unlink()
                        if not existed:
                            path.rmdir()
                os.close(held[0])  # releases the flock


def _acquire(path: Path, what: str) -> int:
    fd = os.open(path / LOCK_FILENAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirError(
            f"{_named(what, path)} is in use by process {holder} (a command running there now): wait for it to "
            f"end, or pick another {what}"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _named(what: str, path: Path) -> str:
    """``trainer.run_dir=runs/a`` for a config key, ``--out runs/a`` for a flag."""
    return f"{what} {path}" if what.startswith("--") else f"{what}={path}"


def writable_dir(directory: str | os.PathLike[str], what: str) -> Path:
    """``directory``, created if missing, after checking that this process can write in it.

    Raises:
        RunDirError: it is a file, lies under a file, or cannot be created or written.
    """
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"{_named(what, path)} is a file: pass a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise RunDirError(
            f"{_named(what, path)} lies under a file, not a directory: pass another path"
        ) from None
    except OSError as exc:
        raise RunDirError(
            f"{_named(what, path)} cannot be created ({exc.strerror}): pass a directory you can write"
        ) from None
    try:  # a real write: access() says yes to root on a read-only file system
        tempfile.TemporaryFile(dir=path).close()
    except OSError as exc:
        raise RunDirError(
            f"{_named(what, path)} is not writable ({exc.strerror}): pass a directory you can write"
        ) from None
    return path


def present(directory: Path, artifacts: Sequence[str]) -> list[str]:
    """The ``artifacts`` (relative paths) that exist in ``directory``; an empty folder does not count."""
    found = []
    for name in artifacts:
        path = directory / name
        if path.is_dir() and not path.is_symlink():
            if any(path.iterdir()):
                found.append(name + "/")
        elif path.exists() or path.is_symlink():
            found.append(name)
    return found


def remove(directory: Path, artifacts: Sequence[str]) -> list[str]:
    """Delete those of ``artifacts`` that exist in ``directory`` (a folder with all it holds); return them."""
    gone = present(directory, artifacts)
    for name in artifacts:
        path = directory / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    return gone


def check_training(run_dir: Path, *, resume: bool, overwrite: bool, steps: int) -> None:
    """Refuse (or, with ``overwrite``, clear) a ``trainer.run_dir`` ``train`` would spoil: without
    ``resume``, one holding a run; with it, one whose run already finished ``steps`` steps. Call it
    while holding the directory (:func:`locked`).

    Raises:
        RunDirError: naming what the directory holds and the three ways on.
    """
    if resume and overwrite:
        raise RunDirError(
            "--resume (Trainer(resume=True)) continues the run in trainer.run_dir and --overwrite "
            "(overwrite=True) deletes it: pass one of them"
        )
    where = f"trainer.run_dir={run_dir}"
    if resume:
        last = last_checkpoint_step(run_dir)
        if last is not None and last >= steps:
            raise RunDirError(
                f"{where} holds a run that finished at step {last} (trainer.steps={steps}): raise trainer.steps "
                "to train it further, or start again with --overwrite instead of --resume (in Python: "
                "Trainer(..., overwrite=True))"
            )
        return
    found = present(run_dir, RL_ARTIFACTS)
    if not found:
        return
    if not overwrite:
        raise RunDirError(
            f"{where} holds a run ({describe_run(run_dir)}): continue it with --resume, pick another "
            f"trainer.run_dir, or pass --overwrite to delete its {', '.join(found)} first (in Python: "
            "Trainer(..., resume=True) or overwrite=True)"
        )
    print(f"--overwrite: deleted {', '.join(remove(run_dir, RL_ARTIFACTS))} from {run_dir}", flush=True)


def last_checkpoint_step(run_dir: Path) -> int | None:
    """The step of the newest checkpoint in ``run_dir/checkpoints``, or None."""
    from stare_agent.train.checkpoints import latest_checkpoint

    last = latest_checkpoint(run_dir)
    return int(last.name.rpartition("-")[2]) if last is not None else None


def describe_run(run_dir: Path) -> str:
    """A few words on the run in ``run_dir``: its last logged step and its last checkpoint."""
    words = []
    logged = last_logged_step(run_dir / "metrics.jsonl")
    if logged is not None:
        words.append(f"steps logged up to {logged}")
    checkpoint = last_checkpoint_step(run_dir)
    if checkpoint is not None:
        words.append(f"a checkpoint of step {checkpoint}")
    return ", ".join(words) or "its config and run record, no step logged"


def last_logged_step(path: Path) -> int | None:
    """The last step a metrics file logged (``stare_agent.metrics.read_metrics``), or None: none, or a
    damaged file (the refusal that names it needs no more)."""
    from stare_agent.metrics import MetricsError, read_metrics

    if not path.is_file():
        return None
    try:
        steps = read_metrics(path.parent)
    except MetricsError:
        return None
    return int(steps[-1]["step"]) if steps else None


def check_sft(run_dir: Path, output_dir: Path, *, overwrite: bool) -> None:
    """Refuse (or, with ``overwrite``, clear) a ``trainer.run_dir`` holding an SFT's log, or an
    ``sft.output_dir`` holding a model; a non-empty ``sft.output_dir`` that is not a model (no
    ``config.json``) is refused even with ``overwrite``. Call it while holding ``run_dir``.

    Raises:
        RunDirError: naming what is there and the ways on.
    """
    found = [str(run_dir / name) for name in present(run_dir, SFT_ARTIFACTS)]
    model = output_dir.is_dir() and any(output_dir.iterdir())
    if model and not (output_dir / "config.json").is_file():
        raise RunDirError(
            f"sft.output_dir={output_dir} holds files that are not a model: pick another sft.output_dir "
            "(by default trainer.run_dir/sft_model)"
        )
    if model:
        found.append(f"{output_dir}/")
    if not found:
        return
    if not overwrite:
        raise RunDirError(
            f"trainer.run_dir={run_dir} holds an SFT ({', '.join(found)}): pick another trainer.run_dir (and "
            "sft.output_dir), or pass --overwrite to delete those first"
        )
    remove(run_dir, SFT_ARTIFACTS)
    if model:
        shutil.rmtree(output_dir)
    print(f"--overwrite: deleted {', '.join(found)}", flush=True)


def check_evaluation(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse (or, with ``overwrite``, clear) an evaluation's ``--out`` holding one's results, unless
    it is resumed. Call it while holding ``out``.

    Raises:
        RunDirError: naming the results and the three ways on.
    """
    if resume and overwrite:
        raise RunDirError(
            "--resume continues the evaluation in --out and --overwrite deletes it: pass one of them"
        )
    found = present(out, EVAL_ARTIFACTS)
    if resume or not found:
        return
    if not overwrite:
        raise RunDirError(
            f"--out {out} holds an evaluation ({', '.join(found)}): continue it with --resume, pick another "
            "--out, or pass --overwrite to delete those first"
        )
    print(f"--overwrite: deleted {', '.join(remove(out, EVAL_ARTIFACTS))} from {out}", flush=True)


def check_quickstart(run_dir: Path, sft_output_dir: Path, *, overwrite: bool) -> None:
    """Refuse (or, with ``overwrite``, clear) a ``trainer.run_dir`` holding an earlier quickstart's
    evaluations, SFT or run. Call it while holding the directory.

    Raises:
        RunDirError: naming what is there and the ways on.
    """
    found = present(run_dir, (*QUICKSTART_ARTIFACTS, *SFT_ARTIFACTS, *RL_ARTIFACTS))
    model = sft_output_dir.is_dir() and any(sft_output_dir.iterdir())
    if not found and not model:
        return
    if not overwrite:
        listed = ", ".join(found + ([f"{sft_output_dir}/"] if model else []))
        raise RunDirError(
            f"trainer.run_dir={run_dir} holds an earlier quickstart's results ({listed}): pass --overwrite to "
            "delete them and run it again (make quickstart ARGS=--overwrite), or pick another trainer.run_dir"
        )
    gone = remove(run_dir, (*QUICKSTART_ARTIFACTS, *RL_ARTIFACTS))
    if gone:
        print(f"--overwrite: deleted {', '.join(gone)} from {run_dir}", flush=True)
    check_sft(run_dir, sft_output_dir, overwrite=True)


__all__ = [
    "EVAL_ARTIFACTS",
    "check_evaluation",
    "check_quickstart",
    "check_sft",
    "check_training",
    "describe_run",
    "last_checkpoint_step",
    "last_logged_step",
    "LOCK_FILENAME",
    "QUICKSTART_ARTIFACTS",
    "RL_ARTIFACTS",
    "SFT_ARTIFACTS",
    "RunDirError",
    "locked",
    "present",
    "remove",
    "writable_dir",
]
