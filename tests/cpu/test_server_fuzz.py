"""Keep it found: schemathesis over the live server's own OpenAPI schema (real HTTP, the tiny fp32 model
on CPU, the admin token sent with every request). Every response must be in the schema (status code,
content type, headers, body) and no 5xx may come back except 503, the documented answer of an asleep
engine (the server here answers it at once: asleep timeout 0). Deterministic (derandomized) and
bounded: a few examples per operation, well under a minute in all."""

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

schemathesis = pytest.importorskip("schemathesis")

from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_thread import ServerThread  # noqa: E402

from torpor.engine import LLM  # noqa: E402
from torpor.server import ServerConfig, build_app  # noqa: E402

from .test_server import ENGINE  # noqa: E402

ADMIN = "fuzz-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
CHECKS = [status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]
EXAMPLES_PER_OPERATION = 20



@pytest.fixture(scope="module")
def fuzz_server(tiny_model_path):
    """Short generations (max_tokens cap 4) and no waiting for a sleeping engine (503 at once)."""
    llm = LLM(tiny_model_path, **{**ENGINE, "max_num_seqs": 4})
    config = ServerConfig("tiny", admin_token=ADMIN, max_tokens_cap=4, asleep_timeout=0.0)
    with ServerThread(build_app(llm.engine, config)) as url:
        yield url
        with httpx.Client(base_url=url, headers=AUTH) as admin:  # leave it as found
            admin.post("/wake_up")
            admin.post("/resume")


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(schemathesis.GenerationMode), ids=str)
def test_fuzz_the_openapi_schema(fuzz_server, mode):
    """Every operation of the schema, valid data (positive) and invalid data (negative: must be a 4xx)."""
    # (schemathesis.pytest's fixture-based parametrization does not run under pytest 9: one hypothesis
    # test per operation instead)
    api = schemathesis.openapi.from_url(f"{fuzz_server}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 12
    fuzzed = sum(fuzz_operation(operation, mode, fuzz_server) for operation in operations)
    assert fuzzed >= (12 if mode == schemathesis.GenerationMode.POSITIVE else 7)


def fuzz_operation(operation, mode, url: str) -> bool:
    """Fuzz one operation; False when it takes no input that could be invalid (negative mode only)."""
    @settings(max_examples=EXAMPLES_PER_OPERATION, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case) -> None:
        response = case.call(base_url=url, headers=AUTH, timeout=30)
        assert response.status_code < 500 or response.status_code == 503, (
            f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}")
        case.validate_response(response, checks=CHECKS, headers=AUTH)

    try:
        check()
    except Unsatisfiable:
        if mode == schemathesis.GenerationMode.POSITIVE:
            raise
        return False
    return True
