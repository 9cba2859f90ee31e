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
