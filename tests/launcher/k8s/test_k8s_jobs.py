"""Long-form jobs on Kubernetes (cosyvoice_lb/launcher/k8s/jobs.py): with --jobs-redis the pods
read the URL from the Secret (secretKeyRef; the URL in secret.yaml, 0600, and in no other file)
and keep the jobs' audio on the outputs volume they all mount; --jobs-redis-secret names a
Secret of one's own, refused with the fix when malformed; without a shared store `k8s render`
says the jobs live per pod."""

from __future__ import annotations

import base64
import stat

import pytest
import yaml
from conftest import clean_env, cli_here

from cosyvoice_lb.common.settings import Settings, envvar
from cosyvoice_lb.launcher.errors import ClusterError
from cosyvoice_lb.launcher.k8s.jobs import SHARED_RESULTS, parse_secret_ref
from cosyvoice_lb.launcher.k8s.manifests import Deployment, manifests, write_manifests

kubernetes_validate = pytest.importorskip("kubernetes_validate")
PASSWORD = "s3cret-pw-0123456789"
URL = f"redis://:{PASSWORD}@redis.jobs.svc:6379/2"
SHARED = Settings(jobs_redis=URL, instances="1")


def container(files: dict[str, str]) -> dict:
    deployment = yaml.safe_load(files["deployment.yaml"])
    return deployment["spec"]["template"]["spec"]["containers"][0]


def env_of(files: dict[str, str]) -> dict[str, dict]:
    return {e["name"]: e for e in container(files)["env"]}


def outputs_volume(files: dict[str, str]) -> tuple[str, dict]:
    """The outputs claim's mount path in the pod, and the claim."""
    pod = yaml.safe_load(files["deployment.yaml"])["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "outputs"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "outputs"]
    claims = [doc for doc in yaml.safe_load_all(files["volumes.yaml"]) if doc]
    (claim,) = [c for c in claims if c["metadata"]["name"] == volume["persistentVolumeClaim"]["claimName"]]
    return mount["mountPath"], claim


def test_the_url_reaches_the_pod_from_the_secret_only(tmp_path):
    written = write_manifests(SHARED, Deployment(), str(tmp_path / "k"))
    secret_file = tmp_path / "k" / "secret.yaml"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    secret = yaml.safe_load(secret_file.read_text())
    assert base64.b64decode(secret["data"]["jobs-redis"]).decode() == URL
    encoded = base64.b64encode(URL.encode()).decode()
    for path in written:
        if path != secret_file:
            text = path.read_text()
            assert PASSWORD not in text and encoded not in text, path.name
            assert stat.S_IMODE(path.stat().st_mode) == 0o644
    files = {path.name: path.read_text() for path in written}
    redis = env_of(files)[envvar("jobs_redis")]
    ref = {"name": secret["metadata"]["name"], "key": "jobs-redis"}
    assert redis == {"name": "COSYVOICE_LB_JOBS_REDIS", "valueFrom": {"secretKeyRef": ref}}  # (no plain value)
    assert not any(URL in part or PASSWORD in part for part in container(files)["command"])
    assert "args" not in container(files)
    for doc in (d for text in files.values() for d in yaml.safe_load_all(text) if d):
        if doc["kind"] in ("Deployment", "Secret"):
            kubernetes_validate.validate(doc, "1.30.0", strict=True)


def test_with_redis_the_jobs_audio_is_on_the_volume_every_pod_mounts():
    files = manifests(SHARED, Deployment())
    results = env_of(files)[envvar("job_results")]["value"]
    mount, claim = outputs_volume(files)
    assert results == SHARED_RESULTS and results.startswith(mount + "/")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    # beside the pods' own dirs, never taken for one: the outputs sweep skips dot names
    assert results.rsplit("/", 1)[-1].startswith(".")
    assert env_of(files)[envvar("outputs_dir")]["value"] == f"{mount}/$(POD_NAME)"


def test_without_redis_the_pod_has_neither_and_a_job_results_given_stays_out():
    env = env_of(manifests(Settings(instances="1", job_results="/elsewhere"), Deployment()))
    assert envvar("jobs_redis") not in env and envvar("job_results") not in env
    assert "jobs-redis" not in yaml.safe_load(manifests(Settings(instances="1"), Deployment())["secret.yaml"])["data"]


def test_an_existing_secret_is_referenced_and_no_url_is_written():
    files = manifests(Settings(instances="1"), Deployment(jobs_redis_secret=("redis-credentials", "url")))
    assert env_of(files)[envvar("jobs_redis")]["valueFrom"] == {
        "secretKeyRef": {"name": "redis-credentials", "key": "url"}
    }
    assert env_of(files)[envvar("job_results")]["value"] == SHARED_RESULTS
    assert "jobs-redis" not in yaml.safe_load(files["secret.yaml"])["data"]


@pytest.mark.parametrize(
    ("given", "found"),
    [("redis-credentials", ("redis-credentials", "jobs-redis")), ("a.b-c:redis_url.1", ("a.b-c", "redis_url.1"))],
)
def test_a_secret_ref_is_name_and_key(given, found):
    assert parse_secret_ref(given) == found


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ("Redis_Creds", "'Redis_Creds' is not a Secret's name"),
        ("", "'' is not a Secret's name"),
        ("creds:", "empty KEY after ':'"),
        ("creds:a/b", "'a/b' is not a Secret's key"),
        ("-creds", "'-creds' is not a Secret's name"),
    ],
)
def test_a_malformed_secret_ref_is_refused_saying_why(given, words):
    with pytest.raises(ValueError, match=words) as refused:
        parse_secret_ref(given)
    assert "NAME[:KEY]" in str(refused.value) or "e.g. --jobs-redis-secret" in str(refused.value)


