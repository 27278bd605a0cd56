"""Fuzzing every operation of the served OpenAPI schema on the tiny models (issue 14): no
generated request, valid or not, may get a 5xx; every error is OpenAI's shape; every response
is what the schema documents. Bounded to stay well within a minute on a loaded CI machine;
tests/fuzz/run_fuzz.py is the longer run."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from fuzzing import OPERATIONS, cases, fuzz_config, fuzz_settings, load, operations_of, validate
from hypothesis import given
from ortserve_server import create_app
from ortserve_server._demo import minilm_folder
from schemathesis import GenerationMode
from serving import running


@pytest.fixture(scope="module")
def fuzz_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = minilm_folder(tmp_path_factory.mktemp("minilm") / "all-minilm-l6-v2")
    with running(create_app(fuzz_config(folder))) as url:
        yield url


@pytest.fixture(scope="module")
def fuzz_schema(fuzz_url: str) -> schemathesis.BaseSchema:
    return load(fuzz_url)


def test_every_operation_is_fuzzed(fuzz_schema: schemathesis.BaseSchema) -> None:
    """The list below is the served schema's, so that a new route cannot escape the fuzzer."""
    assert set(operations_of(fuzz_schema)) == set(OPERATIONS)


# Examples per operation and mode: enough to reach every engine, every error path the
# generator finds in a few tries, and a few hundred requests in all, in about 15 s on two
# shared cores. The fixed seed makes a CI failure reproduce; run_fuzz.py explores further.
EXAMPLES = 40


@pytest.mark.parametrize(("method", "path", "mode"), cases(), ids=[f"{m} {p} {g.value}" for m, p, g in cases()])
def test_fuzz(fuzz_schema: schemathesis.BaseSchema, method: str, path: str, mode: GenerationMode) -> None:
    operation = fuzz_schema[path][method]

    @fuzz_settings(max_examples=EXAMPLES)
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: schemathesis.Case) -> None:
        validate(case, case.call(timeout=60))

    fuzz()


def test_the_server_still_answers(fuzz_url: str) -> None:
    """Last in the module: after everything the fuzzer sent, health is still 200."""
    assert httpx.get(f"{fuzz_url}/health", timeout=30).status_code == 200
