"""What `up` says about the instances' Python, from the report its probe prints there."""

from __future__ import annotations

from cosyvoice_lb.launcher.plan.preflight import INSTANCE_NEEDS, UPSTREAM_MODULE, env_problem

PY = "/opt/cv/bin/python"
NEEDS = {**INSTANCE_NEEDS, "torch": "torch"}


def report(**fields) -> dict:
    return {
        "missing": [],
        "broken": {},
        "python": "3.10.14",
        "versions": {"gradio": "5.4.0", "pydantic": "2.7.0"},
        "schema": "",
        **fields,
    }


def test_a_complete_environment_has_no_problem():
    assert env_problem(report(), NEEDS, PY) == ""


def test_missing_modules_are_named_with_the_packages_that_bring_them():
    problem = env_problem(report(missing=["gradio", "multipart"]), NEEDS, PY)
    assert "lacks gradio, multipart" in problem and "Python 3.10.14" in problem
    assert f"'{PY} -m pip install gradio python-multipart'" in problem


def test_what_upstream_cosyvoice_needed_is_named_before_the_checkout():
    problem = env_problem(report(missing=["hyperpyyaml"]), NEEDS, PY)
    assert f"'{PY} -m pip install HyperPyYAML'" in problem


def test_cosyvoice_itself_missing_asks_for_the_checkout():
    problem = env_problem(report(missing=["cosyvoice"]), NEEDS, PY)
    assert "--cosyvoice-root" in problem and "pip install" not in problem


def test_a_module_that_fails_to_import_is_named_with_its_error():
    problem = env_problem(report(broken={"gradio": "ImportError: cannot import name 'HfFolder'"}), NEEDS, PY)
    assert "cannot import gradio: ImportError: cannot import name 'HfFolder'" in problem
    problem = env_problem(report(broken={UPSTREAM_MODULE: "RuntimeError: no"}), NEEDS, PY)
    assert "cannot import upstream CosyVoice: RuntimeError: no" in problem


def test_a_gradio_that_cannot_read_pydantics_schema_is_refused_with_the_pin():
    problem = env_problem(
        report(
            versions={"gradio": "5.4.0", "pydantic": "2.11.7"},
            schema="TypeError: argument of type 'bool' is not iterable",
        ),
        NEEDS,
        PY,
    )
    assert "gradio 5.4.0 cannot read the API schema that pydantic 2.11.7 writes" in problem
    assert "answer 500" in problem and f"'{PY} -m pip install pydantic==2.7.0'" in problem


def test_missing_comes_before_broken_and_schema():
    problem = env_problem(report(missing=["soundfile"], broken={"gradio": "x"}, schema="y"), NEEDS, PY)
    assert "lacks soundfile" in problem and "gradio" not in problem


def test_upstreams_modules_are_named_by_the_packages_that_bring_them():
    problem = env_problem(report(missing=["whisper", "hydra", "yaml"]), NEEDS, PY)
    assert f"'{PY} -m pip install hydra-core openai-whisper pyyaml'" in problem
    assert "upstream CosyVoice's requirements.txt" in problem
    assert "requirements.txt" not in env_problem(report(missing=["gradio"]), NEEDS, PY)
