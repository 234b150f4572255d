"""Turn a pytest JUnit XML report into benchmarks/results/<gpu>/gpu_tests.json.

    python benchmarks/gpu_tests_summary.py REPORT.xml OUT.json

Writes {"commit", "gpu", "torch", "date", "duration_s", "passed", "failed", "errors", "skipped", "unnamed",
"failures": [test ids]}; date and duration_s are the report's (the run's start, ISO 8601, and its wall time in
seconds), None where absent. "unnamed" counts the report's test cases without a name, no outcome of any test:
pytest-xdist writes such an entry for each worker that an interrupt (h200.sh's TEST_TIMEOUT) stopped mid-test.
The commit comes from $GN_PATCH_COMMIT (the device machine's copy of the tree has no .git), else git.
"""

import json
import sys
import xml.etree.ElementTree as ET

import torch

from gn_patch.bench.results import commit_id


def summarize(report: str) -> dict:
    counts = dict(passed=0, failed=0, errors=0, skipped=0, unnamed=0)
    failures = []
    root = ET.parse(report).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")  # pytest wraps it in <testsuites>
    date = suite.get("timestamp") if suite is not None else None
    duration = float(suite.get("time")) if suite is not None and suite.get("time") else None
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.get("name") is None:
            counts["unnamed"] += 1
        elif case.find("failure") is not None:
            counts["failed"] += 1
            failures.append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            failures.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return dict(commit=commit_id(), gpu=gpu, torch=torch.__version__, date=date, duration_s=duration, **counts,
                failures=failures)


if __name__ == "__main__":
    result = summarize(sys.argv[1])
    with open(sys.argv[2], "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}))
    for name in result["failures"]:
        print("FAILED", name)
