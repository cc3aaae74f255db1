import os
import shutil
from pathlib import Path

import pytest

SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """../shared/traces beside the checkout: present in CI, absent in a user's clone."""
    if not SHARED_TRACES.is_dir():
        if os.environ.get("SLOTBENCH_REQUIRE_SHARED"):
            pytest.fail(f"{SHARED_TRACES} is missing but SLOTBENCH_REQUIRE_SHARED is set")
        pytest.skip(f"real traces not found at {SHARED_TRACES} (they sit beside the checkout in CI)")
    return SHARED_TRACES


@pytest.fixture(scope="session")
def chromium() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if path is None:
        if os.environ.get("SLOTBENCH_REQUIRE_BROWSER"):
            pytest.fail("chromium is missing but SLOTBENCH_REQUIRE_BROWSER is set")
        pytest.skip("chromium not installed (apt-get install -y chromium)")
    return path
