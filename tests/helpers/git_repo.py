"""A throwaway git repository for bisect tests: `git = new_repo(path)`, `revs = commit_each(git, path, "f", 3)`."""
from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path


def new_repo(path: Path) -> Callable[..., str]:
    """Create an empty repository at `path` (with a committer) and return `git(*args) -> stdout` run inside it."""
    path.mkdir(parents=True, exist_ok=True)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    return git


def commit_each(git: Callable[..., str], path: Path, name: str, count: int) -> list[str]:
    """`count` commits, commit i writing str(i) to the file `name` (plus whatever else is in the tree); their
    revisions in order."""
    revisions = []
    for i in range(count):
        (path / name).write_text(str(i))
        git("add", "-A")
        git("commit", "-q", "-m", f"c{i}")
        revisions.append(git("rev-parse", "HEAD"))
    return revisions
