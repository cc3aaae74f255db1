"""Measured GEMM times kept by a profile fitted to kernel tables (strategies/runtime/sim/gemm_table.py),
checked against Vidur's H100 table (../shared/profiles/vidur-h100) at token counts the profile never saw."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.calibrate.op_profile import load_op_tables
from harness.step_cost import parse_pieces
from strategies.runtime.batch import BatchWork
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.sim.build import cost_model
from strategies.runtime.sim.config import SimConfig
from strategies.runtime.sim.cost import CostModel
from strategies.runtime.sim.gemm_table import gemm_key
from strategies.runtime.sim.kernels import GEMMS
from strategies.runtime.sim.profile import DeviceProfile
from tests.util import cli

pytestmark = pytest.mark.xdist_group("gemm-table")  # one worker: its module fixture is built once

# The table's model: Llama-2-7B's layer shapes in fp16 (vocab and depth do not enter a GEMM's key)
SPEC = ModelConfig(vocab_size=32768, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=32, intermediate_size=11008, dtype="float16")


def gemm_seconds(profile: DeviceProfile, tokens: int, tp: int) -> dict[str, float]:
    """One launch of each of a layer's GEMMs, as a simulated step prices it."""
    cm = CostModel(SPEC, profile, tp)
    terms = [t for t in cm.terms(BatchWork(tokens, 1, 0, 0, tokens)) if t.phase == "linear"]
    return {name: t.seconds(profile) / t.count for name, t in zip(cm.gemms, terms, strict=True)}


def test_a_table_prices_the_shapes_it_measured_and_no_other():
    sheet = DeviceProfile.for_gpu("h100")
    key = gemm_key("mlp_up_proj", 4096, 22016, 1, 2)
    table = replace(sheet, gemm_table={key: [[1, 512, 576, 4096], [64e-6, 134e-6, 160e-6, 999e-6]]})
    at = {n: gemm_seconds(table, n, 1)["mlp_up_proj"] for n in (1, 512, 544, 576, 4096, 8192)}
    assert (at[1], at[512], at[576], at[4096]) == (64e-6, 134e-6, 160e-6, 999e-6)
    assert at[544] == 160e-6  # between two counts: what the next one up measured (the end of its tile)
    sheet_8192, sheet_4096 = (gemm_seconds(sheet, n, 1)["mlp_up_proj"] for n in (8192, 4096))
    assert at[8192] / at[4096] == pytest.approx(sheet_8192 / sheet_4096)  # past it: the roofline's growth
    assert gemm_seconds(table, 512, 2) == gemm_seconds(sheet, 512, 2)  # another TP: other shapes on a rank
    assert gemm_seconds(table, 512, 1)["mlp_down_proj"] == gemm_seconds(sheet, 512, 1)["mlp_down_proj"]
    with pytest.raises(ValueError, match="gemm_table"):
        replace(sheet, gemm_table={key: [[512, 1], [1e-6, 2e-6]]})  # token counts out of order


@pytest.fixture(scope="module")
def half_table(vidur_h100, tmp_path_factory):
    """A profile fitted through the CLI to every other token count of the H100 table (1, 4, 16, 32, ...,
    1,024, 1,056, ...): (its file, calibrate's report, the counts left out)."""
    table = pd.read_csv(vidur_h100 / "llama-2-7b-mlp.csv")
    counts = np.sort(table["num_tokens"].unique())
    kept, left_out = counts[::2], counts[1::2]
    half = tmp_path_factory.mktemp("half")
    table[table["num_tokens"].isin(kept)].to_csv(half / "mlp.csv", index=False)
    out = half / "p.json"
    p = cli("calibrate", "--op-profile", str(half), "--gpu", "h100", "--out", str(out))
    assert p.returncode == 0, p.stderr
    return out, json.loads(p.stdout[:p.stdout.rindex("wrote")])["gemm_table"], set(left_out.tolist())


def test_the_table_predicts_token_counts_it_never_saw(vidur_h100, half_table):
    """Fitted to every other token count, the profile prices the counts it lacks within 5% (median over the
    16 GEMM shapes; seen 0.7%), where the roofline fitted to the same rows is not (seen 5.9%): cuBLAS's
    kernel choice moves a GEMM in steps (an up-projection: 71 us at 128 tokens, 126 us at 136) that a
    roofline's smooth curve cannot follow."""
    path, reported, left_out = half_table
    profile = DeviceProfile.load(path)
    assert len(profile.gemm_table) == 16 and reported["shapes"] == 16

    ops, _ = load_op_tables(vidur_h100)
    unseen = ops[ops["op"].isin(GEMMS) & ops["num_tokens"].isin(left_out)]
    unseen = unseen.groupby(["op", "tp", "num_tokens"], as_index=False)["measured_s"].median()
    pred = [gemm_seconds(profile, int(r.num_tokens), int(r.tp))[r.op] for r in unseen.itertuples()]
    error = float(np.median(np.abs(np.array(pred) / unseen["measured_s"].to_numpy() - 1)))
    assert error <= 0.05, error
    # calibrate's own check on what it was given: every fourth count pricing the others (seen 2.6%)
    assert reported["heldout_median_error"] <= 0.05


def test_step_cost_follows_the_measured_staircase_at_counts_it_never_saw(vidur_h100, half_table, tmp_path):
    """Through the CLI a user runs: a step of the table's model (a Llama-2-7B config.json at TP 2), under
    the profile fitted to every other count, costs 32 layers x what the H100 measured at 504 and 520 tokens
    (two counts the fit never saw) within 5%, and keeps the table's 1.33x step between them (cuBLAS's next
    tile), where the datasheet's roofline moves smoothly (1.02x)."""
    path, _, left_out = half_table
    assert {504, 520} <= left_out
    model = tmp_path / "llama-2-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "torch_dtype": "float16"}))
    ops, _ = load_op_tables(vidur_h100)
    measured = ops[ops["op"].isin(GEMMS) & (ops["tp"] == 2)].groupby(["num_tokens", "op"])["measured_s"].median()

    def linear_ms(tokens: int, profile: Path | None) -> float:
        """What ``slotbench step-cost`` prints, from the function it calls (the CLI itself: once, below)."""
        sim = SimConfig(gpu="h100", model_spec=str(model), tp=2, profile=str(profile) if profile else None)
        return cost_model(sim).phases(parse_pieces([], [str(tokens)]))["linear"] * 1e3

    p = cli("step-cost", "--gpu", "h100", "--model-spec", str(model), "--tp", "2", "--prefill", "504",
            "--profile", str(path))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["phases"]["linear"] == pytest.approx(linear_ms(504, path), rel=1e-12)
    fitted = {n: linear_ms(n, path) for n in (504, 520)}
    for n in (504, 520):
        assert fitted[n] == pytest.approx(32 * measured[n].sum() * 1e3, rel=0.05)
    measured_jump = measured[520].sum() / measured[504].sum()
    assert fitted[520] / fitted[504] == pytest.approx(measured_jump, rel=0.05)
