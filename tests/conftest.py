import os
import shutil
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"
SHARED_TRACES = SHARED / "traces"
SHARED_PROFILES = SHARED / "profiles"


def _shared(path: Path, what: str) -> Path:
    if not path.is_dir():
        if os.environ.get("SLOTBENCH_REQUIRE_SHARED"):
            pytest.fail(f"{path} is missing but SLOTBENCH_REQUIRE_SHARED is set")
        pytest.skip(f"{what} not found at {path} (they sit beside the checkout in CI)")
    return path


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """../shared/traces beside the checkout: present in CI, absent in a user's clone."""
    return _shared(SHARED_TRACES, "real traces")


@pytest.fixture(scope="session")
def vidur_h100() -> Path:
    """../shared/profiles/vidur-h100: Vidur's published H100 kernel tables (present in CI)."""
    return _shared(SHARED_PROFILES / "vidur-h100", "measured kernel profiles")


@pytest.fixture(scope="session")
def chromium() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if path is None:
        if os.environ.get("SLOTBENCH_REQUIRE_BROWSER"):
            pytest.fail("chromium is missing but SLOTBENCH_REQUIRE_BROWSER is set")
        pytest.skip("chromium not installed (apt-get install -y chromium)")
    return path
