import os
import shutil
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"
SHARED_TRACES = SHARED / "traces"
SHARED_PROFILES = SHARED / "profiles"
SHARED_VALIDATION = SHARED / "validation"
# CI (.ci/run) sets SLOTBENCH_CI: every dependency a test needs is installed there, so a test skipped for
# a missing one (transformers, ray, playwright, chromium, a C compiler, ../shared) fails the run. Only a
# GPU is legitimately absent.
IN_CI = bool(os.environ.get("SLOTBENCH_CI"))
ALLOWED_CI_SKIPS = ("needs a CUDA GPU",)
# Long benchmarks run only when a -m expression names them (-m soak, -m fidelity, -m speed); any other -m
# (the test command's -m 'not serial', say) combines with leaving them out.
OPT_IN_MARKERS = ("soak", "fidelity", "speed")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chosen = config.getoption("markexpr") or ""
    left_out = [i for i in items if any(i.get_closest_marker(m) and m not in chosen for m in OPT_IN_MARKERS)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [i for i in items if i not in left_out]


def _shared(path: Path, what: str) -> Path:
    if not path.is_dir():
        pytest.skip(f"{what} not found at {path} (they sit beside the checkout in CI)")
    return path


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """../shared/traces beside the checkout: present in CI, absent in a user's clone."""
    return _shared(SHARED_TRACES, "real traces")


@pytest.fixture(scope="session")
def validation() -> Path:
    """../shared/validation/vllm-h100: measured vLLM serving runs (present in CI)."""
    return _shared(SHARED_VALIDATION / "vllm-h100", "measured vLLM runs")


@pytest.fixture(scope="session")
def vidur_h100() -> Path:
    """../shared/profiles/vidur-h100: Vidur's published H100 kernel tables (present in CI)."""
    return _shared(SHARED_PROFILES / "vidur-h100", "measured kernel profiles")


@pytest.fixture(scope="session")
def h100_fit(vidur_h100):
    """(profile, stats) of the H100 tables' fit, computed once per session (~5 s each)."""
    from harness.calibrate.op_profile import fit_op_profile

    return fit_op_profile(vidur_h100, "h100")


@pytest.fixture(scope="session")
def h100_profile_file(vidur_h100, tmp_path_factory) -> Path:
    """The same fit written by the command a user runs: ``slotbench calibrate --op-profile``."""
    from tests.util import cli

    out = tmp_path_factory.mktemp("h100") / "h100.json"
    p = cli("calibrate", "--op-profile", str(vidur_h100), "--gpu", "h100", "--out", str(out))
    assert p.returncode == 0, p.stderr
    return out


@pytest.fixture(scope="session")
def chromium() -> str:
    path = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if path is None:
        pytest.skip("chromium not installed (apt-get install -y chromium)")
    return path


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """A random LlamaForCausalLM in float64, built from a config (no hub access) and saved with
    save_pretrained: (directory, the Hugging Face model)."""
    transformers = pytest.importorskip("transformers")
    import torch

    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rope_theta=10000.0, rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1,
                                   pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float64).eval()
    path = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In CI a skip for anything but a missing GPU fails the run (module-level importorskip included)."""
    if not IN_CI or os.environ.get("PYTEST_XDIST_WORKER"):  # the controller sees every worker's reports
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    bad = [r for r in skipped if not any(reason in str(r.longrepr) for reason in ALLOWED_CI_SKIPS)]
    if bad:
        for r in bad:
            print(f"\nSLOTBENCH_CI: skipped, which CI does not allow: {r.nodeid}: {r.longrepr}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
