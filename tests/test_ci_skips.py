"""CI (`pytest --fail-on-skip`, see .ci/run) fails when a test skips for a reason that is not allow-listed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from conftest import OPTIONAL_SKIPS

TESTS = Path(__file__).resolve().parent

SAMPLE = '''
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason="transformers v5 API")
def test_version_gated():
    pass

def test_needs_data():
    pytest.skip("real data not found at /nowhere")
'''


def run_sample(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args, str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_an_unlisted_skip_fails_the_run_and_is_named(tmp_path):
    proc = run_sample(tmp_path, "--fail-on-skip")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    unexpected = proc.stdout.split("skips not in OPTIONAL_SKIPS")[1]
    assert "test_sample.py::test_needs_data: real data not found at /nowhere" in unexpected
    assert "test_version_gated" not in unexpected.split("short test summary")[0]


def test_allow_listed_skips_pass(tmp_path):
    (tmp_path / "keep").mkdir()
    proc = run_sample(tmp_path / "keep", "--fail-on-skip", "-k", "not needs_data")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "SKIPPED [1]" in proc.stdout and "transformers v5 API" in proc.stdout  # -rs shows the reason


def test_every_allowed_skip_is_one_a_test_really_uses():
    sources = "".join(p.read_text() for p in TESTS.glob("test_*.py") if p.name != Path(__file__).name)
    for reason, why in OPTIONAL_SKIPS.items():
        assert f'reason="{reason}' in sources, reason
        assert why, reason
