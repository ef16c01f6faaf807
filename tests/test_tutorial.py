"""examples/tutorial.py prints MXNet's KVStore tutorial transcript exactly."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_tutorial_prints_mxnets_transcript():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "tutorial.py")],
                            capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout == (ROOT / "tests" / "data" / "tutorial_expected.txt").read_text()
    assert result.stderr == ""
