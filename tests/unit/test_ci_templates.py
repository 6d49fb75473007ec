"""The CI templates in ci/, each checked by a real linter or schema validator, and the OpenMetrics export.

Tools (all from the ``test`` extra, all offline): actionlint (with shellcheck on every ``run:``
block) and check-jsonschema's vendored GitHub workflow schema for the workflows; check-jsonschema's
vendored GitLab CI schema for the GitLab job; shellcheck for the SLURM script and every shell
script embedded in the YAML templates; kubernetes-validate's vendored Kubernetes schemas for the pod
templates of the PyTorchJob; prometheus_client's OpenMetrics parser for the metrics report. Each
linter also gets a broken copy, to prove it is really checking. The SLURM and Kubernetes scripts
are dry-run with stub ``srun``/``torchrun``/``healthcheck`` commands to pin their exit-code mapping.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from healthcheck.artifacts import MetricSummary, RunResult, Timing
from healthcheck.config import ProbeConfig
from healthcheck.outputs.openmetrics import main as integrations_main
from healthcheck.outputs.openmetrics import openmetrics_from_result
from tests.fixtures_runs import write_fake_run

REPO = Path(__file__).resolve().parents[2]
CI = REPO / "ci"
WORKFLOWS = [CI / "github" / "healthcheck.yml", CI / "github" / "healthcheck-baseline.yml"]
ACTIONLINT_CONFIG = CI / "github" / "actionlint.yaml"
GITLAB_JOB = CI / "gitlab" / "healthcheck.gitlab-ci.yml"
SLURM_SCRIPT = CI / "slurm" / "healthcheck.sbatch"
PYTORCHJOB = CI / "k8s" / "healthcheck-pytorchjob.yaml"
RUNS_PVC = CI / "k8s" / "healthcheck-runs-pvc.yaml"


# --------------------------------------------------------------------------- helpers


def tool(name: str) -> str:
    """Path of a linter from the test extra. A missing linter fails the test: a skip would let a broken
    template pass CI on a machine where the install step was forgotten."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if not found:
        pytest.fail(f"{name} is not installed; install the test extra: pip install -e '.[test]'")
    return found


def run(*args: str | Path, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], check=False, capture_output=True, text=True, timeout=120, **kwargs)


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def steps_of(workflow: dict, job: str) -> list[dict]:
    return workflow["jobs"][job]["steps"]


def step_named(steps: list[dict], fragment: str) -> dict:
    return next(step for step in steps if fragment in step.get("name", "") or fragment in step.get("uses", ""))


def shellcheck_text(script: str, tmp_path: Path, name: str = "snippet.sh") -> subprocess.CompletedProcess:
    path = tmp_path / name
    path.write_text("#!/bin/bash\n" + script)
    return run(tool("shellcheck"), "--shell=bash", path)


def broken_copy(source: Path, tmp_path: Path, old: str, new: str) -> Path:
    text = source.read_text()
    assert old in text, f"{source.name} no longer contains {old!r}; update the negative control"
    target = tmp_path / source.name
    target.write_text(text.replace(old, new, 1))
    return target


def stub_commands(bin_dir: Path, log: Path, **exit_codes: int) -> None:
    """Executables that append their argv to ``log`` and exit with the code given for them.

    ``healthcheck`` exits with ``exit_codes["compare"]`` for ``compare`` and ``exit_codes["config"]``
    for ``config``; every other stub with ``exit_codes[name]`` (default 0).
    """
    bin_dir.mkdir()
    bodies = {
        "srun": f'echo "srun $*" >> {log}\nexit {exit_codes.get("srun", 0)}\n',
        "torchrun": f'echo "torchrun $*" >> {log}\nexit {exit_codes.get("torchrun", 0)}\n',
        "scontrol": 'printf "node-a\\nnode-b\\n"\n',
        "healthcheck": (
            f'echo "healthcheck $*" >> {log}\n'
            f'case "$1" in compare) exit {exit_codes.get("compare", 0)};; config) exit {exit_codes.get("config", 0)};; esac\n'
        ),
    }
    for name, body in bodies.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)


