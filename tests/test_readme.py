"""README.md stands alone in a fresh clone: every path it names is inside the repository,
and its first example runs as written. The same path checks follow what moved out of it into
docs/ (operations, failures, benchmarks), whose links are relative to docs/."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# The README and the pages that hold what moved out of it; code spans name paths from the root.
PAGES = ["README.md", "docs/operations.md", "docs/failures.md", "docs/benchmarks.md"]
# System paths the README may name: they exist on any Linux host, not in a checkout.
SYSTEM_PATHS = ("/dev/shm", "/proc/", "/var/lib/tensorkv")  # the last: the image's state directory
# A path-like token: something/with/slashes, optionally starting with ./, ../ or /.
_PATH = re.compile(r"(?<![\w:/.-])(?:\.{1,2}/|/)?[\w.-]+(?:/[\w.*-]+)+/?")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _named_paths(text, base=ROOT):
    """The path-like tokens of ``text``'s code spans, code blocks and link targets (URLs left
    out), each with the directory it is relative to: the root for code, ``base`` for links."""
    spans = [(span, ROOT) for span in re.findall(r"```.*?```|`[^`\n]+`", text, flags=re.S)] + \
        [(link, base) for link in _LINK.findall(text)]
    for span, where in spans:
        for token in _PATH.findall(span):
            if "://" not in span or token not in span.split("://", 1)[1]:
                yield token, where


@pytest.mark.parametrize("page", PAGES)
def test_readme_names_no_path_outside_the_repository(page):
    outside = []
    for token, where in set(_named_paths((ROOT / page).read_text(), (ROOT / page).parent)):
        if token.startswith("/"):
            if not token.startswith(SYSTEM_PATHS):
                outside.append(token)
        elif not Path(os.path.normpath(where / token)).is_relative_to(ROOT):  # .venv/bin/python is a link out
            outside.append(token)
    assert outside == [], f"{page} names paths outside the repository: {sorted(outside)}"


@pytest.mark.parametrize("page", PAGES)
def test_readme_links_point_at_files_of_the_repository(page):
    text = (ROOT / page).read_text()
    targets = [t.split("#")[0] for t in _LINK.findall(text) if "://" not in t and not t.startswith("#")]
    assert targets, f"{page} links to docs in the repository"
    missing = [t for t in targets if not (ROOT / page).parent.joinpath(t).exists()]
    assert missing == []


def test_the_readme_keeps_what_a_newcomer_needs_and_links_the_rest():
    """The two commands, a short README (it was 45 KB of benchmark history), its benchmark
    table from a named `make bench` run, and links to the pages that hold the rest."""
    assert "make run " in README and "make test " in README
    assert len(README) < 16_000
    assert re.search(r"Output of\s+`make bench` on .* run on\s+\d{4}-\d\d-\d\d on commit [0-9a-f]{7}", README, re.S)
    assert "| push+pull 4 MiB | GB/s | same-host |" in README
    for page in PAGES[1:]:
        assert f"]({page})" in README


def test_the_path_check_is_not_vacuous():
    assert ("../shared/container/setup.sh", ROOT) in set(_named_paths("run `../shared/container/setup.sh` first"))
    assert ("/work/main/x.py", ROOT) in set(_named_paths("```sh\npython /work/main/x.py\n```"))


def test_first_example_runs_as_written(tmp_path):
    example = re.search(r"```python\n(.*?)```", README, flags=re.S).group(1)
    result = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "[[4. 4. 4.]" in result.stdout and "[[3.9 3.9 3.9]" in result.stdout
