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


def infersim_table(directory: Path, eff_flops: float) -> Path:
    """Prefill and decode tables in InferSim's layout (bench_data/mha/{prefill,decode}/h100/, a file a head shape,
    µs), priced by Hopper's profile with prefill at ``eff_flops``: what the attention-h100 group must read back."""
    from dataclasses import replace

    from strategies.runtime.sim.attention import decode_attention_s, prefill_attention_s
    from strategies.runtime.sim.profile import DeviceProfile

    p = replace(DeviceProfile.for_gpu("h100"), attn_eff_flops=eff_flops)
    mha = directory / "bench_data" / "mha"
    (mha / "prefill" / "h100").mkdir(parents=True)
    (mha / "decode" / "h100").mkdir(parents=True)
    for heads, kv_heads in ((28, 4), (32, 32), (64, 8)):
        rows = [f"bf16,{n},{(prefill_attention_s(p, [(n, n)], heads, 128) + p.attn_kernel_s) * 1e6:.3f},0.5"
                for n in (1024, 4096, 8192, 16384, 32768)]
        (mha / "prefill" / "h100" / f"{heads}-{kv_heads}-128.csv").write_text(
            "dtype,seq_len,latency_us,mfu\n" + "\n".join(rows) + "\n")
        secs = {(b, kv): decode_attention_s(p, b, b * kv, kv_heads // 2, 128, 2) + p.attn_kernel_s
                for b in (16, 64, 256) for kv in (1024, 4096)}
        rows = [f"bf16,bf16,{b},{kv},{s * 1e6:.3f},0" for (b, kv), s in secs.items()]
        (mha / "decode" / "h100" / f"{heads}-{kv_heads}-128-tp2.csv").write_text(
            "dtype,kv_dtype,batch_size,kv_len,latency_us,mfu\n" + "\n".join(rows) + "\n")
    return directory


def refit_attention_h100(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "refit"), "--only", "attention-h100", *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize(("eff", "rc"), [(0.761, 0), (0.6, 1)])
def test_the_hopper_prefill_constants_refit_from_an_infersim_table(tmp_path, eff, rc):
    """The attention-h100 group reads InferSim's table layout (the 1,024-token rows, under its 100 us floor, left
    out) and fits Hopper's prefill FLOP rate: a table priced at the code's 76% reads back OK, one at 60% says DIFF
    and exits 1; the decode table is checked against the code's parameters (it prices them: 0.0%)."""
    p = refit_attention_h100("--inference-sim", str(infersim_table(tmp_path, eff)))
    assert p.returncode == rc, p.stdout + p.stderr
    assert ("DIFF HOPPER_ATTENTION[attn_eff_flops]" in p.stdout) == bool(rc), p.stdout
    assert "(prefill: 12 rows of 100 us or more" in p.stdout, p.stdout
    assert "CHECK decode, the code's parameters: median |error| 0.0% over 18 rows" in p.stdout, p.stdout


def test_a_bad_infersim_checkout_is_one_line_exit_2(tmp_path):
    p = refit_attention_h100("--inference-sim", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and "no bench_data/mha/prefill/h100" in p.stderr and "Traceback" not in p.stderr
    (tmp_path / "bench_data" / "mha" / "prefill" / "h100").mkdir(parents=True)
    (tmp_path / "bench_data" / "mha" / "prefill" / "h100" / "32-32-128.csv").write_text("a,b\n1,2\n")
    p = refit_attention_h100("--inference-sim", str(tmp_path))
    assert p.returncode == 2 and "lacks ['latency_us', 'seq_len']" in p.stderr and "Traceback" not in p.stderr
    assert refit_attention_h100().stdout.startswith("SKIP attention-h100: needs --inference-sim DIR")
