"""The README's ```python blocks run as written.

A block whose first line is `# continues the previous block` runs in the namespace of the
blocks before it; any other block starts a fresh namespace. A chain whose first block starts
with `# needs a GPU` runs only where JAX sees a GPU (marked `gpu`)."""
import os
import re

import pytest

from conftest import jax_has_gpu

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
CONTINUES = "# continues the previous block"
NEEDS_GPU = "# needs a GPU"


def readme_chains(text: str) -> list[list[str]]:
    """The ```python blocks of `text`, grouped into chains: a block and its continuations."""
    chains: list[list[str]] = []
    for block in re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        if block.startswith(CONTINUES):
            if not chains:
                raise ValueError("the README's first python block cannot continue another")
            chains[-1].append(block)
        else:
            chains.append([block])
    return chains


def _chain_params():
    with open(README) as f:
        chains = readme_chains(f.read())
    params = []
    for i, chain in enumerate(chains):
        gpu = chain[0].startswith(NEEDS_GPU)
        marks = [pytest.mark.gpu, pytest.mark.skipif(not jax_has_gpu(), reason="needs a GPU")] \
            if gpu else []
        params.append(pytest.param(chain, marks=marks, id=f"chain{i}{'-gpu' if gpu else ''}"))
    return params


def test_readme_has_cpu_and_gpu_examples():
    with open(README) as f:
        chains = readme_chains(f.read())
    kinds = [chain[0].startswith(NEEDS_GPU) for chain in chains]
    assert False in kinds and True in kinds, "README should show a CPU and a GPU example"


def test_chains_split_on_continuation_marker():
    text = ("```python\na = 1\n```\n```python\n# continues the previous block\nb = a\n```\n"
            "```bash\nls\n```\n```python\nc = 2\n```\n")
    assert readme_chains(text) == [["a = 1\n", CONTINUES + "\nb = a\n"], ["c = 2\n"]]


@pytest.mark.parametrize("chain", _chain_params())
def test_readme_chain_runs(chain):
    namespace: dict = {"__name__": "readme_example"}
    for i, block in enumerate(chain):
        exec(compile(block, f"README.md python block {i} of its chain", "exec"), namespace)
