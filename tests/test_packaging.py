"""What the Comfy registry and ComfyUI Manager read: pyproject.toml, requirements.txt, the web folder."""
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

PACK_ROOT = Path(__file__).resolve().parent.parent


def pyproject():
    return tomllib.loads((PACK_ROOT / "pyproject.toml").read_text())


def test_project_table_is_complete():
    project = pyproject()["project"]
    assert re.fullmatch(r"[a-z0-9][a-z0-9-]*", project["name"])  # the registry's node id
    Version(project["version"])  # PEP 440, or this raises
    assert len(project["description"]) > 40
    assert project["dependencies"]
    assert project["license"] and project["requires-python"]


def test_registry_fields_present():
    comfy = pyproject()["tool"]["comfy"]
    assert comfy["PublisherId"] and comfy["DisplayName"]
    # The icon URL points into this repository; the file must be there.
    icon = re.search(r"/main/(.+)$", comfy["Icon"])
    assert comfy["Icon"].startswith("https://") and icon, comfy["Icon"]
    assert (PACK_ROOT / icon.group(1)).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # ComfyUI serves [tool.comfy] web under the project name as well as WEB_DIRECTORY under the
    # folder name: both would load the extension twice.
    assert "web" not in comfy


def test_requirements_txt_matches_pyproject_dependencies():
    # Manager installs requirements.txt, the registry reads pyproject: the same packages.
    lines = (PACK_ROOT / "requirements.txt").read_text().splitlines()
    from_txt = {Requirement(line).name for line in lines if line.strip() and not line.startswith("#")}
    from_toml = {Requirement(dep).name for dep in pyproject()["project"]["dependencies"]}
    assert from_txt == from_toml
    # torch comes with ComfyUI; a requirement on it would let pip replace ComfyUI's CUDA build.
    assert "torch" not in from_txt


def test_comfy_kitchen_requirement_admits_the_tested_version():
    # .ci/run runs these tests in each host's venv: 0.2.40 beside ComfyUI 0.3.75, and upstream
    # ComfyUI 0.33.0's pin 0.2.31. Admitting the host's pin keeps Manager from upgrading it.
    (kitchen,) = [Requirement(dep) for dep in pyproject()["project"]["dependencies"]
                  if Requirement(dep).name == "comfy-kitchen"]
    assert kitchen.specifier.contains(version("comfy-kitchen")), (str(kitchen), version("comfy-kitchen"))


def test_web_directory_holds_the_extension_and_docs():
    init = (PACK_ROOT / "__init__.py").read_text()
    web = re.search(r'WEB_DIRECTORY = "\./(\w+)"', init).group(1)
    assert (PACK_ROOT / web / "js" / "bigdit_report.js").exists()
    assert list((PACK_ROOT / web / "docs").glob("*.md"))
