"""Turn pytest JUnit XML reports into benchmarks/results/<gpu>/gpu_tests.json.

    python benchmarks/gpu_tests_summary.py REPORT.xml [REPORT.xml ...] OUT.json

Several reports count as one run (h200.sh's parallel run and its run of the `alone` tests after it). Writes
{"commit", "gpu", "torch", "date", "duration_s", "passed", "failed", "errors", "skipped", "unnamed",
"failures": [test ids]}; date is the first report's start (ISO 8601), duration_s the reports' wall times added up
(seconds), each None where absent. "unnamed" counts the test cases without a name, no outcome of any test:
pytest-xdist writes such an entry for each worker that an interrupt (h200.sh's TEST_TIMEOUT) stopped mid-test.
The commit comes from $GN_PATCH_COMMIT (the device machine's copy of the tree has no .git), else git.
"""

import json
import sys
import xml.etree.ElementTree as ET

import torch

from gn_patch.bench.results import commit_id


def summarize(*reports: str) -> dict:
    counts = dict(passed=0, failed=0, errors=0, skipped=0, unnamed=0)
    failures = []
    dates, durations = [], []
    for report in reports:
        root = ET.parse(report).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")  # pytest wraps it in <testsuites>
        dates.append(suite.get("timestamp") if suite is not None else None)
        durations.append(float(suite.get("time")) if suite is not None and suite.get("time") else None)
        for case in root.iter("testcase"):
            outcome = outcome_of(case)
            counts[outcome] += 1
            if outcome in ("failed", "errors"):
                failures.append(f"{case.get('classname')}::{case.get('name')}")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    duration = None if None in durations else sum(durations)
    return dict(commit=commit_id(), gpu=gpu, torch=torch.__version__, date=dates[0], duration_s=duration, **counts,
                failures=failures)


def outcome_of(case: ET.Element) -> str:
    """The key of summarize's counts that one <testcase> adds to."""
    if case.get("name") is None:
        return "unnamed"
    if case.find("failure") is not None:
        return "failed"
    if case.find("error") is not None:
        return "errors"
    return "skipped" if case.find("skipped") is not None else "passed"


if __name__ == "__main__":
    result = summarize(*sys.argv[1:-1])
    with open(sys.argv[-1], "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}))
    for name in result["failures"]:
        print("FAILED", name)
