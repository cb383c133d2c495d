"""The README and docs/ stay true where that is cheap to check: the first
screen keeps the two commands, every `build/kvarn` line names a command and
options that the command's --help lists, every cache format named there
parses, the example prints the capacity the README's inspect table shows,
relative links resolve, and docs/README.md indexes every page. (The inspect
table itself is regenerated and compared in test_inspect_capacity.py, the C
block against examples/quickstart.c by ctest's test_readme_example.)"""
import re
import shlex
import subprocess

import pytest

from conftest import BUILD, REPO

README = REPO / "README.md"
DOCS = REPO / "docs"


def readme_lines():
    return README.read_text().splitlines()


def command_lines(path, prog="build/kvarn"):
    """The indented command lines of a markdown file that start with prog,
    continuation lines (a trailing backslash) joined, comments dropped."""
    out, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("    ") and line.strip().startswith(prog + " "):
            cmd = line.strip()
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1] + " " + lines[i].strip()
            out.append(cmd.split("  #")[0].strip())
        i += 1
    return out


def help_text(kvarn_bin, *args):
    r = subprocess.run([kvarn_bin, *args, "--help"], capture_output=True, text=True)
    assert r.returncode == 0, (args, r.stderr)
    return r.stdout


def test_first_screen_has_the_two_commands():
    # the demo and the test command come before anything else
    head = readme_lines()[:15]
    assert "    bash scripts/demo.sh" in head, head
    assert "    bash scripts/test.sh" in head, head
    assert "bash scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def test_readme_is_short_and_keeps_the_serve_marker():
    lines = readme_lines()
    # a reader's page, not a record of measurements (those live in docs/)
    assert len(lines) <= 200, len(lines)
    assert "<!-- serve-support -->" in lines


@pytest.mark.parametrize("page", ["README.md"] + sorted(
    "docs/" + p.name for p in DOCS.glob("*.md") if "    build/kvarn " in p.read_text()))
def test_kvarn_lines_use_real_commands_and_options(kvarn_bin, page):
    top = help_text(kvarn_bin)
    commands = re.findall(r"^  (\w+)\s{2,}", top.split("cache formats")[0], re.M)
    assert commands == ["generate", "eval", "passkey", "inspect"], top
    cmds = command_lines(REPO / page)
    assert cmds, page
    for cmd in cmds:
        words = shlex.split(cmd.replace("$M", "M"))
        assert words[1] in commands, cmd
        usage = help_text(kvarn_bin, words[1])
        for w in words[2:]:
            if not w.startswith("-") or w == "-":
                continue
            opt = w.split("=", 1)[0]
            assert re.search(r"(?<![\w-])" + re.escape(opt) + r"(?![\w-])", usage), \
                f"{page}: '{cmd}': {opt} is not in 'kvarn {words[1]} --help'"


def test_readme_formats_parse(kvarn_bin):
    # every --kv-cache-dtype value of the README's commands is accepted
    for cmd in command_lines(README):
        words = shlex.split(cmd.replace("$M", "M"))
        if "--kv-cache-dtype" not in words:
            continue
        value = words[words.index("--kv-cache-dtype") + 1]
        r = subprocess.run([kvarn_bin, "inspect", "--layers", "2", "--kv-heads", "1",
                            "--head-dim", "64", "--kv-cache-dtype", value],
                           capture_output=True, text=True)
        assert r.returncode == 0, (cmd, r.stderr)
    # and every preset the command lists is named in the README
    presets = re.findall(r"kvarn_k\dv\d_g\d+", help_text(kvarn_bin).split("cache formats")[1])
    text = README.read_text()
    for name in presets:
        assert f"`{name}`" in text, name


def inspect_cell(fmt, column):
    lines = readme_lines()
    head = next(l for l in lines if l.startswith("| format | G |"))
    names = [c.strip() for c in head.strip("|").split("|")]
    row = next(l for l in lines if l.startswith(f"| {fmt} | ") and lines.index(l) > lines.index(head))
    return [c.strip() for c in row.strip("|").split("|")][names.index(column)]


def test_example_prints_the_inspect_tables_count():
    exe = BUILD / "example_quickstart"
    if not exe.exists():
        pytest.fail(f"{exe} is missing: build first (cmake --build build)")
    r = subprocess.run([str(exe)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    m = re.search(r"requests of 2048 tokens in 1 GiB, all memory counted: (\d+) \(fp16: (\d+)\)", r.stdout)
    assert m, r.stdout
    # the same computation as inspect's "2k seqs" column (same shape and budget)
    assert m.group(1) == inspect_cell("kvarn_k4v2_g128", "2k seqs"), r.stdout
    assert m.group(2) == inspect_cell("fp16", "2k seqs"), r.stdout
    # and the README says what it prints
    assert f"it prints {m.group(1)} requests against fp16's {m.group(2)}" in \
        " ".join(README.read_text().split()), "README's sentence on the example's output"


def links(path):
    text = path.read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", ["README.md"] + sorted(p.name for p in DOCS.glob("*.md")))
def test_relative_links_resolve(page):
    path = README if page == "README.md" else DOCS / page
    for target in links(path):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file = (path.parent / target.split("#", 1)[0]).resolve()
        # inside the repository: a clone holds nothing beside it (the spec
        # in shared/ is named in text, not linked)
        assert file.is_relative_to(REPO.resolve()), f"{page}: link out of the repository: {target}"
        assert file.exists(), f"{page}: link to {target}"


def test_docs_index_lists_every_page():
    index = (DOCS / "README.md").read_text()
    listed = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert pages <= listed, sorted(pages - listed)
    assert listed - {"../README.md"} <= pages | {"README.md"}, sorted(listed - pages)
