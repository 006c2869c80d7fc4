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
