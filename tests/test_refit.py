"""scripts/refit recomputes the simulated device's fitted constants from the files they were fitted on: the ones
fitted to ../shared/profiles' kernel tables come out within the precision the code states them to, and the
published-table fits print. (The serving path's refit replays a measured run, ~40 s: run it by hand.)"""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLES = ROOT.parent / "shared" / "profiles" / "vidur-h100"


@pytest.mark.skipif(not TABLES.exists(), reason="needs ../shared/profiles/vidur-h100 (Vidur's H100 tables)")
def test_the_kernel_table_constants_come_out_of_their_tables():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "refit"), "--only",
                        "gemm,elementwise,nccl,allreduce,fused-moe,attention"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert sum(x.startswith("OK ") for x in lines) == 18 and not any(x.startswith("DIFF") for x in lines), p.stdout
    assert any(x.startswith("FIT  fused MoE") for x in lines) and any(x.startswith("SKIP attention") for x in lines)
    assert lines[-1] == "0 constant(s) moved past their tolerance"


def test_a_bad_group_is_one_line_exit_2():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "refit"), "--only", "nonsense"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "groups are" in p.stderr and "Traceback" not in p.stderr
