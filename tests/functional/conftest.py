import pytest

from tests.functional.harness import gpt_args, losses, preprocess_quickstart_corpus


@pytest.fixture(scope="session")
def data_prefix(tmp_path_factory):
    return preprocess_quickstart_corpus(str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="session")
def baseline(data_prefix):
    """The single-process run every parallel layout is compared with (computed once per session)."""
    return losses(gpt_args(data_prefix))
