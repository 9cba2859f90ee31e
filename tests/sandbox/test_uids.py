"""A uid per live sandbox on a host: claims hold across processes and end with their holder."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

from stare_sandbox import uids
from stare_sandbox.config import SANDBOX_UIDS
from stare_sandbox.uids import CLAIM_DIR, claim_uid

HOLD = """
from stare_sandbox import uids
from stare_sandbox.uids import CLAIM_DIR, claim_uid
claim = claim_uid()
print(claim.uid, flush=True)
input()
"""


def test_a_uid_is_held_across_processes_until_its_holder_releases_it_or_dies() -> None:
    mine = claim_uid()
    other = subprocess.Popen(
        [sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        theirs = int(other.stdout.readline())
        assert mine.uid in SANDBOX_UIDS and theirs in SANDBOX_UIDS and theirs != mine.uid
        second = claim_uid()
        assert second.uid not in (mine.uid, theirs)
        second.release()
        second.release()  # idempotent
    finally:
        other.kill()
        other.wait(timeout=30)
    mine.release()
    for uid in (mine.uid, theirs):  # both free again: nothing holds their claim files
        fd = os.open(CLAIM_DIR / str(uid), os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)


def test_a_claim_file_that_is_not_a_plain_file_is_skipped_never_followed(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(
        uids, "CLAIM_DIR", tmp_path / "claims"
    )  # not the host's: no sibling's claim is touched
    probe = claim_uid()
    probe.release()
    planted = uids.CLAIM_DIR / str(probe.uid)
    planted.unlink()
    target = tmp_path / "target"
    target.write_text("mine")
    planted.symlink_to(target)
    claim = claim_uid()
    assert claim.uid != probe.uid and claim.uid in SANDBOX_UIDS
    claim.release()
    assert target.read_text() == "mine" and planted.is_symlink()


ATTACK = """
import fcntl, os
held, planted, refused = [], [], 0
folder = {folder!r}
for name in sorted(os.listdir(folder)):
    try:
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
    except OSError:
        refused += 1
        continue
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.append(fd)
    except OSError:
        os.close(fd)
for uid in {free}:
    try:
        fd = os.open(os.path.join(folder, str(uid)), os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o444)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        planted.append(uid)
    except OSError:
        pass
print(len(held), planted, refused)
"""


def test_model_code_in_a_local_sandbox_can_neither_take_nor_plant_uid_claims() -> None:
    """A local kernel could open the host's claim files (world-readable) and flock every free one, or
    create the claim of a uid no one had used yet and hold it: then no sandbox on the host, Docker ones
    included, could get a uid. Claims are owner-only files now, and one a sandbox uid planted is
    removed and made again by the host."""
    from tests.conftest import host_problem, require

    require("host", host_problem(unshare=True))
    from stare_sandbox import make_sandbox

    claim_uid().release()  # a free claim file exists
    free = [uid for uid in reversed(SANDBOX_UIDS) if not (CLAIM_DIR / str(uid)).exists()][:3]
    with make_sandbox("local") as sandbox:
        result = sandbox.run(ATTACK.format(folder=str(CLAIM_DIR), free=free))
        assert result.error is None, result.error
        held, planted, refused = (
            result.stdout.strip().split(" ", 1)[0],
            *result.stdout.strip().split(" ", 1)[1].rsplit(" ", 1),
        )
        assert held == "0" and int(refused) > 0, result.stdout  # no claim file opened from inside
        planted_uids = [int(u) for u in planted.strip("[]").split(",") if u.strip()]
        with uids._lock:  # the planted claims are the host's to take while their planter still holds them
            taken = [uids._try_claim(uid, CLAIM_DIR) for uid in planted_uids]
        assert all(t is not None and t.uid == uid for t, uid in zip(taken, planted_uids, strict=True))
        for claim in taken:
            claim.release()
