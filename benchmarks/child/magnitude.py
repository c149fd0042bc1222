"""One row of ``benchmarks.magnitude``: load, compress (unless dense), score every corpus.

    python -m benchmarks.child.magnitude JOB_JSON     # prints the row as JSON

Scored by the library's own evaluate step (:func:`lmcompress.jobs.evaluate.evaluate`, BOS
included where the family needs it), on the text a job reads (:class:`JobText`).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from lmcompress import compress
from lmcompress.compressor.model.loading import load_model
from lmcompress.jobs.evaluate import JobText, evaluate
from lmcompress.jobs.options import RunOptions
from lmcompress.methods import get_method


def run(job: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    options = RunOptions(
        checkpoint=job["checkpoint"],
        eval=tuple(job["corpora"]),
        seq_len=job["seq_len"],
        eval_tokens=job["eval_tokens"],
    )
    model, tokenizer = load_model(options.checkpoint)
    result: dict[str, Any] = {"name": job["name"]}
    if job["method"]:
        config = get_method(job["method"]).config_class(sparsity=job["sparsity"])
        report = compress(model, config)
        result["compress_seconds"] = round(report.seconds, 2)
        result["summary"] = report.summary()
    result.update(evaluate(model, tokenizer, JobText(tokenizer, options).corpora, options))
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
