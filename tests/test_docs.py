"""The documentation site (``docs/``, ``mkdocs.yml``) builds with ``--strict``: a broken link, a missing anchor or a
page left out of the navigation fails the tests. The README's links point at pages that exist."""

import re
import subprocess
import sys

from conftest import ROOT


def test_the_docs_site_builds_strictly(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "agents" / "index.html").is_file()


def test_the_readme_links_to_pages_that_exist():
    links = re.findall(r"\]\((docs/[^)#]+)", (ROOT / "README.md").read_text())
    assert len(links) >= 15
    assert [link for link in links if not (ROOT / link).is_file()] == []
