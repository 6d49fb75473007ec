"""Fuzz the config and baseline loaders through the CLI entry point.

Every input is either accepted or ends in exit 2 with exactly one line on stderr that names the
file (and, for a validation error, the field); none may end in a traceback. The number of cases
is ``FUZZ_EXAMPLES`` per strategy (four strategies): the README quotes the total.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from healthcheck.cli import main
from healthcheck.config import ProbeConfig, dump_yaml
from healthcheck.judge.baseline import save_baseline
from tests.synthetic_runs import fitted

FUZZ_EXAMPLES = 250
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

FIELD_NAMES = ["name", "model", "data", "train", "distributed", "metrics", "faults", "seed_policy", "rank_overrides",
               "steps", "lr", "seed", "nproc", "source", "path", "max_length", "envelopes", "lower", "upper", "0", "1"]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.sampled_from(["tiny-gpt2", "../../etc/passwd", "1e309", "ü🙂\u202e", "nan", "-1", "0x10"]),
)
keys = st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=12), st.integers(-3, 10))
documents = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=5)),
                         max_leaves=20)


def run_main(argv: list[str]) -> tuple[int, str]:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, stderr.getvalue()


def assert_clean_outcome(code: int, stderr: str, path: Path) -> None:
    assert code in (0, 2), (code, stderr)
    if code == 2:
        lines = stderr.strip().splitlines()
        assert len(lines) == 1, stderr
        assert lines[0].startswith("healthcheck: error: ")
        assert str(path) in lines[0]
        assert "Traceback" not in stderr


#: One folder for every case of the session, emptied case by case and removed at exit: hypothesis runs
#: 1,000 examples, and a temp file per example used to be left behind in /tmp.
_CASES = tempfile.TemporaryDirectory(prefix="healthcheck-fuzz-")
atexit.register(_CASES.cleanup)


def write_temp(content: bytes, suffix: str) -> Path:
    """The case's input file; each call replaces the previous one (same name per suffix)."""
    path = Path(_CASES.name) / f"case{suffix}"
    path.write_bytes(content)
    return path


@FUZZ
@given(document=documents)
def test_random_yaml_config(document):
    text = yaml.safe_dump(document, allow_unicode=True) if not isinstance(document, str) else document
    path = write_temp(text.encode("utf-8", "surrogatepass"), ".yaml")
    assert_clean_outcome(*run_main(["config", "show", "--config", str(path)]), path)


VALID_CONFIG = dump_yaml(ProbeConfig(seed_policy="per_rank", rank_overrides={1: {"train": {"lr": 0.01}}})).encode()


@FUZZ
@given(cut=st.integers(0, len(VALID_CONFIG)), junk=st.binary(max_size=8), section=st.sampled_from(["train", "data", "model"]),
       field=st.sampled_from(["steps", "lr", "max_length", "name", "dtype"]), value=scalars)
def test_truncated_or_mutated_config(cut, junk, section, field, value):
    path = write_temp(VALID_CONFIG[:cut] + junk, ".yaml")
    assert_clean_outcome(*run_main(["config", "show", "--config", str(path)]), path)
    data = yaml.safe_load(VALID_CONFIG)
    data[section][field] = value
    path = write_temp(yaml.safe_dump(data, allow_unicode=True).encode(), ".yaml")
    code, stderr = run_main(["config", "show", "--config", str(path)])
    assert_clean_outcome(code, stderr, path)


def _valid_baseline_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as folder:
        save_baseline(fitted(), Path(folder) / "default.json")
        return (Path(folder) / "default.json").read_bytes()


VALID_BASELINE = _valid_baseline_bytes()


@FUZZ
@given(document=documents)
def test_random_json_baseline(document):
    path = write_temp(json.dumps(document, default=str).encode(), ".json")
    assert_clean_outcome(*run_main(["baseline", "show", str(path)]), path)


def _leaf_paths(node, prefix=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaf_paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _leaf_paths(value, (*prefix, index))
    else:
        yield prefix


BASELINE_LEAVES = list(_leaf_paths(json.loads(VALID_BASELINE)))


@FUZZ
@given(cut=st.integers(0, len(VALID_BASELINE) - 1), leaf=st.sampled_from(BASELINE_LEAVES), value=scalars,
       delete=st.booleans())
def test_truncated_or_hand_edited_baseline(cut, leaf, value, delete):
    path = write_temp(VALID_BASELINE[:cut], ".json")
    assert_clean_outcome(*run_main(["baseline", "show", str(path)]), path)
    data = json.loads(VALID_BASELINE)
    node = data
    for part in leaf[:-1]:
        node = node[part]
    if delete and isinstance(node, dict):
        del node[leaf[-1]]
    else:
        node[leaf[-1]] = value
    path = write_temp(json.dumps(data, default=str).encode(), ".json")
    code, stderr = run_main(["baseline", "show", str(path)])
    assert_clean_outcome(code, stderr, path)


def test_fuzzing_leaves_no_files_behind():
    # Every case writes into the one session folder, overwriting the last case's file.
    assert {p.name for p in Path(_CASES.name).iterdir()} <= {"case.yaml", "case.json"}
