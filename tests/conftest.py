"""Test tiers (pyproject.toml registers the markers):

  dist   the test starts processes: a world of ranks (dist_harness.run_world), torchrun,
         or another Python interpreter (examples, the notebook, a CLI)
  slow   the test takes long without starting a world (compilers, the docs site)

`make check` runs `pytest -m "not dist and not slow"` (kernels, planner, config,
estimator, the engine at world size 1 in this process); `make test` runs everything.
A test that calls run_world without the `dist` mark fails (dist_harness.SPAWN_ALLOWED).

Note [Test workers]
  `make test` runs the files on PYTEST_JOBS (2) pytest-xdist workers, a whole file per
  worker at a time (--dist loadfile), in the order below (LONGEST_FIRST; xdist's own
  order, most tests first, is off: --no-loadscope-reorder), so a file's standing worlds (Note [Standing worlds]
  in tests/dist_harness.py) and module fixtures live in one process, as without workers.
  Most multi-rank tests leave a core idle about a third of their time (ranks waiting on
  each other, rendezvous, failure timeouts; measured from /proc/stat, 0.63 busy), which a
  second worker fills: the suite took 875 s in one process and 737 s on two workers on
  the same 2-core machine. Nothing is shared between workers but the machine: each test
  makes its own temporary directories and ports, and the tests that bound a latency
  (10-20 s for a failure to reach every rank) or a ratio of times (tests/test_overlap.py)
  keep a margin of two to three times what they measure alone. PYTEST_JOBS=1 runs one process.
"""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "examples")):
    if p not in sys.path:
        sys.path.insert(0, p)

import dist_harness  # noqa: E402


# Note [Test workers]: the longest files first (their share of the suite's time, in percent,
# from one --durations=0 run at 874cbde: 9, 6, 5, 5, 4, 4, 4, 3, 3, 3, 2, 2, 2, 2, 2), so that the
# workers end together instead of one finishing a long file alone; the others follow in order.
LONGEST_FIRST = ("test_compile_fullgraph.py", "test_integrations.py", "test_whole_tensor.py", "test_rank_alone.py",
                 "test_porting.py", "test_cuda_compile.py", "test_examples.py", "test_compile_workflows.py",
                 "test_kernels_bf16_states.py", "test_kernels.py", "test_parity.py", "test_offload.py",
                 "test_stage3.py", "test_notebook.py", "test_mixed_precision.py")


def pytest_collection_modifyitems(config, items):
    first = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(LONGEST_FIRST)))   # stable: files stay whole


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # before the test's fixtures: a module fixture that starts a world runs in the setup
    # of the first test that asks for it
    dist_harness.SPAWN_ALLOWED = item.get_closest_marker("dist") is not None


@pytest.fixture(autouse=True, scope="module")
def _standing_worlds():
    """Standing worlds live for one test module (Note [Standing worlds] in dist_harness.py)."""
    yield
    dist_harness.end_standing_worlds()
