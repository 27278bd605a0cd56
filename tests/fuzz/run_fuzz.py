"""The longer fuzz run (issue 14): the same server, schema and checks as
tests/server/test_fuzz.py, with many more examples and a random seed, and without stopping at
the first failure: it counts responses per operation and status class and prints a curl
reproducer for every failed check (any 5xx first among them). Not collected by pytest.

    uv run python tests/fuzz/run_fuzz.py --examples 2000
    uv run python tests/fuzz/run_fuzz.py --examples 300 --only /v1/chat/completions --seed 7

Exits 1 if any check failed or /health stopped answering, so it can gate a nightly job.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: fuzzing, serving

import httpx
import hypothesis
import requests
import schemathesis
from fuzzing import cases, fuzz_config, fuzz_settings, load, validate
from hypothesis import given
from ortserve_server import create_app
from ortserve_server._demo import minilm_folder
from schemathesis.core.failures import Failure, FailureGroup
from serving import running


def fuzz_operation(
    operation: schemathesis.APIOperation,
    mode: schemathesis.GenerationMode,
    label: str,
    args: argparse.Namespace,
    counts: collections.Counter[str],
    failures: list[str],
) -> None:
    @fuzz_settings(max_examples=args.examples, derandomize=False)
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: schemathesis.Case) -> None:
        try:
            response = case.call(timeout=60)
        except requests.RequestException as error:  # a dropped connection is a finding, not the end
            counts["no response"] += 1
            failures.append(f"{label}: {type(error).__name__}: {error}\n  {case.as_curl_command()}")
            return
        counts[f"{response.status_code // 100}xx"] += 1
        try:
            validate(case, response)
        except (Failure, FailureGroup) as error:
            # Recorded, not raised: hypothesis would stop at the first failure and spend the
            # rest of the run shrinking it. schemathesis's message carries a curl reproducer.
            failures.append(f"{label}: {response.status_code}: {error}")

    if args.seed is not None:
        fuzz = hypothesis.seed(args.seed)(fuzz)
    fuzz()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=2000, help="examples per operation and mode")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    parser.add_argument("--only", default="", help="fuzz only operations whose path contains this")
    args = parser.parse_args()

    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = minilm_folder(Path(tmp) / "all-minilm-l6-v2")
        with running(create_app(fuzz_config(folder))) as url:
            schema = load(url)
            for method, path, mode in cases():
                if args.only not in path:
                    continue
                label = f"{method} {path} {mode.value}"
                started = time.monotonic()

                fuzz_operation(schema[path][method], mode, label, args, counts[label], failures)
                print(
                    f"{label:45} {dict(sorted(counts[label].items()))}  {time.monotonic() - started:.1f} s", flush=True
                )
            healthy = httpx.get(f"{url}/health", timeout=30).status_code == 200

    total = sum((c for c in counts.values()), collections.Counter[str]())
    print(f"\n{sum(total.values())} requests: {dict(sorted(total.items()))}; /health {'200' if healthy else 'FAILED'}")
    server_errors = [f for f in failures if ": 5" in f.split("\n", 1)[0]]
    for failure in server_errors + [f for f in failures if f not in server_errors]:
        print(f"\n--- {failure}")
    print(f"\n{len(server_errors)} 5xx, {len(failures)} failed checks")
    return 1 if failures or not healthy else 0


if __name__ == "__main__":
    sys.exit(main())