def test_the_url_and_a_secret_of_ones_own_together_are_refused(tmp_path):
    with pytest.raises(ClusterError, match="--jobs-redis and --jobs-redis-secret creds:jobs-redis are both given"):
        write_manifests(SHARED, Deployment(jobs_redis_secret=("creds", "jobs-redis")), str(tmp_path / "k"))
    assert not (tmp_path / "k").exists()


def test_the_command_warns_without_a_shared_store_and_takes_either_form(tmp_path):
    alone = cli_here("k8s", "render", "--out", str(tmp_path / "a"), "--instances", "1")
    assert alone.returncode == 0, alone.stderr
    assert "long-form jobs (/v1/audio/jobs) live per pod" in alone.stderr
    assert "seen only by the pod that took it" in alone.stderr and "--jobs-redis" in alone.stderr
    assert "per pod" not in alone.stdout

    env = clean_env(**{envvar("jobs_redis"): URL})
    shared = cli_here("k8s", "render", "--out", str(tmp_path / "b"), "--instances", "1", env=env)
    assert shared.returncode == 0, shared.stderr
    assert "per pod" not in shared.stderr and PASSWORD not in shared.stdout + shared.stderr
    assert (
        URL
        in base64.b64decode(yaml.safe_load((tmp_path / "b" / "secret.yaml").read_text())["data"]["jobs-redis"]).decode()
    )

    own = cli_here("k8s", "render", "--out", str(tmp_path / "c"), "--instances", "1", "--jobs-redis-secret", "creds")
    assert own.returncode == 0, own.stderr
    assert "per pod" not in own.stderr
    pod = yaml.safe_load((tmp_path / "c" / "deployment.yaml").read_text())["spec"]["template"]["spec"]
    env_vars = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env_vars[envvar("jobs_redis")]["valueFrom"]["secretKeyRef"] == {"name": "creds", "key": "jobs-redis"}

    bad = cli_here("k8s", "render", "--out", str(tmp_path / "d"), "--jobs-redis-secret", "Creds:x")
    assert bad.returncode == 2 and "--jobs-redis-secret 'Creds:x': 'Creds' is not a Secret's name" in bad.stderr
    both = cli_here("k8s", "render", "--out", str(tmp_path / "e"), "--jobs-redis-secret", "creds", env=env)
    assert both.returncode == 2 and "give one" in both.stderr and PASSWORD not in both.stderr
    assert not (tmp_path / "d").exists() and not (tmp_path / "e").exists()