# --------------------------------------------------------------------------- GitHub Actions


def test_workflows_pass_actionlint_with_shellcheck():
    result = run(tool("actionlint"), "-config-file", ACTIONLINT_CONFIG, "-shellcheck", tool("shellcheck"), *WORKFLOWS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_and_its_shellcheck_catch_a_broken_workflow(tmp_path):
    broken = broken_copy(WORKFLOWS[0], tmp_path, '--out "$RUN_DIR"', "--out $RUN_DIR")
    result = run(tool("actionlint"), "-config-file", ACTIONLINT_CONFIG, "-shellcheck", tool("shellcheck"), broken)
    assert result.returncode != 0 and "SC2086" in result.stdout


@pytest.mark.parametrize("schema", ["vendor.github-workflows", "custom.github-workflows-require-timeout"])
def test_workflows_match_the_vendored_schema(schema):
    result = run(tool("check-jsonschema"), "--builtin-schema", schema, *WORKFLOWS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_probe_workflow_uploads_and_publishes_on_every_outcome():
    workflow = load_yaml(WORKFLOWS[0])
    steps = steps_of(workflow, "probe")
    assert "self-hosted" in workflow["jobs"]["probe"]["runs-on"]
    probe = step_named(steps, "Probe")
    assert 'healthcheck probe --config "$PROBE_CONFIG" --out "$RUN_DIR"' in probe["run"]
    assert 'exit "$code"' in probe["run"]  # exit 1, 2 and 3 all fail the job
    upload = step_named(steps, "actions/upload-artifact")
    assert upload["if"] == "always()" and upload["with"]["path"] == "${{ env.RUN_DIR }}"
    junit = step_named(steps, "action-junit-report")
    assert junit["if"].startswith("always()") and junit["with"]["report_paths"].endswith("/junit.xml")
    assert steps.index(probe) < steps.index(upload) < steps.index(junit)
    assert workflow["permissions"]["checks"] == "write"


def test_baseline_workflow_is_approval_gated_and_opens_a_pull_request():
    workflow = load_yaml(WORKFLOWS[1])
    triggers = workflow[True]  # YAML 1.1 reads the bare key `on` as true
    assert set(triggers) == {"workflow_dispatch"} and triggers["workflow_dispatch"]["inputs"]["reason"]["required"]
    job = workflow["jobs"]["record"]
    assert job["environment"] == "healthcheck-baseline"
    record = step_named(job["steps"], "Record")
    assert 'healthcheck baseline record --config "$CONFIG" --repeats "$REPEATS"' in record["run"]
    assert '--reason "$REASON"' in record["run"]
    pull_request = step_named(job["steps"], "pull request")
    assert "gh pr create" in pull_request["run"] and "git add --all -- baselines/" in pull_request["run"]
    assert workflow["permissions"] == {"contents": "write", "pull-requests": "write"}


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_workflow_scripts_never_interpolate_expressions(path):
    # Inputs reach the shell through env:, so a reason like `"; rm -rf ~` stays a string.
    for job in load_yaml(path)["jobs"].values():
        for step in job["steps"]:
            assert "${{" not in step.get("run", ""), step.get("name")


# --------------------------------------------------------------------------- GitLab CI


def test_gitlab_job_matches_the_vendored_schema():
    result = run(tool("check-jsonschema"), "--builtin-schema", "vendor.gitlab-ci", GITLAB_JOB)
    assert result.returncode == 0, result.stdout + result.stderr


def test_gitlab_schema_catches_a_broken_job(tmp_path):
    broken = broken_copy(GITLAB_JOB, tmp_path, "when: always", "when: sometimes")
    result = run(tool("check-jsonschema"), "--builtin-schema", "vendor.gitlab-ci", broken)
    assert result.returncode != 0


def test_gitlab_job_reports_junit_and_metrics_on_every_outcome(tmp_path):
    pipeline = load_yaml(GITLAB_JOB)
    assert set(pipeline) == {"healthcheck"}  # including it adds no global variables or stages
    job = pipeline["healthcheck"]
    assert job["artifacts"]["when"] == "always"
    assert job["artifacts"]["reports"] == {"junit": "$RUN_DIR/junit.xml", "metrics": "$RUN_DIR/metrics.txt"}
    assert job["script"] == ['"$HEALTHCHECK_VENV/bin/healthcheck" probe --config "$PROBE_CONFIG" --out "$RUN_DIR"']
    assert "-m healthcheck.integrations openmetrics \"$RUN_DIR\" --output \"$RUN_DIR/metrics.txt\"" in job["after_script"][0]
    script = "\n".join(job["before_script"] + job["script"] + job["after_script"])
    result = shellcheck_text(script, tmp_path)
    assert result.returncode == 0, result.stdout


# --------------------------------------------------------------------------- SLURM


def test_slurm_script_passes_shellcheck():
    result = run(tool("shellcheck"), SLURM_SCRIPT)
    assert result.returncode == 0, result.stdout


def test_shellcheck_catches_a_broken_script(tmp_path):
    broken = broken_copy(SLURM_SCRIPT, tmp_path, 'compare "$RUN_DIR"', "compare $RUN_DIR")
    result = run(tool("shellcheck"), broken)
    assert result.returncode != 0 and "SC2086" in result.stdout


def _run_slurm(tmp_path: Path, **exit_codes: int) -> tuple[int, list[str]]:
    log = tmp_path / "calls.log"
    stub_commands(tmp_path / "bin", log, **exit_codes)
    env = {
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node-[a-b]", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "4",
    }
    result = run("bash", SLURM_SCRIPT, "probes/cluster.yaml", env=env, cwd=tmp_path)
    return result.returncode, log.read_text().splitlines() if log.exists() else []


def test_slurm_script_starts_one_torchrun_agent_per_node_then_judges(tmp_path):
    code, calls = _run_slurm(tmp_path)
    assert code == 0
    assert calls[0] == "healthcheck config show --config probes/cluster.yaml"
    assert shlex.split(calls[1]) == [
        "srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
        "torchrun", "--nnodes", "2", "--nproc_per_node", "4", "--rdzv_backend", "c10d",
        "--rdzv_endpoint", "node-a:29500", "--rdzv_id", "healthcheck-42",
        "-m", "healthcheck", "probe", "--config", "probes/cluster.yaml", "--no-judge", "--out", "runs/slurm-42",
    ]
    assert calls[2] == "healthcheck compare runs/slurm-42"


@pytest.mark.parametrize(
    ("exit_codes", "expected", "judged"),
    [({"compare": 1}, 1, True), ({"compare": 2}, 2, True), ({"srun": 1}, 3, False), ({"config": 2}, 2, False)],
    ids=["inconsistent", "no-baseline", "launch-failed", "bad-config"],
)
def test_slurm_script_exit_code_is_healthchecks(tmp_path, exit_codes, expected, judged):
    code, calls = _run_slurm(tmp_path, **exit_codes)
    assert code == expected
    assert any(call.startswith("healthcheck compare") for call in calls) is judged


# --------------------------------------------------------------------------- Kubernetes


def _pytorchjob() -> dict:
    docs = [doc for doc in yaml.safe_load_all(PYTORCHJOB.read_text()) if doc]
    assert len(docs) == 1
    return docs[0]


def _container(job: dict, replica: str) -> dict:
    return job["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]["containers"][0]


def _env(container: dict) -> dict[str, str]:
    return {item["name"]: item.get("value") for item in container["env"]}


def test_pytorchjob_shape_is_consistent():
    job = _pytorchjob()
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert job["metadata"]["generateName"].endswith("-")
    assert job["spec"]["runPolicy"]["backoffLimit"] == 0
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    for name, spec in replicas.items():
        assert spec["restartPolicy"] == "Never"
        pod = spec["template"]["spec"]
        container = _container(job, name)
        assert container["name"] == "pytorch"  # the operator injects MASTER_ADDR/RANK into this container
        env = _env(container)
        assert int(env["NNODES"]) == sum(r["replicas"] for r in replicas.values())
        assert int(env["NPROC_PER_NODE"]) == int(container["resources"]["limits"]["nvidia.com/gpu"])
        script = container["args"][0]
        assert '--node_rank "$RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"' in script
        assert '-m healthcheck probe --config "$PROBE_CONFIG" --no-judge' in script
        volumes = {volume["name"] for volume in pod["volumes"]}
        assert {mount["name"] for mount in container["volumeMounts"]} <= volumes
    claim = next(v for v in replicas["Master"]["template"]["spec"]["volumes"] if v["name"] == "runs")
    pvc = load_yaml(RUNS_PVC)
    assert claim["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]


def _validate_kubernetes(resource: dict) -> None:
    import kubernetes_validate  # from the test extra; a missing one fails, never skips

    kubernetes_validate.validate(resource, kubernetes_validate.latest_version(), strict=True)


def test_pod_templates_and_volume_claim_match_the_kubernetes_schema():
    # The PyTorchJob is a CRD with no vendored schema; its pod templates are core PodTemplateSpecs.
    job = _pytorchjob()
    for name, spec in job["spec"]["pytorchReplicaSpecs"].items():
        _validate_kubernetes({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name.lower()}, "template": spec["template"]})
    _validate_kubernetes(load_yaml(RUNS_PVC))


def test_kubernetes_schema_catches_a_broken_pod_template():
    import kubernetes_validate

    template = _pytorchjob()["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    broken = yaml.safe_load(yaml.safe_dump(template))
    broken["spec"]["containers"][0]["volumeMount"] = broken["spec"]["containers"][0].pop("volumeMounts")
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_kubernetes({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": broken})


def test_pytorchjob_script_passes_shellcheck(tmp_path):
    result = shellcheck_text(_container(_pytorchjob(), "Master")["args"][0], tmp_path)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize(
    ("node_rank", "exit_codes", "expected", "judged"),
    [("0", {}, 0, True), ("0", {"compare": 1}, 1, True), ("0", {"torchrun": 1}, 3, False), ("1", {"torchrun": 1}, 1, False),
     ("1", {}, 0, False)],
    ids=["master-pass", "master-inconsistent", "master-launch-failed", "worker-failed", "worker-done"],
)
def test_pytorchjob_master_exit_code_is_healthchecks(tmp_path, node_rank, exit_codes, expected, judged):
    container = _container(_pytorchjob(), "Master")
    log = tmp_path / "calls.log"
    stub_commands(tmp_path / "bin", log, **exit_codes)
    env = {**{k: v for k, v in _env(container).items() if v is not None}, "JOB_NAME": "healthcheck-probe-x1",
           "RANK": node_rank, "MASTER_ADDR": "healthcheck-probe-x1-master-0", "MASTER_PORT": "23456",
           "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    result = run(*container["command"], container["args"][0], env=env, cwd=tmp_path)
    assert result.returncode == expected, result.stderr
    calls = log.read_text().splitlines()
    assert f"--node_rank {node_rank} --master_addr healthcheck-probe-x1-master-0 --master_port 23456" in calls[1]
    assert calls[1].endswith("--no-judge --out /runs/healthcheck-probe-x1")
    assert any(call == "healthcheck compare /runs/healthcheck-probe-x1" for call in calls) is judged


# --------------------------------------------------------------------------- OpenMetrics


def _families(text: str) -> dict:
    from prometheus_client.openmetrics import parser

    return {family.name: family for family in parser.text_string_to_metric_families(text)}


def gitlab_metrics(text: str) -> dict[str, str]:
    """GitLab's metrics-report reading of a file (Gitlab::Ci::Parsers::Metrics::Generic):
    drop everything after ``#``, shell-split, first word is the key, second the value."""
    metrics = {}
    for line in text.splitlines():
        words = shlex.split(line.split("#", 1)[0])
        if len(words) >= 2:
            assert words[0] not in metrics, f"GitLab would keep only one {words[0]}"
            metrics[words[0]] = words[1]
    return metrics


def test_openmetrics_of_a_run_parses_and_carries_every_window_statistic(tmp_path):
    result, _ = write_fake_run(tmp_path)
    text = openmetrics_from_result(result)
    assert text.endswith("# EOF\n") and text.count("# EOF") == 1
    families = _families(text)
    for metric, summary in result.summary.items():
        family = families[f"healthcheck_{metric}"]
        assert family.type == "gauge"
        got = {sample.labels["statistic"]: sample.value for sample in family.samples}
        assert got == pytest.approx({s: getattr(summary, s) for s in ("median", "p95", "min", "max")})
        assert {sample.labels["probe"] for sample in family.samples} == {result.name}
    assert families["healthcheck_probe_complete"].samples[0].value == 1.0
    assert families["healthcheck_world_size"].samples[0].value == result.environment.world_size
    assert families["healthcheck_wall_seconds"].unit == "seconds"
    reported = gitlab_metrics(text)
    assert reported[f'healthcheck_cosine_mean{{probe={result.name},statistic=median}}'] == repr(result.summary["cosine_mean"].median)
    assert len(reported) == sum(len(f.samples) for f in families.values())


def test_openmetrics_leaves_out_missing_statistics_of_a_crashed_run():
    result = RunResult(
        name="crash.probe-1", status="incomplete", failure="rank 3 failed at step 2", config=ProbeConfig(),
        config_fingerprint="f", timing=Timing(started_at="t"), steps_planned=60, steps_completed=2,
        summary={"loss_std": MetricSummary(median=0.5, p95=float("inf"), min=0.25, max=None, n=2), "cosine_mean": MetricSummary()},
    )
    text = openmetrics_from_result(result)
    families = _families(text)
    assert "healthcheck_cosine_mean" not in families and "healthcheck_world_size" not in families
    samples = {s.labels["statistic"]: s.value for s in families["healthcheck_loss_std"].samples}
    assert samples == {"median": 0.5, "p95": float("inf"), "min": 0.25}
    assert families["healthcheck_probe_complete"].samples[0].value == 0.0
    assert 'healthcheck_loss_std{probe="crash.probe-1",statistic="p95"} +Inf' in text.splitlines()


def test_openmetrics_command_writes_the_report_and_fails_cleanly_on_a_bad_run_dir(tmp_path, capsys):
    result, _ = write_fake_run(tmp_path / "run")
    assert integrations_main(["openmetrics", str(tmp_path / "run"), "--output", str(tmp_path / "metrics.txt")]) == 0
    assert (tmp_path / "metrics.txt").read_text() == openmetrics_from_result(result)
    assert integrations_main(["openmetrics", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("healthcheck: error: ") and "result.json: not found" in err and err.count("\n") == 1


# --------------------------------------------------------------------------- .ci/run and the README


def test_the_readme_test_command_is_exactly_what_ci_runs():
    script = (REPO / ".ci" / "run").read_text().splitlines()
    readme = (REPO / "README.md").read_text()
    command = script[-1]
    assert command.endswith("python3 -m pytest -q") and "install -y --no-install-recommends chromium" in command
    assert f"```bash\n{command}\n```" in readme
    assert run(tool("shellcheck"), REPO / ".ci" / "run").returncode == 0
    assert "python3 -m pip install -e '.[test]' -c .ci/constraints.txt" in command
    assert (REPO / "docs" / "report-fail.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the README's screenshot


def test_the_constraints_pin_every_requirement_of_the_test_install_but_torch():
    # A requirement added to pyproject.toml without a refreeze would float again in CI.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+, as CI runs
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {canonicalize_name(Requirement(line).name) for line in project["dependencies"] + project["optional-dependencies"]["test"]}
    pinned = {}
    for line in (REPO / ".ci" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and canonicalize_name(name) not in pinned, line  # exact pins, each once
            pinned[canonicalize_name(name)] = version
    assert wanted - {"torch"} <= set(pinned), wanted - {"torch"} - set(pinned)
    assert "torch" not in pinned and "healthcheck" not in pinned
