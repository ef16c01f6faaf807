"""README.md stands alone in a fresh clone: every path it names is inside the repository,
and its first example runs as written."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# System paths the README may name: they exist on any Linux host, not in a checkout.
SYSTEM_PATHS = ("/dev/shm", "/proc/", "/var/lib/tensorkv")  # the last: the image's state directory
# A path-like token: something/with/slashes, optionally starting with ./, ../ or /.
_PATH = re.compile(r"(?<![\w:/.-])(?:\.{1,2}/|/)?[\w.-]+(?:/[\w.*-]+)+/?")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _named_paths(text):
    """The path-like tokens of ``text``'s code spans, code blocks and link targets (URLs left out)."""
    spans = re.findall(r"```.*?```|`[^`\n]+`", text, flags=re.S) + _LINK.findall(text)
    for span in spans:
        for token in _PATH.findall(span):
            if "://" not in span or token not in span.split("://", 1)[1]:
                yield token


def test_readme_names_no_path_outside_the_repository():
    outside = []
    for token in set(_named_paths(README)):
        if token.startswith("/"):
            if not token.startswith(SYSTEM_PATHS):
                outside.append(token)
        elif not Path(os.path.normpath(ROOT / token)).is_relative_to(ROOT):  # .venv/bin/python is a link out
            outside.append(token)
    assert outside == [], f"README.md names paths outside the repository: {sorted(outside)}"


def test_readme_links_point_at_files_of_the_repository():
    targets = [t.split("#")[0] for t in _LINK.findall(README) if "://" not in t and not t.startswith("#")]
    assert targets, "the README links to docs in the repository"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert missing == []


def test_the_path_check_is_not_vacuous():
    assert "../shared/container/setup.sh" in set(_named_paths("run `../shared/container/setup.sh` first"))
    assert "/work/main/x.py" in set(_named_paths("```sh\npython /work/main/x.py\n```"))


def test_first_example_runs_as_written(tmp_path):
    example = re.search(r"```python\n(.*?)```", README, flags=re.S).group(1)
    result = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "[[4. 4. 4.]" in result.stdout and "[[3.9 3.9 3.9]" in result.stdout
