import pytest

from torpor.synthetic import make_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """The embedded default model's preset, generated once per test session (fp32 on CPU)."""
    return str(make_model("tiny", tmp_path_factory.mktemp("tiny") / "tiny", dtype="float32", progress=False))
