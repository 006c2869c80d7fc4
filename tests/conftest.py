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
