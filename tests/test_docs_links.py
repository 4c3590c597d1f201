"""Every relative link in README.md and docs/*.md (and launch/README.md, which they link to) leads
somewhere: the file exists, and a `#anchor` names a heading of that Markdown file, spelled as
GitHub spells heading anchors. Links to web addresses are not fetched.
"""

from __future__ import annotations

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = ["README.md", "launch/README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))

# [text](target) and ![alt](target), an optional "title" after the target.
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*```.*?^\s*```[^\n]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> str:
    """The text with fenced blocks and code spans blanked (a link or heading there is code)."""
    return _CODE_SPAN.sub("``", _FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup and punctuation dropped, lower case, spaces to
    hyphens (underscores and hyphens kept)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown document's headings (a repeated one gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(text: str) -> list[str]:
    """The targets of the links and images in prose that are not web addresses."""
    return [t for t in _LINK.findall(_prose(text))
            if t and not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def broken_links(path: str) -> list[str]:
    """'target: why' for every relative link of the Markdown file at `path` that leads nowhere."""
    with open(path) as f:
        text = f.read()
    broken = []
    for target in relative_links(text):
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        if not os.path.exists(dest):
            broken.append(f"{target}: no file {os.path.relpath(dest, ROOT)}")
        elif anchor and dest.endswith(".md"):
            with open(dest) as f:
                if anchor not in anchors(f.read()):
                    broken.append(f"{target}: no heading #{anchor} in {os.path.relpath(dest, ROOT)}")
    return broken


def test_the_slugs_are_githubs():
    assert github_slug("Checkpoints: save, resume, preemption") == "checkpoints-save-resume-preemption"
    assert github_slug("Ring attention on issue 12's work: impl x layout (`bench_ring.py`)") == \
        "ring-attention-on-issue-12s-work-impl-x-layout-bench_ringpy"
    assert anchors("# A\n```bash\n# not a heading\n```\n## A\n") == {"a", "a-1"}


def test_the_checker_finds_a_bad_link(tmp_path):
    """A tiny document with one good and three bad links: the checker names exactly the bad ones."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    (tmp_path / "pic.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[good](other.md#a-section) ![img](pic.png) [self](#page) "
                    "[web](https://example.com/x.md)\n\n"
                    "[missing](nowhere.md) [bad anchor](other.md#no-such) ![gone](gone.png)\n\n"
                    "`[in code](not_checked.md)`\n\n```\n[in a block](not_checked.md)\n```\n")
    assert broken_links(str(page)) == [
        "nowhere.md: no file " + os.path.relpath(str(tmp_path / "nowhere.md"), ROOT),
        "other.md#no-such: no heading #no-such in " + os.path.relpath(str(tmp_path / "other.md"), ROOT),
        "gone.png: no file " + os.path.relpath(str(tmp_path / "gone.png"), ROOT),
    ]


@pytest.mark.parametrize("doc", DOCUMENTS)
def test_every_relative_link_resolves(doc):
    assert broken_links(os.path.join(ROOT, doc)) == []
