"""onnxruntime's LayerNormalization and its fused SkipLayerNormalization on rows far from zero.

    python tools/onnxruntime_rows.py [--out bench/results/onnxruntime-rows.json]

At its default graph optimization level onnxruntime fuses an Add followed by a
LayerNormalization into its own SkipLayerNormalization, so an exported add-norm runs that
operator. On float32 rows c + (i mod 4) of D elements (a zero residual, weight 1, bias 0,
eps 1e-5) this prints the largest absolute difference of each operator's y from the fused CPU
kernels' (layernorm.cpu, within 0.5 ulp of the exact answer on such rows: docs/numerics.md),
and saves it as JSON, from which ``python tools/doc_tables.py`` makes docs/export.md's table.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnxruntime as ort

import layernorm.cpu as lnc
from layernorm.bench import doc_tables, results
from layernorm.bench.machine import run_meta
from layernorm.bench.peers import onnx_model

ROWS = ((4e4, 4), (4e4, 16), (1e5, 64), (3e5, 16), (4e4, 4096))
EPS = 1e-5


def _run(norm: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(onnx_model(norm, feeds["x"].shape, "float32", EPS), opts,
                                providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(["y"], {k: v for k, v in feeds.items() if k in names})[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="save the figures as JSON here")
    args = parser.parse_args()
    result: dict = {"meta": {**run_meta(), "onnxruntime": ort.__version__, "eps": EPS},
                    "rows": []}
    for c, d in ROWS:
        x = (c + np.arange(8 * d) % 4).astype(np.float32).reshape(8, d)
        feeds = {"x": x, "residual": np.zeros_like(x), "gamma": np.ones(d, np.float32),
                 "beta": np.zeros(d, np.float32)}
        ours, _ = lnc.layer_norm_forward(x, feeds["gamma"], feeds["beta"], EPS)
        result["rows"].append({"c": c, "D": d, **{
            op: float(np.abs(_run(norm, feeds).astype(np.float64) - ours).max())
            for op, norm in (("LayerNormalization", "layer_norm"),
                             ("SkipLayerNormalization", "add_layer_norm"))}})
    print(doc_tables.onnxruntime_rows_table(result))
    if args.out is not None:
        print(f"\nsaved {results.save(result, args.out)}")


if __name__ == "__main__":
    main()
