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
