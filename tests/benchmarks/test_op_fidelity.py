"""Whole steps against measured H100 kernels: for decode (batch 1-256), prefill (512-4096 tokens) and TP=4
steps of Llama-2-7B's shapes, the time of everything Vidur's H100 tables cover (the four GEMMs, the
element-wise kernels and the embedding gather of 32 layers; with TP, two all-reduces a layer) as
measured, against the cost model's phases for the same work — with the datasheet profile and with the
profile fitted to those tables. Attention and the LM head are not in the tables and are left out.

A second test sums whole A100 and A40 steps with attention, mixed prefill+decode steps included, from
samples of Vidur's tables in tests/data.

Prints the tables; asserts a median error within 10% for both profiles (the datasheet's goal). The
fitted profile is priced by its roofline alone, without the measured GEMMs it keeps (sim/gemm_table.py),
which would price these steps' GEMMs with their own rows; tests/test_gemm_table.py checks those on token
counts they lack. Its goal (5%) is printed beside its figure, not asserted: it was fitted to single
kernels with equal weight, and whole steps are dominated by the large GEMMs (seen: datasheet 6.1%,
fitted 6.5%; both 11-13% high on 512-2048-token prefills, 17% low on TP-4 decode at batch 32, whose 64
small all-reduces scatter most in the tables; docs/simulator.md).
"""

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from harness.calibrate.op_profile import load_op_tables
from harness.step_cost import _ROW
from strategies.runtime.batch import BatchWork, ContextChunk, ScheduledBatch
from strategies.runtime.models.config import ModelConfig
from strategies.runtime.sim.cost import CostModel
from strategies.runtime.sim.kernels import ELEMENTWISE, GEMMS
from strategies.runtime.sim.profile import DeviceProfile
from tests.util import data_rows

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


@pytest.mark.xdist_group("h100-fit")  # the H100 fit (conftest) is computed once
def test_whole_steps_against_measured_h100_kernels(vidur_h100, h100_fit, benchmark):
    benchmark(lambda: None)  # a table, not a timing
    ops, ar = load_op_tables(vidur_h100)
    fitted, _ = h100_fit
    fitted = replace(fitted, gemm_table=None)
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


# Whole steps with attention, mixed ones included, on the A100 and the A40 (no default was read off an
# A40 table; the attention defaults were fitted to A100 attention rows): (prefill chunks as (tokens,
# cached), decode groups as (rows, cached)), every piece a measured row of tests/data.
WHOLE_STEPS = {
    "a100": [((), ((128, 2368),)), ((), ((40, 2432),)), ((), ((32, 864),)), ((), ((64, 864),)),
             ((), ((120, 832),)), (((1024, 1024),), ()), (((1024, 0),), ((32, 864),)),
             (((256, 2048),), ((64, 864),)), (((288, 512),), ((120, 832),)), (((1024, 2048),), ((16, 2432),)),
             (((256, 3072),), ((40, 2432),)), (((1024, 3072),), ((32, 2432),))],
    "a40": [((), ((128, 2432),)), ((), ((96, 832),)), ((), ((32, 864),)), ((), ((8, 2496),)), ((), ((120, 832),)),
            (((1024, 1024),), ()), (((320, 2048),), ()), (((1024, 0),), ((32, 864),)), (((320, 2048),), ((48, 864),)),
            (((320, 1024),), ((96, 832),)), (((992, 2048),), ((16, 864),)), (((320, 3072),), ((128, 2432),)),
            (((992, 3072),), ((48, 864),)), (((320, 512),), ((120, 832),))],
}


def test_whole_steps_with_attention_against_measured_a100_and_a40_kernels(benchmark):
    """Llama-2-7B's 32 layers of measured GEMMs, element-wise kernels and gather plus measured attention,
    for decode, prefill and mixed steps (a 256-1,024-token chunk after 0-3,072 cached tokens beside 16-128
    decode rows; attention 15-89% of the step), against the datasheet profile's phases for the same work.
    Seen: median 2.4% (A100) and 4.1% (A40), worst 6.8% and 9.2%; with attention priced as the roofline
    this model replaced, worst 20% and 16%."""
    benchmark(lambda: None)  # a table, not a timing
    attention = {(r["gpu"], r["kind"], int(r["batch"]), int(r["chunk"]), int(r["kv"])): float(r["ms"]) / 1e3
                 for r in data_rows("vidur_attention.csv") if r["model"] == "llama-2-7b" and r["tp"] == "1"}
    mlp = {(r["gpu"], int(r["num_tokens"]), r["op"]): float(r["ms"]) / 1e3 for r in data_rows("vidur_mlp_sample.csv")}
    out = []
    for gpu, steps in WHOLE_STEPS.items():
        sheet = DeviceProfile.for_gpu(gpu)
        old = replace(sheet, gpu=replace(sheet.gpu, sms=0), attn_eff_flops=0.5)  # the previous attention model
        for pre, dec in steps:
            batch = ScheduledBatch(0)
            batch.context = [ContextChunk(_ROW, kv, n, True) for n, kv in pre]
            for rows, kv in dec:
                for _ in range(rows):
                    batch.add_generation(_ROW, kv)
            work = batch.work()
            layer = sum(mlp[gpu, work.tokens, op] for op in GEMMS) + sum(
                mlp[gpu, work.tokens, op] * n for op, (_, _, n) in ELEMENTWISE.items())
            layer += sum(attention[gpu, "p", 1, n, kv] for n, kv in pre)
            layer += sum(attention[gpu, "d", rows, 0, kv] for rows, kv in dec)
            measured = LAYERS * layer + mlp[gpu, work.tokens, "emb"]
            row = {"gpu": gpu, "step": f"prefill {list(pre)} decode {list(dec)}", "measured_ms": measured * 1e3}
            for name, p in (("rounds", sheet), ("roofline", old)):
                phases = CostModel(SPEC, p).phases(work)
                predicted = sum(phases[k] for k in (*COVERED[:3], "attention")) - LAYERS * p.kernel_s  # KV write
                row[f"{name}_error"] = predicted / measured - 1
            out.append(row)
    table = pd.DataFrame(out)
    print("\n" + table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    for gpu, rows in table.groupby("gpu"):
        rounds, flat = rows["rounds_error"].abs(), rows["roofline_error"].abs()
        print(f"{gpu}: median |error| {rounds.median():.1%} (max {rounds.max():.1%}); "
              f"attention as a roofline {flat.median():.1%} (max {flat.max():.1%})")
        assert rounds.median() <= 0.10 and rounds.max() <= 0.15, gpu
