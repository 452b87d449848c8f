import pytest

from tests.functional.harness import RunCache, gpt_args, preprocess_quickstart_corpus


@pytest.fixture(scope="session")
def data_prefix(tmp_path_factory):
    return preprocess_quickstart_corpus(str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="session")
def run_cache():
    """Loss curves shared by the session's tests: a run asked for twice (with the same flags) is trained once."""
    return RunCache()


@pytest.fixture(scope="session")
def baseline(data_prefix, run_cache):
    """The single-process run every parallel layout is compared with (computed once per session)."""
    return run_cache.losses({"baseline": (1, gpt_args(data_prefix))})["baseline"]
