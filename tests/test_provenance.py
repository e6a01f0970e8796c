"""posenc_fairseq/provenance.py: the commit recorded with benchmark and sweep results is the
checkout's HEAD as git itself names it, and nothing outside a checkout of this source."""
import subprocess

from posenc_fairseq import provenance
from util import REPO


def git(*words):
    return subprocess.run(["git", "-C", str(REPO), *words], capture_output=True, text=True, check=False)


def test_the_commit_is_git_s_head_marked_dirty_where_files_differ(monkeypatch):
    monkeypatch.delenv(provenance.COMMIT_VARIABLE, raising=False)
    head = git("rev-parse", "--short=12", "HEAD").stdout.strip()
    dirty = git("diff", "--quiet", "HEAD").returncode != 0
    assert len(head) == 12
    assert provenance.source_commit() == head + ("-dirty" if dirty else "")
    assert provenance.source_commit(7) == head[:7] + ("-dirty" if dirty else "")


def test_no_commit_outside_a_checkout_of_this_source(tmp_path, monkeypatch):
    monkeypatch.delenv(provenance.COMMIT_VARIABLE, raising=False)
    monkeypatch.setattr(provenance, "SOURCE", tmp_path)  # not a repository
    assert provenance.source_commit() is None
    inner = REPO / "docs"  # inside the repository, but not its top: an installed copy in a venv would be
    monkeypatch.setattr(provenance, "SOURCE", inner)
    assert provenance.source_commit() is None


def test_a_copy_is_told_its_commit(tmp_path, monkeypatch):
    """A GPU machine's copy of the tree has no git, or a stale one: scripts/gpu_carry.sh records the
    commit, which the copy's records name (before, null or the stale git's)."""
    monkeypatch.setattr(provenance, "SOURCE", tmp_path)
    monkeypatch.setenv(provenance.COMMIT_VARIABLE, "0123456789ab-dirty")
    assert provenance.source_commit() == "0123456789ab-dirty"
