#!/usr/bin/env bash
# GPU check for a lent CUDA machine (not run in CI).
#
# Prints the torch / CUDA / NCCL versions, then measures on the digits-cnn
# workload:
#   1. single-GPU overhead: elche.train(ranks=1) on cuda:0 against a plain
#      PyTorch loop (DataLoader, forward, backward, step) on the same data;
#   2. several ranks sharing one GPU: 2 ranks, devices=["cuda:0", "cuda:0"],
#      in `cadence` (collective all-reduce; elche's process group is gloo,
#      which reduces CUDA tensors — NCCL refuses two ranks on one device) and
#      in `cpu-cadence` (coordinator averaging).
# and writes one JSON summary (default results/gpu-check.json; first argument
# overrides). Exits 2 at once, with a message, when CUDA is absent; exits 1
# after writing the summary if any check failed.
#
# ELCHE_GPU_CHECK_DEVICE=cpu runs the same checks on the CPU: a dry run of
# this script itself on a machine without a GPU.
#
# Usage: scripts/gpu_check.sh [OUT.json]   (EPOCHS=N to change the default 10)
set -euo pipefail
cd "$(dirname "$0")/.."

out="${1:-results/gpu-check.json}"
mkdir -p "$(dirname "$out")"
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"

# The body goes to a file, not stdin: spawned ranks re-import the main module.
body="$(mktemp -d)"
trap 'rm -rf "$body"' EXIT
cat > "$body/gpu_check_main.py" <<'PY'
"""The GPU check's body; see the header of scripts/gpu_check.sh."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

import elche
from elche import workloads

BATCH = 32
device = os.environ.get("ELCHE_GPU_CHECK_DEVICE", "cuda")
dev0 = "cuda:0" if device == "cuda" else "cpu"
work = workloads.get("digits-cnn")


def versions() -> dict[str, object]:
    nccl = torch.cuda.nccl.version() if device == "cuda" else None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if device == "cuda" else None,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "nccl_available": torch.distributed.is_nccl_available(),
        "gloo_available": torch.distributed.is_gloo_available(),
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run)",
        "elche": elche.__version__,
    }


def sync() -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bare_loop(epochs: int, train_set: Any, test_set: Any) -> dict[str, object]:
    """A plain PyTorch loop: the overhead floor elche is compared with."""
    model = work.make_model(dev0)
    optimizer = work.make_optimizer(model.parameters())
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    samples, loss = 0, torch.zeros(())
    sync()
    start = time.perf_counter()
    for _ in range(epochs):
        for batch in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = work.step_fn(model, batch)
            loss.backward()
            optimizer.step()
            samples += len(batch[1])
    sync()
    wall_s = time.perf_counter() - start
    return {
        "wall_s": round(wall_s, 4),
        "samples_per_s": round(samples / wall_s, 1),
        "final_loss": float(loss.detach()),
        "eval": work.eval_fn(model, test_set),
    }


def elche_run(
    epochs: int, train_set: Any, test_set: Any, devices: list[str], mode: str
) -> dict[str, object]:
    result = elche.train(
        work.make_model, work.make_optimizer, work.step_fn, train_set,
        batch_size=BATCH, epochs=epochs, mode=mode, devices=devices,
        eval_fn=work.eval_fn, eval_dataset=test_set, eval_every=epochs, progress=False,
    )  # fmt: skip
    keys = ("wall_s", "startup_s", "samples_per_s", "final_loss", "eval_accuracy", "syncs",
            "lost_samples", "outcome", "per_rank")  # fmt: skip
    summary = {k: result.summary.get(k) for k in keys}
    if summary["outcome"] != "completed":
        raise RuntimeError(f"the run did not complete: {result.summary.get('reason')}")
    return summary


def check(name: str, fn: Callable[..., dict[str, object]], *args: Any) -> dict[str, object]:
    print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
    try:
        return {"ok": True, **fn(*args)}
    except Exception as exc:  # recorded, so the other checks still run
        traceback.print_exc()
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def main() -> int:
    out_path, epochs = sys.argv[1], int(sys.argv[2])
    if device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device visible to torch "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); run this on "
            "a machine with a GPU, or set ELCHE_GPU_CHECK_DEVICE=cpu for a dry run",
            file=sys.stderr,
        )
        return 2
    found = versions()
    print(json.dumps(found, indent=1), flush=True)
    data = (epochs, *work.load_split(0))
    checks = {
        "bare_loop": check("plain PyTorch loop", bare_loop, *data),
        "elche_solo": check("elche solo (ranks=1)", elche_run, *data, [dev0], "cadence"),
        "shared_cadence": check(
            "2 ranks on one device, cadence", elche_run, *data, [dev0, dev0], "cadence"
        ),
        "shared_cpu_cadence": check(
            "2 ranks on one device, cpu-cadence", elche_run, *data, [dev0, dev0], "cpu-cadence"
        ),
    }
    bare, solo = checks["bare_loop"], checks["elche_solo"]
    overhead = None
    if bare["ok"] and solo["ok"] and solo.get("wall_s"):
        overhead = round(float(solo["wall_s"]) / float(bare["wall_s"]), 4)
    summary = {
        "workload": work.name,
        "epochs": epochs,
        "batch_size": BATCH,
        "versions": found,
        "elche_solo_over_bare_wall": overhead,
        "checks": checks,
        "ok": all(c["ok"] for c in checks.values()),
    }
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1)
    print(json.dumps(summary, indent=1))
    print(f"gpu_check: wrote {out_path}", file=sys.stderr)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
PY
python "$body/gpu_check_main.py" "$out" "${EPOCHS:-10}"
