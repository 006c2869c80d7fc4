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
# `make test` runs pytest-xdist with --dist loadgroup (Makefile). The Flower deployment tests (the
# `deploy` fixture: a SuperLink, SuperNodes and one ClientApp process per message) mostly wait on
# processes, heartbeats and timeouts; they form one group that a worker starts with and runs one
# after another, so two never share the machine's cores and their timing asserts keep their
# margins. Every other test is its own unit, longest first (tests/durations.json: seconds measured
# by `pytest --durations`; a test missing there counts as short), so the run does not end on a long
# test started late. The order changes no result; a stale durations file only schedules worse.
_DURATIONS_FILE = __import__("pathlib").Path(__file__).with_name("durations.json")
_DURATIONS: dict = __import__("json").loads(_DURATIONS_FILE.read_text()) if _DURATIONS_FILE.is_file() else {}
DEPLOY_GROUP = "flower-deploy"


@pytest.hookimpl(tryfirst=True)  # before xdist adds the group to the node ids
def pytest_collection_modifyitems(config, items):
    deploy = [it for it in items if "deploy" in getattr(it, "fixturenames", ())]
    for it in deploy:
        it.add_marker(pytest.mark.xdist_group(DEPLOY_GROUP))
    ids = {id(it) for it in deploy}
    rest = [it for it in items if id(it) not in ids]
    longest = lambda it: -float(_DURATIONS.get(it.nodeid, 0.0))  # noqa: E731  (sorted() keeps ties in file order)
    items[:] = sorted(deploy, key=longest) + sorted(rest, key=longest)
