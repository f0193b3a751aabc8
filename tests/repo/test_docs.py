"""The documentation names only what exists: every repository path in a backticked span, a code
block or a markdown link of the docs resolves, every link's #anchor is a heading of its target,
and the front page and the kernel docs keep their length limits. Reads text only: no build."""

import functools
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    [
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        ROOT / "scripts" / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "bench").glob("*.md"),
    ]
)
# A token is read as a repository path when it starts with one of these.
REPO_DIRS = ("bench/", "capsroute/", "csrc/", "docs/", "scripts/", "tests/", ".ci/")
# Written by the build, so absent from a fresh clone.
GENERATED = {"capsroute/_build_config.py"}
# docs/adding-an-op.md names the files of a new op `foo`.
PLACEHOLDER = re.compile(r"(?<![a-z])foo(?![a-z])")

CODE_BLOCK = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *$", re.M)
TOKEN_END = ".,;:)'\""


def named_paths(text: str) -> set[str]:
    """The repository paths in the code spans and code blocks of a markdown text."""
    blocks = CODE_BLOCK.findall(text)
    spans = CODE_SPAN.findall(CODE_BLOCK.sub("", text))
    paths = set()
    for token in " ".join(blocks + spans).split():
        token = token.strip(TOKEN_END).split("::")[0].split("#")[0]
        placeholder = re.search(r"[<>{}$]", token) or PLACEHOLDER.search(token)
        if token.startswith(REPO_DIRS) and not placeholder:
            paths.add(token)
    return paths


def path_exists(path: str) -> bool:
    if path in GENERATED:
        return True
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


@functools.cache
def anchors(markdown: Path) -> set[str]:
    """GitHub's anchors of the headings: lower case, punctuation dropped, spaces as hyphens,
    repeats numbered."""
    seen: dict[str, int] = {}
    result = set()
    for heading in HEADING.findall(CODE_BLOCK.sub("", markdown.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        result.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return result


def broken_links(doc: Path) -> list[str]:
    """The links of `doc` to a missing file or to a missing heading."""
    broken = []
    for target in LINK.findall(CODE_BLOCK.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (doc.parent / file).resolve() if file else doc
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(target)
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(ROOT)))
def test_named_paths_exist(doc):
    missing = sorted(p for p in named_paths(doc.read_text()) if not path_exists(p))
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(ROOT)))
def test_links_resolve(doc):
    broken = broken_links(doc)
    assert not broken, f"{doc.relative_to(ROOT)} has broken links: {broken}"


# The docs may not name the developers' shared data folder, which users do not have.
@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(ROOT)))
def test_docs_do_not_name_the_shared_folder(doc):
    assert "../shared" not in doc.read_text(), f"{doc.relative_to(ROOT)} names ../shared"


def test_length_limits():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    assert len((ROOT / "docs" / "kernels.md").read_text().splitlines()) <= 300


def test_license_and_no_notebook():
    assert (ROOT / "LICENSE").is_file()
    assert not (ROOT / "bench" / "NOTES.md").exists(), "bench/NOTES.md is docs/kernels.md now"


def test_checks_catch_stale_names(tmp_path):
    """The checks themselves: a missing path, a missing file and a missing heading are found."""
    assert named_paths("see `csrc/cpu/no_such_kernel.cpp` and\n```\nbash scripts/test.sh\n```") == {
        "csrc/cpu/no_such_kernel.cpp",
        "scripts/test.sh",
    }
    assert not path_exists("csrc/cpu/no_such_kernel.cpp") and path_exists("scripts/test.sh")
    doc = tmp_path / "doc.md"
    (tmp_path / "other.md").write_text("# The `cuda_check.sh` session\n## Same\n## Same\n")
    doc.write_text(
        "[a](other.md#the-cuda_checksh-session) [b](other.md#same-1) [c](gone.md) "
        "[d](other.md#nowhere) [e](https://example.org/x)"
    )
    assert broken_links(doc) == ["gone.md", "other.md#nowhere"]


@pytest.mark.parametrize(
    "name",
    [
        "squash",
        "dynamic_routing",
        "dense_capsules",
        "em_routing",
        "em_routing_pose",
        "self_attention_routing",
        "inverted_attention_routing",
        "dense_self_attention_routing",
        "dense_inverted_attention_routing",
        "dense_inverted_attention_routing_pose",
    ],
)
def test_op_docstrings_explain_every_argument(name):
    """help(capsroute.<op>) is enough to call it: every parameter is described."""
    import capsroute

    fn = getattr(capsroute, name)
    missing = [p for p in inspect.signature(fn).parameters if p not in (fn.__doc__ or "")]
    assert not missing, f"capsroute.{name}'s docstring does not describe {missing}"
