"""No scripted device code reads a tensor back to the host. On CUDA each such op is a sync inside the step
(the host waits for the device), and overlap stops overlapping; on the CPU nothing shows it, so the graphs
are read instead: every TorchScript graph the device runs — the Llama step, BART's encoder and decoder
steps, a pipeline stage's step, decoder-state admission, the sampler and beam search — inlined, searched
for the ops that need a value on the host. (A shape read, ``prim::size``, is host metadata and allowed.)
``scripts/gpu-check`` runs whole strategies under CUDA's sync debug mode for the ops a graph cannot show.
"""

from __future__ import annotations

import pytest
import torch

from strategies.runtime.decoder import state as decoder_state
from strategies.runtime.decoder.accept import accept_drafts
from strategies.runtime.decoder.beam_search import beam_step
from strategies.runtime.models.bart import build_bart
from strategies.runtime.models.config import PRESETS
from strategies.runtime.models.llama import build_model, script_model
from strategies.runtime.pipeline.stage_model import StageModel

# ops whose result is a host value, or whose output size depends on tensor values
SYNCING = {"aten::item", "aten::Int", "aten::Float", "aten::Bool", "aten::IntImplicit", "aten::FloatImplicit",
           "aten::ScalarImplicit", "aten::_local_scalar_dense", "aten::tolist", "aten::cpu", "aten::tensor",
           "aten::nonzero", "aten::argwhere", "aten::masked_select", "aten::unique", "aten::_unique",
           "aten::_unique2", "aten::unique_consecutive", "aten::equal", "aten::is_nonzero"}
# ops that make a boolean tensor: indexing with one (x[mask], x[mask] = v) is a nonzero in disguise
BOOL_MAKERS = {"aten::eq", "aten::ne", "aten::lt", "aten::le", "aten::gt", "aten::ge", "aten::logical_and",
               "aten::logical_or", "aten::logical_not", "aten::logical_xor", "aten::__and__", "aten::__or__",
               "aten::__xor__", "aten::__invert__", "aten::bitwise_not", "aten::isnan", "aten::isinf",
               "aten::isfinite"}


def _nodes(block: torch._C.Block):
    for node in block.nodes():
        yield node
        for b in node.blocks():
            yield from _nodes(b)


def host_syncs(graph: torch._C.Graph) -> list[str]:
    """Every op of ``graph`` (inlined) that would read a device tensor on the host."""
    g = graph.copy()
    torch._C._jit_pass_inline(g)  # the called methods and functions too
    found = []
    for node in _nodes(g.block()):
        kind = node.kind()
        if kind in SYNCING:
            found.append(kind)
        elif kind == "aten::to" and any(i.node().kind() == "prim::Constant" and 'value="cpu"' in str(i.node())
                                         for i in node.inputs()):
            found.append("aten::to(cpu)")
        elif kind == "aten::repeat_interleave" and len(list(node.inputs())) > 1 \
                and list(node.inputs())[1].type().kind() == "TensorType":
            found.append("aten::repeat_interleave(tensor repeats)")
        elif kind in ("aten::index", "aten::index_put_", "aten::index_put"):
            indices = list(node.inputs())[1].node()
            masks = [i for i in indices.inputs() if i.node().kind() in BOOL_MAKERS or "Bool" in str(i.type())]
            if indices.kind() == "prim::ListConstruct" and masks:
                found.append(f"{kind}(boolean mask)")
    return found


def graphs() -> dict[str, torch._C.Graph]:
    llama = script_model(build_model(PRESETS["tiny"]))
    moe = script_model(build_model(PRESETS["tiny-moe"]))  # the routing and the experts' sum: no host read
    bart = script_model(build_bart(PRESETS["tiny-bart"]))
    cfg = PRESETS["tiny"]
    stage = script_model(StageModel(cfg, 0, cfg.num_hidden_layers, True, True))
    return {"LlamaModel.step": llama.step.graph, "LlamaModel.step (mixture of experts)": moe.step.graph,
            "BartModel.encode": bart.encode.graph,
            "BartModel.step": bart.step.graph, "StageModel.step": stage.step.graph,
            "admit": decoder_state._admit.graph, "admit_beams": decoder_state._admit_beams.graph,
            "sample_and_apply": decoder_state._sample_and_apply.graph, "beam_step": beam_step.graph,
            "accept_drafts": accept_drafts.graph}


@pytest.mark.parametrize("name", list(graphs()))
def test_no_scripted_device_graph_reads_a_tensor_back(name):
    found = host_syncs(graphs()[name])
    assert not found, f"{name} reads a tensor back to the host: {sorted(set(found))}"


def test_the_search_finds_each_kind_of_host_read():
    """The same search on functions that do each thing it must catch."""

    @torch.jit.script
    def reads(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
        n = int(x.sum())  # aten::Int
        y = x[x > 0]  # boolean-mask indexing
        z = torch.tensor(lens, device=x.device)  # a host list made a device tensor: a blocking copy
        w = x.to(torch.device("cpu"))  # a copy to the host
        return y.sum() + z.sum() + n + w.sum() + torch.nonzero(x).sum() + x.masked_select(x > 1).sum()

    found = set(host_syncs(reads.graph))
    assert {"aten::Int", "aten::index(boolean mask)", "aten::tensor", "aten::to(cpu)", "aten::nonzero",
            "aten::masked_select"} <= found, found

    @torch.jit.script
    def clean(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return x[rows] * x.size(0) + torch.where(x > 0, x, torch.zeros_like(x))

    assert host_syncs(clean.graph) == []
