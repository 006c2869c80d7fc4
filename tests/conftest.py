"""Suite-wide test settings: offline hub, one torch thread in the tests and in every process they
start (tiny models run faster single-threaded and the suite must behave on a shared 2-core machine)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every process a test starts (documented commands, compare workers, Ray and Flower processes) single-threaded
# as well, so that two pytest-xdist workers' subprocesses do not each start torch's default threads on the 2
# cores (the Ray and Flower equality tests took 17-24 s alone, 106-176 s inside the suite)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


#: the fast tier (make test-fast): the tests listed here are marked ``fast`` at collection, and no test file
#: carries the marker; scripts/select_fast_tier.py writes the list from measured durations (tests/README.md)
FAST_TIER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fast_tier.txt")


def fast_tier_ids() -> set[str]:
    """The node ids in tests/fast_tier.txt."""
    with open(FAST_TIER, encoding="utf-8") as fh:
        return {line.rstrip("\n").split("\t", 1)[1] for line in fh if line.strip() and not line.startswith("#")}


@pytest.hookimpl(tryfirst=True)  # before ``-m fast`` deselects by marker
def pytest_collection_modifyitems(config, items):
    fast = fast_tier_ids()
    for item in items:
        if item.nodeid in fast:
            item.add_marker(pytest.mark.fast)


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# tiny random checkpoints of the three generic tasks' model families (tests/fedgalore_testing/assets.py)
@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory):
    from fedgalore_testing.assets import save_tiny_bert

    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    from fedgalore_testing.assets import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def vit_dir(tmp_path_factory):
    from fedgalore_testing.assets import save_tiny_vit

    return save_tiny_vit(tmp_path_factory.mktemp("tiny-vit"))
