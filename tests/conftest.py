import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Without a GPU, Triton kernels run in Triton's CPU interpreter, so CI checks their logic too.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLECALL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models and small tensors run faster on one thread, much faster when the cores are busy."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def short_context_dir(tmp_path_factory):
    """A tiny model folder whose context is 64 tokens (:func:`tests.tiny.short_context_folder`)."""
    from tests.tiny import short_context_folder

    return short_context_folder(tmp_path_factory.mktemp("tiny-64"))


@pytest.fixture
def no_model(monkeypatch):
    """Loading weights fails the test: refused input must be refused before that."""
    import rolecall.core.distributed
    import rolecall.core.models

    def refuse(*a, **k):
        raise AssertionError("the model was loaded for input that should have been refused")

    monkeypatch.setattr(rolecall.core.models, "load_model", refuse)
    monkeypatch.setattr(rolecall.core.distributed, "load_frozen_model", refuse)


@pytest.fixture
def no_frozen_model(monkeypatch):
    """Loading the frozen model of train-heads or calibrate-delta fails the test: a refusal comes before that."""
    import rolecall.core.distributed

    monkeypatch.setattr(rolecall.core.distributed, "load_frozen_model", lambda *a, **k: pytest.fail("model loaded"))
