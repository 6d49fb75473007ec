"""What the launcher imports on a script's behalf before it forks (healthcheck/run/script_preload.py)."""

from __future__ import annotations

import sys

import pytest

from healthcheck.run.script_preload import MODEL_BASE, SESSION_MODULES, preload_script_imports, preloadable_imports

pytestmark = pytest.mark.unit


def test_only_the_listed_libraries_at_the_top_level_are_read():
    source = (
        "import argparse\nimport torch\nfrom accelerate.utils import set_seed\nimport trl, numpy\n"
        "def main():\n    import peft\n"  # a local import is the function's: not read
        "if __name__ == '__main__':\n    main()\n"
    )
    assert preloadable_imports(source) == [("accelerate.utils", ("set_seed",)), ("trl", ())]


@pytest.mark.parametrize(
    "write",
    ["os.environ['HF_HUB_OFFLINE'] = '1'", "os.environ.setdefault('HF_HOME', '/scratch')", "os.putenv('X', '1')",
     "load_dotenv()", "from os import environ as env"],
)
def test_an_environment_write_before_an_import_stops_the_reading(write):
    # These libraries read variables such as HF_HUB_OFFLINE when imported: the script's own import must see its writes.
    source = f"import os\nimport datasets\n{write}\nimport transformers\n"
    assert preloadable_imports(source) == [("datasets", ())]


def test_a_script_that_does_not_parse_preloads_nothing():
    assert preloadable_imports("import transformers\ndef broken(:\n") == []


def test_a_folder_of_the_same_name_beside_the_script_stops_the_preload(tmp_path):
    # The worker, with the script's folder first on sys.path, imports the project's own datasets/, not ours.
    script = tmp_path / "train.py"
    script.write_text("import datasets\nimport transformers\n")
    (tmp_path / "datasets").mkdir()
    assert preload_script_imports(script) == [*SESSION_MODULES]
    (tmp_path / "datasets").rmdir()
    (tmp_path / "transformers.py").write_text("")
    assert preload_script_imports(script) == [*SESSION_MODULES, "datasets"]


def test_an_import_that_fails_is_left_to_the_script(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("import peft.no_such_module\nfrom transformers import AutoTokenizer\n")
    assert preload_script_imports(script) == [*SESSION_MODULES, "transformers"]
    assert "peft.no_such_module" not in sys.modules
    assert preload_script_imports(tmp_path / "missing.py") == []


@pytest.mark.parametrize(("source", "builds"), [
    ("from transformers import AutoTokenizer, AutoModelForCausalLM\n", True),
    ("from trl import SFTTrainer\n", True),
    ("import transformers\nmodel = transformers.LlamaForCausalLM(config)\n", True),
    ("from transformers import AutoTokenizer\nclass MyModel: pass\n", False),  # its own model: no transformers one
    ("import os\nos.environ['HF_HOME'] = '/x'\nfrom transformers import AutoModel\n", False),  # its write comes first
])
def test_the_model_base_is_loaded_for_a_script_that_builds_a_transformers_model(tmp_path, source, builds):
    script = tmp_path / "train.py"
    script.write_text(source)
    assert (MODEL_BASE in preload_script_imports(script)) is builds


def test_nothing_is_preloaded_on_a_build_that_could_touch_an_accelerator(tmp_path, monkeypatch):
    import torch

    script = tmp_path / "train.py"
    script.write_text("import transformers\n")
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a library asking is_available() would initialize the driver
    assert preload_script_imports(script) == []
