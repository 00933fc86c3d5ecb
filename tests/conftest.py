import json
import os
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config

# Inductor compiles scalar C++ kernels in this suite: g++ on the vectorized kernels' headers is
# about half of a compile (one compiled test took 48 s instead of 82). What the tests assert (what
# graphs save, codes, gradients, bytes) does not depend on the vector width; the tests about the
# kernels a user's machine compiles run them vectorized (the ``vectorized`` fixture). The processes
# the tests start read the setting from the environment when they import inductor's config.
inductor_config.cpp.simdlen = 0
os.environ["TORCHINDUCTOR_VEC_ISA_OK"] = "0"

# Under pytest-xdist (``make test`` runs ``-n 2``) the workers share the machine's cores: each gets
# its share of intra-op threads (one each on 2 cores), as do the processes it starts (the spawned
# memory measurements take this process's count; subprocesses read OMP_NUM_THREADS). Compiling,
# most of the suite's time, is single-threaded Python either way.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)

# Tests that share a module-scoped fixture (a spawned 2-process run, a measured baseline, the
# benchmark's quick run) run on one worker, so that it is computed once: node id prefix -> group.
# (xdist's own ``xdist_group`` mark cannot do this under pytest 9: xdist 3.8 names the group in
# ``item._nodeid``, which pytest 9 no longer reads.) A module that adds such a fixture and is not
# here fails the run under xdist (pytest_collection_modifyitems below).
SHARED = {
    "test_bench.py": "bench",
    "test_compile_large.py::test_compiled_int8_keeps_what_eager_keeps_and_says_so[per-block": (
        "compile per-block"
    ),
    "test_compile_large.py::test_int8_inside_compiled_training[per-block": "compile per-block",
    "test_compile_large.py::test_recompute_of_every_block_inside_compiled_training[per-block": (
        "compile per-block"
    ),
    "test_compile_large.py::test_compiled_int8_keeps_what_eager_keeps_and_says_so[whole-model": (
        "compile whole-model"
    ),
    "test_compile_large.py::test_int8_inside_compiled_training[whole-model": "compile whole-model",
    "test_compile_large.py::test_recompute_of_every_block_inside_compiled_training[whole-model": (
        "compile whole-model"
    ),
    "test_compile_fsdp.py": "compile_fsdp",
    "test_compress.py": "compress",
    "test_configs.py": "configs",
    "test_deepspeed.py": "deepspeed",
    "test_dropout.py": "dropout",
    "test_fsdp.py": "fsdp",
    "test_hf_trainer.py": "hf_trainer",
    "test_plan.py": "plan",
    "test_profile.py": "profile",
    "test_recompute.py": "recompute",
    "test_tensor_parallel.py": "tensor_parallel",
}
_PER_TEST = ("one_thread",)  # module-scoped but nothing to share: cheap to set up again


def _shared_group(nodeid: str) -> str | None:
    nodeid = nodeid.removeprefix("tests/")
    return next((g for prefix, g in SHARED.items() if nodeid.startswith(prefix)), None)


def _uses_shared_fixture(item: pytest.Item) -> bool:
    return any(
        d[-1].baseid  # the project's own fixtures (pytest's tmp_path_factory is session-scoped)
        and d[-1].scope in ("module", "package", "session")
        and name not in _PER_TEST
        for name, d in item._fixtureinfo.name2fixturedefs.items()
    )


# Each test's measured seconds (setup, call and teardown on 2 xdist workers), written by
# ``make durations`` (``pytest --store-durations``): under xdist the longest units of work start
# first, so that no worker is left with a long one at the end while the other has nothing to do,
# and ``make check`` (``--quick``) leaves out the tests measured over QUICK_SECONDS.
DURATIONS = Path(__file__).with_name("durations.json")
QUICK_SECONDS = 3.0


def _durations() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}


def pytest_addoption(parser):
    parser.addoption(
        "--quick",
        action="store_true",
        help=f"only the tests measured in {DURATIONS.name} at {QUICK_SECONDS} s or less "
        "(make check): no compiling, no spawned processes",
    )
    parser.addoption(
        "--store-durations",
        action="store_true",
        help=f"write the measured seconds of the tests run into tests/{DURATIONS.name} "
        "(make durations)",
    )


def _order_by_duration(items: list, durations: dict[str, float]) -> None:
    """Longest unit of work first (a SHARED group is one unit: the sum of its tests)."""
    units: dict[str, float] = {}
    for item in items:
        unit = _shared_group(item.nodeid) or item.nodeid
        units[unit] = units.get(unit, 0.0) + durations.get(item.nodeid, 0.0)
    items.sort(key=lambda i: -units[_shared_group(i.nodeid) or i.nodeid])  # stable


def pytest_collection_modifyitems(config, items):
    durations = _durations()
    if config.getoption("quick"):
        # slow on their own, or sharing a costly module fixture (a measured baseline, a
        # 2-process run: it is charged to whichever of its tests runs first)
        slow = [
            i
            for i in items
            if durations.get(i.nodeid, 0.0) > QUICK_SECONDS or _shared_group(i.nodeid)
        ]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [i for i in items if i not in slow]
    if _WORKERS > 1:
        unshared = [
            i.nodeid
            for i in items
            if isinstance(i, pytest.Function)
            and _uses_shared_fixture(i)
            and _shared_group(i.nodeid) is None
        ]
        if unshared:
            raise pytest.UsageError(
                f"{unshared[0]} uses a module-scoped fixture: name its module in "
                "tests/conftest.py's SHARED, or xdist computes the fixture on each worker"
            )
        _order_by_duration(items, durations)


_measured: dict[str, float] = {}


def pytest_runtest_logreport(report):
    # Under xdist the controller receives every worker's reports: the sums are the whole run's.
    _measured[report.nodeid] = _measured.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if session.config.getoption("store_durations") and worker is None and _measured:
        # merged into what was measured before: a run of some tests updates theirs only
        measured = {**_durations(), **{k: round(v, 2) for k, v in _measured.items()}}
        DURATIONS.write_text(json.dumps(dict(sorted(measured.items())), indent=0) + "\n")


try:
    from xdist.scheduler import LoadScopeScheduling
except ImportError:  # pytest without xdist: one process, nothing to schedule
    pass
else:

    class SharedFixtureScheduling(LoadScopeScheduling):
        """``--dist loadgroup``: each test is a unit of work on its own, but those of one SHARED
        group are one unit; units go out in collection order (longest first: DURATIONS)."""

        def _split_scope(self, nodeid: str) -> str:
            return _shared_group(nodeid) or nodeid

    def pytest_xdist_make_scheduler(config, log):
        if config.getvalue("dist") == "loadgroup":
            return SharedFixtureScheduling(config, log)
        return None


@pytest.fixture
def vectorized():
    """Inductor's kernels vectorized for one test (:func:`memory.vectorized_kernels`)."""
    from memory import vectorized_kernels

    with vectorized_kernels():
        yield


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a test module (``pytestmark = usefixtures("one_thread")``).

    On a busy 2-core machine two OpenMP threads spin against each other and a step gets
    10-100x slower; one thread is the fast and predictable choice there.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
