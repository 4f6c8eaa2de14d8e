"""The docs name what the tree has: every repository path, `python -m` module and `planner` command in
README.md and docs/*.md exists. A path is one in their code (`...` or a fenced block) under a top-level folder
of the repository; what a command of the doc writes (``--out PATH``) and what git ignores (made, never
committed) need not exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from planner.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Where a repository path starts; other paths in the docs are examples (/srv/..., plan.json, W.csv).
TOP = ("planner", "twin", "models", "serving_harness", "benchmarks", "tests", "docs", "datasets", "artifacts", ".ci")
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.DOTALL)
PATH = re.compile(rf"(?<![\w./-])(?:{'|'.join(map(re.escape, TOP))})/[\w./<>{{}},*…-]*")
LINK = re.compile(r"\]\((?![a-z]+:)([^)#\s]+)(?:#[^)]*)?\)")  # relative links
OUTPUT = re.compile(r"--out[ =](\S+)")
#: Modules of this repository (not vLLM's, pip's, ...) and not a pattern such as benchmarks.<group>.<name>.
MODULE = re.compile(rf"python3? -m ((?:{'|'.join(map(re.escape, TOP))})\.[\w.]++)(?!<)")
COMMAND = re.compile(r"(?:^|[\s/`])planner ([a-z][\w-]*(?: [a-z][\w-]*)?)", re.MULTILINE)


def _code(doc: Path) -> str:
    return "\n".join(CODE.findall(doc.read_text(encoding="utf-8")))


def _paths(doc: Path) -> str:
    """The doc's code less the files its commands write (wherever it names them)."""
    code = _code(doc)
    for out in set(OUTPUT.findall(code)):
        code = re.sub(rf"(?<![\w./-]){re.escape(out)}(?![\w./-])", "", code)
    return code


def _exists(path: str) -> bool:
    """Whether ``path`` (placeholders ``<id>``, ``…`` and ``NAME`` for any name, ``{a,b}`` for each of a and b,
    globs) names something in the repository or that git ignores."""
    path = re.sub(r"(?:<[^>]*>|…|\b[A-Z]+\b|\*)+", "*", path.rstrip(".,:;").split(":")[0])
    braces = re.search(r"\{([^}]*)\}", path)
    if braces:
        return all(_exists(path[:braces.start()] + alt + path[braces.end():]) for alt in braces[1].split(","))
    if "*" in path:
        return any(ROOT.glob(path.rstrip("/")))
    return (ROOT / path).exists() or any(subprocess.run(["git", "check-ignore", "-q", "--no-index", p], cwd=ROOT,
                                                  check=False).returncode == 0 for p in (path, path + "/"))


def _named(pattern: re.Pattern, text_of) -> list[tuple[str, str]]:
    return sorted({(doc.relative_to(ROOT).as_posix(), m) for doc in DOCS for m in pattern.findall(text_of(doc))})


@pytest.mark.parametrize("doc,path", _named(PATH, _paths))
def test_repository_paths_exist(doc, path):
    assert _exists(path), f"{doc} names {path}"


@pytest.mark.parametrize("doc,link", _named(LINK, lambda d: d.read_text(encoding="utf-8")))
def test_relative_links_resolve(doc, link):
    assert ((ROOT / doc).parent / link).exists(), f"{doc} links {link}"


@pytest.mark.parametrize("doc,module", _named(MODULE, _code))
def test_python_modules_exist(doc, module):
    base = ROOT.joinpath(*module.split("."))
    assert base.with_suffix(".py").is_file() or (base / "__main__.py").is_file(), f"{doc} runs {module}"


@pytest.mark.parametrize("doc,command", _named(COMMAND, _code))
def test_planner_commands_exist(doc, command):
    name, _, sub = command.partition(" ")
    assert name in main.commands, f"{doc} names `planner {name}`"
    group = main.commands[name]
    if sub and hasattr(group, "commands"):
        assert sub in group.commands, f"{doc} names `planner {name} {sub}`"
