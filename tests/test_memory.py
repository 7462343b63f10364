"""Memory: weights run straight off the memory map, so opening the default model and running it
costs about the file's size in RSS, not a float copy of it (measured in a fresh subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import asyncio, gc, json, sys

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

from dllama.engine import LocalEngine
from dllama.gguf_model import GGUFModel
from dllama.sampling import SamplingParams

greedy = SamplingParams(temperature=0.0)
# load the compiled kernels on a tiny model first, so that compilation / cache loading is not counted
warm = LocalEngine(GGUFModel(sys.argv[2]), 64)
asyncio.run(warm.feed([1, 2, 3], greedy))
asyncio.run(warm.feed([4], greedy))
del warm
gc.collect()

base = rss()
model = GGUFModel(sys.argv[1])
opened = rss()
engine = LocalEngine(model, 256)
asyncio.run(engine.feed(list(range(100, 132)), greedy))  # one forward pass over a 32-token prompt
asyncio.run(engine.feed([7], greedy))  # and a decode step
after = rss()
print(json.dumps({"base": base, "opened": opened, "after": after}))
"""


def test_rss_growth_is_about_the_file_size(model_path, synthetic_model):
    warm_model = synthetic_model("Q8_0")
    result = subprocess.run([sys.executable, "-c", SCRIPT, model_path, warm_model], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "NUMBA_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    m = json.loads(result.stdout.strip().splitlines()[-1])
    size = os.path.getsize(model_path)
    opened, total = m["opened"] - m["base"], m["after"] - m["base"]
    print(f"\nRSS: open +{opened / 1e6:.1f} MB, open + forward +{total / 1e6:.1f} MB; file {size / 1e6:.1f} MB "
          f"(ratio {total / size:.3f})")
    assert total <= 1.25 * size
    assert opened <= 0.1 * size  # opening reads the header, not the vocabulary or the weights
