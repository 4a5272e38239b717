"""The planner's memory estimate against llama.cpp's reported buffers, device by device:
`python bench/memory.py` (needs the test model cache: run `make test` once).

The same comparisons as tests/apps/deployments/test_memory.py (which asserts 10%), written
out with their deviations to bench/results/memory.json.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
os.environ.setdefault("LLAMAFLEET_SECRET_KEY", "bench")
os.environ.setdefault("LLAMAFLEET_NODE_TOKEN", "bench")

from apps.deployments import planner as P  # noqa: E402
from tests.apps.deployments.test_memory import estimated, facts, measured, reported  # noqa: E402
from tests.conftest import cached_model, free_port  # noqa: E402
from workers.agent.rpc_servers import RpcServer  # noqa: E402


def main() -> None:
    import django

    django.setup()
    servers = [RpcServer("127.0.0.1", free_port(), 1) for _ in range(2)]
    for s in servers:
        asyncio.run(s.start())
    eps = [s.endpoint for s in servers]
    rows = []
    try:
        for name in ("smollm2-135m-instruct", "gemma-3-270m"):
            path = cached_model(name)
            m = facts(path)
            for ctx, par in ((512, 1), (2048, 4), (4096, 2)):
                caches = [("", P.Request(ctx, par), ())]
                if m.sliding_layers:  # a deployment's default window cache
                    w = P.Request(ctx, par, swa_window=True)
                    caches.append((", window cache", w, ("--swa-cache", "window")))
                for label, r, extra in caches:
                    got = measured(path, ctx, par, *extra)
                    rows.append(row(name, f"whole{label}", ctx, par, "CPU",
                                    P.replica_stage(m, r), got["CPU"]))  # fmt: skip
                    split = ("--n-gpu-layers", m.n_layers - 3, "--tensor-split", 5, m.n_layers - 8)
                    got = measured(path, ctx, par, "--rpc", *eps, *split, *extra)
                    parts = [
                        ("head", "CPU", 0, 4),
                        ("stage", eps[0], 4, 9),
                        ("stage", eps[1], 9, m.n_layers),
                    ]
                    for i, (role, dev, a, b) in enumerate(parts):
                        st = P.split_stage(m, r, role, a, b, output=i == 2)
                        rows.append(row(name, f"layer {role} [{a},{b}){label}", ctx, par, dev,
                                        st, got[dev]))  # fmt: skip
                    got = measured(
                        path, ctx, par, "--rpc", *eps, "--n-gpu-layers", -1, "--split-mode", 3,
                        *extra,
                    )  # fmt: skip
                    [meta] = [d for d in got if d != "CPU"]
                    head = P.split_stage(m, r, "head", 0, 0, output=False)
                    rows.append(row(name, f"tensor head{label}", ctx, par, "CPU", head,
                                    got["CPU"]))  # fmt: skip
                    st = P.split_stage(m, r, "stage", 0, m.n_layers, output=True, share=0.5)
                    rows.append(row(name, f"tensor stage{label}", ctx, par, meta, st,
                                    got[meta]))  # fmt: skip
    finally:
        for s in servers:
            s.stop()
    out = ROOT / "bench" / "results" / "memory.json"
    worst = max(abs(x["deviation"]) for x in rows)
    out.write_text(json.dumps({"worst_deviation": worst, "rows": rows}, indent=2) + "\n")
    for x in rows:
        print(f"{x['model']:22} {x['case']:36} {x['context']:5}x{x['parallel']} "
              f"est {x['estimated_mib']:8.1f} MiB  llama.cpp {x['reported_mib']:8.1f} MiB  "
              f"{x['deviation']:+.1%}")  # fmt: skip
    print(f"worst deviation {worst:.1%}")


def row(model, case, ctx, par, device, stage, got) -> dict:
    est, rep = estimated(stage), reported(got)
    return {
        "model": model, "case": case, "context": ctx, "parallel": par,
        "device": "rpc" if ":" in device else device,
        "estimated_mib": round(est / 2**20, 1), "reported_mib": round(rep / 2**20, 1),
        "deviation": round(est / rep - 1, 4),
    }  # fmt: skip


if __name__ == "__main__":
    main()
