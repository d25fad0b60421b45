"""Which source tree a benchmark ran: its commit, or the commit and a hash of the tree where they differ.

On the lent GPU the working tree arrives beside a stale clone's .git, so `git rev-parse HEAD` there names an
old commit (docs/benchmarks.md's results of sessions 8-10 read be5a1cd, 965cf9e and e9b0256 for newer trees).
`commit()` hashes the Python sources under SOURCE_DIRS as git would (a blob id per file, no repository
needed) and names HEAD only when HEAD's sources hash the same; otherwise "HEAD+changes, tree ID". Back
here, `python benchmarks/provenance.py --find ID` lists the commits whose sources hash to ID.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("engine", "scheduler", "ourobatch", "benchmarks")


def _git(root: Path, *args: str) -> str:
    run = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    return run.stdout if run.returncode == 0 else ""


def _tree_id(entries: list[tuple[str, str]]) -> str:
    lines = "".join(f"{path} {blob}\n" for path, blob in sorted(entries))
    return hashlib.sha1(lines.encode()).hexdigest()


def tree_id(root: Path = ROOT) -> str:
    """The hash of the .py files under SOURCE_DIRS as they are on disk (git's blob id of each)."""
    entries = []
    for d in SOURCE_DIRS:
        for path in sorted((root / d).rglob("*.py")):
            if "__pycache__" not in path.parts:
                data = path.read_bytes()
                blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
                entries.append((path.relative_to(root).as_posix(), blob))
    return _tree_id(entries)


def tree_id_at(rev: str, root: Path = ROOT) -> str:
    """The same hash of the files committed at `rev` ("" where git cannot say)."""
    listing = _git(root, "ls-tree", "-r", rev, "--", *SOURCE_DIRS)
    entries = [(line.split("\t", 1)[1], line.split()[2]) for line in listing.splitlines()
               if line.endswith(".py") and " blob " in line]
    return _tree_id(entries) if entries else ""


def commit(root: Path = ROOT) -> str:
    """HEAD's short hash where the sources on disk are HEAD's, else "HEAD+changes, tree ID" (ID: tree_id's
    first 12 digits; HEAD is "unknown" outside a repository)."""
    head = _git(root, "rev-parse", "--short", "HEAD").strip() or "unknown"
    tid = tree_id(root)
    if head != "unknown" and tree_id_at("HEAD", root) == tid:
        return head
    return f"{head}+changes, tree {tid[:12]}"


def find(tid: str, root: Path = ROOT, depth: int = 300) -> list[str]:
    """The commits among HEAD's last `depth` (newest first) whose sources hash to `tid` (a prefix will do)."""
    revs = _git(root, "rev-list", "-n", str(depth), "HEAD").split()
    return [rev[:12] for rev in revs if tid and tree_id_at(rev, root).startswith(tid)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--find", metavar="ID", help="list the commits whose sources hash to ID")
    ap.add_argument("--depth", type=int, default=300, help="commits back from HEAD to search")
    args = ap.parse_args(argv)
    if args.find:
        matches = find(args.find, depth=args.depth)
        print("\n".join(matches) if matches else f"no commit in the last {args.depth} has tree {args.find}")
        return 0 if matches else 1
    print(commit())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
