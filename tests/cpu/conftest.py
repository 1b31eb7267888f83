import pytest

from torpor.synthetic import make_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """The embedded default model's preset, generated once per test session (fp32 on CPU)."""
    return str(make_model("tiny", tmp_path_factory.mktemp("tiny") / "tiny", dtype="float32", progress=False))


@pytest.fixture(scope="session")
def new_weights_path(tmp_path_factory) -> str:
    """The tiny preset with other random weights (seed 1): a trainer's "new" weights, generated once per session."""
    return str(make_model("tiny", tmp_path_factory.mktemp("tiny-seed1") / "tiny", seed=1, dtype="float32",
                          progress=False))


@pytest.fixture(scope="session")
def tiny_moe_path(tmp_path_factory) -> str:
    """The tiny mixture-of-experts preset (8 experts, top 2, a dense layer), fp32, generated once per session."""
    return str(make_model("tiny-moe", tmp_path_factory.mktemp("tiny-moe") / "tiny-moe", dtype="float32",
                          progress=False))
