import gc
import os

import pytest
import torch.distributed as dist

from partc.runtime import topology

# Every pass verifies its invariants in tests (docs/architecture.md, "The pass lists").
os.environ.setdefault("PARTC_VERIFY", "1")


@pytest.fixture(autouse=True, scope="module")
def _earlier_modules_objects_out_of_the_collectors_way():
    """Collect, then freeze what earlier modules left alive (their cached analyses,
    plans and programs: over 600,000 objects by the validation tests), so that the
    collector's full passes walk only what this module makes. Without it a test that
    allocates many containers paid for every earlier module's objects on each full
    pass: tests/validation/test_memory.py's 32-microbatch case spent 21 of its 23 s
    collecting after the validation tests alone, 115 s in the whole suite, against 13 s
    by itself. Frozen objects still go when their last reference does; only cycles
    among them stay."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_outlives_its_module():
    """A module that leaves the default process group up (a program built in this
    process joins or makes one) would make the next module's ``init_process_group``
    fail, depending on which modules an xdist worker happens to run in a row. It is
    left as a run ends (``topology.leave``): the module's groups freed, their gloo
    threads joined here rather than running on into the interpreter's shutdown."""
    yield
    if dist.is_available() and dist.is_initialized():
        topology.leave()


@pytest.fixture(autouse=True, scope="session")
def _one_plan_cache_for_every_launch(tmp_path_factory):
    """The torchrun launches of this session (``tests/runtime/test_parity.launch``) share
    one plan cache directory (``PARTC_CACHE_DIR``), as a user's runs on one machine do:
    a model the session already analysed (most cases train the same few models) is read
    back rather than traced and measured again on every rank of every launch. Under
    xdist the workers of one run share it (entries are written whole, then renamed, and
    keyed by the source's digest)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    os.environ["PARTC_TEST_LAUNCH_CACHE"] = str(root / "launch-plan-cache")
    yield
