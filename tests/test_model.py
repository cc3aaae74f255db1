import json

import numpy as np
import pytest
import torch

from strategies.config import ExecutorConfig
from strategies.runtime.models.checkpoint import config_from_hf, load_checkpoint, resolve_model_config
from strategies.runtime.models.config import PRESETS
from strategies.runtime.models.llama import build_model, script_model
from strategies.runtime.sampling_params import SamplingParams
from tests.util import make_requests, run_strategy

transformers = pytest.importorskip("transformers")


def test_checkpoint_is_safetensors_only(hf_checkpoint):
    path, _ = hf_checkpoint
    assert list(path.glob("*.safetensors")) and not list(path.glob("*.bin"))


def test_loaded_checkpoint_matches_transformers_generate(hf_checkpoint):
    path, hf_model = hf_checkpoint
    cfg = config_from_hf(json.loads((path / "config.json").read_text()), dtype="float64")
    model = script_model(load_checkpoint(path, cfg))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (5, 9, 14, 7)]
    new = 12
    specs = [(p, new, SamplingParams()) for p in prompts]  # both stop at EOS (id 2)
    reqs = make_requests(specs)
    run_strategy("inflight", cfg, model, ExecutorConfig(max_batch_size=4, max_seq_len=64), reqs)
    for p, r in zip(prompts, reqs, strict=True):
        ids = torch.tensor([p])
        ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                pad_token_id=0)
        assert r.output_token_ids == ref[0, len(p):].tolist()


def test_bad_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}))
    with pytest.raises(ValueError, match="not Llama-style"):
        resolve_model_config(str(tmp_path))
    cfg = PRESETS["tiny"]
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_checkpoint(tmp_path, cfg)


def test_unknown_model_name():
    with pytest.raises(ValueError, match="not a preset"):
        resolve_model_config("no-such-model")


def test_presets_are_seeded_and_scriptable():
    a, b = build_model(PRESETS["tiny"]), build_model(PRESETS["tiny"])
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    script_model(a)  # compiles
    assert PRESETS["small"].num_parameters > 5 * PRESETS["tiny"].num_parameters
