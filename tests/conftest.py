"""Suite-wide test settings: offline hub, one torch thread (tiny models run faster single-threaded
and the suite must behave on a shared 2-core machine)."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# tiny random checkpoints of the three generic tasks' model families (tests/tiny_assets.py)
@pytest.fixture(scope="session")
def bert_dir(tmp_path_factory):
    from tiny_assets import save_tiny_bert

    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    from tiny_assets import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def vit_dir(tmp_path_factory):
    from tiny_assets import save_tiny_vit

    return save_tiny_vit(tmp_path_factory.mktemp("tiny-vit"))


# ----------------------------------------------------------------------------- test order (CI time)
# `make test` runs pytest-xdist with --dist loadgroup (Makefile). The Flower deployment tests
# (tests/test_flower_deploy.py: a SuperLink, SuperNodes and one ClientApp process per message) mostly
# wait on processes, heartbeats and timeouts; they are one unit of work that a worker starts with and
# runs one after another, so two never share the machine's cores and their timing asserts keep their
# margins. Every other test is its own unit, longest first (tests/durations.json: seconds measured by
# `pytest --durations`; a test missing there counts as short), so the run does not end on a long test
# started late. The order changes no result; a stale durations file only schedules worse.
# The group is made by our scheduler (pytest_xdist_make_scheduler), not by xdist_group marks: with
# pytest 9.2, xdist 3.8's loadgroup no longer tags the node ids (it sets Item._nodeid, which pytest 9
# no longer reads), so marked tests were spread over the workers.
_DURATIONS_FILE = __import__("pathlib").Path(__file__).with_name("durations.json")
_DURATIONS: dict = __import__("json").loads(_DURATIONS_FILE.read_text()) if _DURATIONS_FILE.is_file() else {}
DEPLOY_FILE = "tests/test_flower_deploy.py::"


def pytest_collection_modifyitems(config, items):
    longest = lambda it: (not it.nodeid.startswith(DEPLOY_FILE), -float(_DURATIONS.get(it.nodeid, 0.0)))  # noqa: E731
    items[:] = sorted(items, key=longest)  # sorted() keeps ties in file order


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class DeploymentsTogether(LoadScopeScheduling):
        """One unit for the deployment tests (largest first: the scheduler orders units by size),
        every other test a unit of its own, in collection order."""

        def _split_scope(self, nodeid: str) -> str:
            return "flower-deploy" if nodeid.startswith(DEPLOY_FILE) else nodeid

    return DeploymentsTogether(config, log)
