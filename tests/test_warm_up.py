"""The engine's warm-up readies every kernel a prompt needs, so that the first prompt after loading
runs at its speed instead of compiling (or loading from the cache) what its prefill needs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# In a fresh process (numba knows a kernel's types only once it met them there): load the default
# model, warm up, then answer a prompt of several tokens; print the kernel types the prompt added.
_FIRST_PROMPT = textwrap.dedent("""
    import asyncio, importlib, pkgutil, sys
    from numba.core.registry import CPUDispatcher
    import dllama.kernels
    from dllama.engine import LocalEngine
    from dllama.gguf_model import GGUFModel
    from dllama.sampling import SamplingParams

    modules = [importlib.import_module(f"dllama.kernels.{m.name}")
               for m in pkgutil.iter_modules(dllama.kernels.__path__)]

    def kernel_types():
        return {(m.__name__, name, str(sig)) for m in modules for name, f in vars(m).items()
                if isinstance(f, CPUDispatcher) for sig in f.signatures}

    async def main():
        engine = LocalEngine(GGUFModel(sys.argv[1]), 256)
        try:
            await engine.warm_up()
            ready = kernel_types()
            greedy = SamplingParams(temperature=0.0)
            await engine.feed(list(range(100, 123)), greedy)  # a prompt: prefill tiles and strips
            await engine.feed([200], greedy)  # and a decode step
            for added in sorted(kernel_types() - ready):
                print("added:", *added)
        finally:
            await engine.close()

    asyncio.run(main())
""")


def test_a_prompt_after_the_warm_up_needs_no_other_kernel(model_path):
    done = subprocess.run([sys.executable, "-c", _FIRST_PROMPT, model_path], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "", f"the first prompt still needed kernels the warm-up did not ready:\n{done.stdout}"
