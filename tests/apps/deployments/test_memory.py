"""The planner's memory estimate against what llama.cpp reports when it loads the model.

Each case loads a model the way the engine does (workers.engine.buffers, a child process
with llama.cpp's log captured) and compares, per device, the estimated weights + KV +
compute buffers with the sizes llama.cpp prints: within 10%. Splits run over real rpc
servers on loopback. SmolLM2 (llama, 49k vocabulary) and gemma-3-270m (sliding-window
attention, 262k vocabulary, tied output) stress different terms.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from apps.catalog.gguf_meta import read_metadata
from apps.deployments import planner as P
from tests.conftest import ROOT, free_port
from workers.agent.rpc_servers import RpcServer


@pytest.fixture(scope="module")
def rpc_pair():
    servers = [RpcServer("127.0.0.1", free_port(), 1) for _ in range(2)]
    for s in servers:
        asyncio.run(s.start())
    yield [s.endpoint for s in servers]
    for s in servers:
        s.stop()


def measured(path, context, parallel, *extra) -> dict[str, dict[str, int]]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "workers.engine.buffers",
            "--model",
            str(path),
            "--context",
            str(context),
            "--parallel",
            str(parallel),
            *map(str, extra),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def reported(device: dict[str, int]) -> int:
    return sum(device.get(k, 0) for k in ("model", "kv", "compute", "output"))


def estimated(stage: P.Stage) -> int:
    return stage.total_bytes - stage.overhead_bytes


def facts(path) -> P.ModelFacts:
    return P.ModelFacts.from_metadata(path.name, read_metadata(path), path.stat().st_size)


def assert_close(est: int, got: int, what: str) -> None:
    assert abs(est - got) <= 0.10 * got, (
        f"{what}: estimated {est / 2**20:.1f} MiB, "
        f"llama.cpp {got / 2**20:.1f} MiB ({est / got - 1:+.1%})"
    )


@pytest.fixture(scope="module", params=["smollm2", "gemma"])
def model_file(request, smollm2_path, gemma_path):
    return smollm2_path if request.param == "smollm2" else gemma_path


@pytest.mark.parametrize("context,parallel", [(512, 1), (2048, 4), (4096, 2)])
def test_whole_model_estimate_is_within_10_percent(model_file, context, parallel):
    m, r = facts(model_file), P.Request(context, parallel)
    got = measured(model_file, context, parallel)
    assert_close(estimated(P.replica_stage(m, r)), reported(got["CPU"]), "whole model")


@pytest.mark.parametrize("context,parallel", [(8192, 4), (2048, 8), (512, 2)])
def test_the_window_cache_estimate_is_within_10_percent(gemma_path, context, parallel):
    """A deployment's default swa_cache (window) keeps only the window in gemma's sliding
    layers (15 of 18): far less KV at long contexts, and the planner's estimate follows it,
    KV alone and the whole replica. The full cache is estimated as before."""
    m = facts(gemma_path)
    assert (m.sliding_window, m.sliding_layers) == (512, 15)
    full = measured(gemma_path, context, parallel)["CPU"]
    window = measured(gemma_path, context, parallel, "--swa-cache", "window")["CPU"]
    r = P.Request(context, parallel, swa_window=True)
    assert_close(P.replica_stage(m, r).kv_bytes, window["kv"], "window KV")
    assert_close(estimated(P.replica_stage(m, r)), reported(window), "whole model, window")
    assert_close(P.kv_bytes(m, r, m.n_layers), full["kv"], "full KV")
    if context >= 2048:
        assert window["kv"] < 0.6 * full["kv"]


@pytest.mark.parametrize("context,parallel", [(512, 1), (4096, 2)])
def test_layer_split_estimate_is_within_10_percent_on_every_node(
    model_file, rpc_pair, context, parallel
):
    m, r = facts(model_file), P.Request(context, parallel)
    head_layers, counts = 4, [5, m.n_layers - 9]  # head 0-3, stages 4-8 and 9-end
    ranges = [(0, 4), (4, 9), (9, m.n_layers)]
    got = measured(
        model_file,
        context,
        parallel,
        "--rpc",
        *rpc_pair,
        "--n-gpu-layers",
        m.n_layers + 1 - head_layers,
        "--tensor-split",
        counts[0],
        counts[1] + 1,
    )
    roles = [("head", "CPU"), ("stage", rpc_pair[0]), ("stage", rpc_pair[1])]
    for i, ((role, device), (start, end)) in enumerate(zip(roles, ranges, strict=True)):
        stage = P.split_stage(m, r, role, start, end, output=i == 2)
        assert_close(estimated(stage), reported(got[device]), f"{role} {device} [{start},{end})")


def test_a_split_with_the_window_cache_estimate_is_within_10_percent(gemma_path, rpc_pair):
    """A split keeps its deployment's window cache: each device holds its own layers'
    cells, a sliding layer's only the window (gemma-3-270m: layers 5, 11 and 17 full).
    Layer split head 0-3, stages 4-8 and 9-17 (one full layer each), then a tensor split;
    every device within 10% of llama.cpp's report, and the KV far below the full cache's."""
    m, r = facts(gemma_path), P.Request(8192, 2, swa_window=True)
    ranges = [(0, 4), (4, 9), (9, m.n_layers)]
    window = ("--swa-cache", "window")
    got = measured(
        gemma_path, 8192, 2, "--rpc", *rpc_pair, "--n-gpu-layers", m.n_layers + 1 - 4,
        "--tensor-split", 5, m.n_layers - 9 + 1, *window,
    )  # fmt: skip
    roles = [("head", "CPU"), ("stage", rpc_pair[0]), ("stage", rpc_pair[1])]
    for i, ((role, device), (start, end)) in enumerate(zip(roles, ranges, strict=True)):
        stage = P.split_stage(m, r, role, start, end, output=i == 2)
        assert_close(stage.kv_bytes, got[device]["kv"], f"{role} {device} [{start},{end}) KV")
        assert_close(estimated(stage), reported(got[device]), f"{role} {device} [{start},{end})")
    full = P.split_stage(m, P.Request(8192, 2), "stage", 9, m.n_layers, output=True)
    assert got[rpc_pair[1]]["kv"] < 0.5 * full.kv_bytes

    got = measured(
        gemma_path, 8192, 2, "--rpc", *rpc_pair, "--n-gpu-layers", -1, "--split-mode", 3, *window
    )
    [meta] = [d for d in got if d != "CPU"]
    stage = P.split_stage(m, r, "stage", 0, m.n_layers, output=True, share=0.5)
    assert_close(stage.kv_bytes, got[meta]["kv"], "tensor stage KV")
    assert_close(estimated(stage), reported(got[meta]), "tensor stage")


def test_tensor_split_estimate_is_within_10_percent(model_file, rpc_pair):
    """llama.cpp reports a tensor split's rpc devices as one meta device with the sizes of
    one of them (equal shares here), and the head's own buffers apart."""
    m, r = facts(model_file), P.Request(2048, 2)
    got = measured(model_file, 2048, 2, "--rpc", *rpc_pair, "--n-gpu-layers", -1, "--split-mode", 3)
    [meta] = [d for d in got if d != "CPU"]
    assert_close(
        estimated(P.split_stage(m, r, "head", 0, 0, output=False)), reported(got["CPU"]), "head"
    )
    stage = P.split_stage(m, r, "stage", 0, m.n_layers, output=True, share=0.5)
    assert_close(estimated(stage), reported(got[meta]), "tensor stage")
