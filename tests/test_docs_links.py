"""README.md and docs/*.md: every relative link resolves, the README stays short, every docs page is linked.

Pure text, no imports of the project. A link is `[text](target)` (or an image, `![alt](target)`) outside fenced
code blocks and inline code; http(s):// and mailto: targets are not checked. A target names a file or folder
relative to the page that links it; `#anchor` (alone, or after a .md file) must name a heading of that page,
slugged as GitHub slugs it: lowercase, punctuation other than '-' and '_' removed, each space a '-', and the
n-th repeat of a slug given the suffix -n.
"""
import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_WORDS = 1500

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'][^)]*[\"'])?\s*\)")
INLINE_CODE = re.compile(r"(`+).*?\1")
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    out, fence = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None and m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) \
                and not line.strip().strip(fence[0]):
            fence = None
        elif fence is None:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (its links and inline code read as their text)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    """The relative link targets of a page, in order."""
    out = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            target = m.group(1)
            if not re.match(r"(?i)(https?:|mailto:)", target):
                out.append(target)
    return out


def broken(path: Path, target: str) -> str | None:
    """Why `target`, linked from `path`, does not resolve (None if it does)."""
    file_part, _, anchor = target.partition("#")
    dest = (path.parent / unquote(file_part)).resolve() if file_part else path
    if not dest.exists():
        return f"{dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} does not exist"
    if anchor:
        if dest.is_dir() or dest.suffix.lower() != ".md":
            return "an anchor into something other than a Markdown page"
        if unquote(anchor).lower() not in anchors(dest):
            return f"no heading of {dest.relative_to(ROOT)} has the anchor #{anchor}"
    return None


def test_the_slug_rule():
    assert slug("Two commands") == "two-commands"
    assert slug("Benchmarking it: bench_serve.py") == "benchmarking-it-bench_servepy"
    assert slug("vLLM's benchmark client against it") == "vllms-benchmark-client-against-it"
    assert slug("Going further: the real system") == "going-further-the-real-system"
    assert slug("`serve.py` and [the API](engine.md)") == "servepy-and-the-api"


def test_duplicate_headings_get_suffixes(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A\n## Notes\n```\n## Notes\n```\n## Notes\n### Notes\n")
    assert anchors(page) == {"a", "notes", "notes-1", "notes-2"}


def test_links_in_code_are_not_links(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[a](a.md) `[b](b.md)` [c](https://x.org) [d](mailto:x@y.z)\n```\n[e](e.md)\n```\n"
                    "![f](f.png \"title\")\n")
    assert links(page) == ["a.md", "f.png"]


def test_every_relative_link_resolves():
    bad = [f"{p.relative_to(ROOT)}: ({t}) {why}" for p in pages() for t in links(p) if (why := broken(p, t))]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_readme_is_short():
    words = len(README.read_text(encoding="utf-8").split())
    assert words <= MAX_README_WORDS, f"README.md has {words} words; at most {MAX_README_WORDS} (move text to docs/)"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / unquote(t.partition("#")[0])).resolve() for t in links(README) if t.partition("#")[0]}
    docs = sorted(DOCS.glob("*.md"))
    assert docs, "docs/ has no pages"
    missing = [p.name for p in docs if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_every_docs_page_starts_with_a_title():
    untitled = [p.name for p in sorted(DOCS.glob("*.md"))
                if not p.read_text(encoding="utf-8").startswith("# ")]
    assert not untitled, f"docs pages that do not start with a '# Title': {untitled}"
