"""Every executor slotbench can run, by name.

The registry knows each engine's module but imports it only when that engine is asked for: listing and
validating names (every ``slotbench run``) never loads transformers for the peers.
"""

from __future__ import annotations

import importlib

from strategies.interface import Executor

_ENGINES: dict[str, str] = {
    "static": "strategies.static.executor:StaticStrategy",
    "inflight": "strategies.inflight.executor:InflightStrategy",
    "overlap": "strategies.overlap.executor:OverlapStrategy",
    "pipeline": "strategies.pipeline.executor:PipelineStrategy",
    "disagg": "strategies.disagg.executor:DisaggStrategy",
    "hf-static": "strategies.peers.hf_static:HFStaticExecutor",
    "hf-cb": "strategies.peers.hf_cb:HFContinuousBatchingExecutor",
}
PEERS = ("hf-static", "hf-cb")  # transformers' engines: the optional `peers` extra


def strategy_names() -> list[str]:
    return sorted(_ENGINES)


def get_strategy(name: str) -> type[Executor]:
    if name not in _ENGINES:
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(strategy_names())}")
    module, _, cls = _ENGINES[name].partition(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        if name in PEERS:
            raise ValueError(f"{name} needs transformers: pip install -e '.[peers]' ({exc})") from None
        raise
