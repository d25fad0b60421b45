"""benchmarks/provenance.py in a scratch repository: a clean tree is named by its commit, a changed one by
its commit plus the tree's hash, and --find maps that hash back to the commit that has those sources."""

from __future__ import annotations

import subprocess

import pytest

from tests.benchmark_scripts import load_benchmark

provenance = load_benchmark("provenance")


def git(root, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "model.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("not a source\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "one")
    return tmp_path


def test_a_clean_tree_is_its_commit_and_a_changed_one_is_found_by_its_hash(repo):
    first = git(repo, "rev-parse", "--short", "HEAD")
    assert provenance.commit(repo) == first
    (repo / "README.md").write_text("only sources count\n")
    assert provenance.commit(repo) == first
    (repo / "engine" / "model.py").write_text("x = 2\n")  # the tree a later commit will have
    changed = provenance.commit(repo)
    assert changed.startswith(f"{first}+changes, tree ")
    tid = changed.rsplit(" ", 1)[1]
    assert provenance.find(tid, repo) == []  # no commit has these sources yet
    git(repo, "commit", "-qam", "two")
    second = git(repo, "rev-parse", "HEAD")[:12]
    assert provenance.find(tid, repo) == [second]
    assert provenance.commit(repo) == second[: len(first)]
    (repo / "engine" / "extra.py").write_text("")  # an untracked source file changes the tree too
    assert "+changes" in provenance.commit(repo)


def test_outside_a_repository_the_commit_is_unknown(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "a.py").write_text("")
    assert provenance.commit(tmp_path).startswith("unknown+changes, tree ")
